package luks2

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// slowIterations makes a pbkdf2-sha256 keyslot of a 64-byte key take
// about a second here (2^23 hash blocks), well inside the bounds.
const slowIterations = 1 << 22

// withSlowSlots formats an image whose keyslot 0 opens with "correct
// horse" at the test cost and adds keyslots 1..n that copy its area but
// derive with slowIterations of pbkdf2: they take time and open nothing.
func withSlowSlots(t *testing.T, n int) string {
	t.Helper()
	p, v := formatImage(t, 32<<20, FormatOptions{})
	v.Close()
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		slots := m["keyslots"].(map[string]any)
		var ids []string
		for i := 1; i <= n; i++ {
			id := fmt.Sprint(i)
			s := map[string]any{}
			for k, v := range keyslot0(m) {
				s[k] = v
			}
			area := map[string]any{}
			for k, v := range s["area"].(map[string]any) {
				area[k] = v
			}
			area["offset"] = fmt.Sprint(2*formatHdrSize + i*258048)
			s["area"] = area
			s["kdf"] = map[string]any{"type": "pbkdf2", "hash": "sha256", "iterations": slowIterations, "salt": kdf0(m)["salt"]}
			slots[id] = s
			ids = append(ids, id)
		}
		digest0(m)["keyslots"] = append([]string{"0"}, ids...)
	})
	return p
}

// An unlock whose context ends stops: no further keyslot is tried and
// the derivation in flight is abandoned, so the caller gets its answer
// (and its lock back) when the context ends, not after every keyslot.
func TestUnlockContextStopsWhenTheContextEnds(t *testing.T) {
	p := withSlowSlots(t, 8)
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()

	key, slot, err := v.UnlockContext(context.Background(), []byte("correct horse"), UnlockLimits{})
	if err != nil || slot != 0 {
		t.Fatalf("the right passphrase: slot %d, %v", slot, err)
	}
	clear(key)

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err = v.UnlockContext(ctx, []byte("wrong"), UnlockLimits{})
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the deadline, got %v", err)
	}
	if took > 700*time.Millisecond {
		t.Fatalf("the unlock returned %v after its context ended", took-200*time.Millisecond)
	}
	t.Logf("gave up after %v: %v", took, err)
}

// A keyslot whose derivation declares more memory than allowed is not
// tried: the others still open, and when none does the error says which
// keyslots were left out and why.
func TestUnlockContextSkipsKeyslotsAboveTheMemoryLimit(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("zero")})
	if _, err := v.AddKeyslot([]byte("zero"), []byte("one"), testKDF); err != nil {
		t.Fatal(err)
	}
	v.Close()
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		setArgon(m, 1, 512<<10, 1) // keyslot 0: 512 MiB, 1 pass
	})
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	lim := UnlockLimits{MaxMemoryKiB: 64 << 10}

	key, slot, err := v.UnlockContext(context.Background(), []byte("one"), lim)
	if err != nil || slot != 1 {
		t.Fatalf("keyslot 1 within the limit: slot %d, %v", slot, err)
	}
	clear(key)
	_, _, err = v.UnlockContext(context.Background(), []byte("zero"), lim)
	if !errors.Is(err, ErrKDFLimit) || errors.Is(err, ErrWrongPassphrase) {
		t.Fatalf("want ErrKDFLimit, got %v", err)
	}
	for _, want := range []string{p, "0 (524288 KiB)", "65536 KiB"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q: %v", want, err)
		}
	}
}

// The budget bounds the derivations running at once, and a derivation
// abandoned by its caller keeps its share until it has finished.
func TestKDFBudgetHoldsAbandonedDerivations(t *testing.T) {
	b := NewKDFBudget(16<<10, 1)
	if _, err := b.acquire(context.Background(), 32<<10); !errors.Is(err, ErrKDFLimit) {
		t.Fatalf("a derivation above the whole budget: %v", err)
	}

	p := withSlowSlots(t, 1)
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		keyslot0(m)["priority"] = 0 // only the slow keyslot 1 is tried
	})
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	// Keyslot 1 takes about a second and is abandoned after 100 ms.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	pass := []byte("wrong")
	_, _, err = v.UnlockContext(ctx, pass, UnlockLimits{Budget: b})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the deadline, got %v", err)
	}
	clear(pass) // as callers do; the abandoned derivation has its own copy (go test -race)

	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if release, err := b.acquire(short, 8<<10); err == nil {
		release()
		t.Fatal("the budget admitted a derivation while the abandoned one still runs")
	}
	start := time.Now()
	release, err := b.acquire(context.Background(), 8<<10)
	if err != nil {
		t.Fatal(err)
	}
	release()
	t.Logf("the abandoned derivation held the budget for %v more", time.Since(start))
}
