package luks2

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	luksgo "github.com/anatol/luks.go"
)

// luksGoUnsealer is luks.go's keyslot code as package crypt calls it,
// recording which keyslots it was asked to open.
type luksGoUnsealer struct {
	d     luksgo.Device
	mu    sync.Mutex
	tried []int
}

func (u *luksGoUnsealer) unseal(slot int, pass []byte) (*luksgo.Volume, error) {
	u.mu.Lock()
	u.tried = append(u.tried, slot)
	u.mu.Unlock()
	vol, err := u.d.UnsealVolume(slot, pass)
	if errors.Is(err, luksgo.ErrPassphraseDoesNotMatch) {
		return nil, ErrWrongPassphrase
	}
	return vol, err
}

func openLuksGo(t *testing.T, p string) *luksGoUnsealer {
	t.Helper()
	d, err := luksgo.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return &luksGoUnsealer{d: d}
}

// Unseal hands luks.go only the keyslots UnlockContext would try: one
// declaring more memory than allowed is never given to it, and the error
// says so as UnlockContext's does.
func TestUnsealKeepsTheMemoryLimit(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("zero")})
	if _, err := v.AddKeyslot([]byte("zero"), []byte("one"), testKDF); err != nil {
		t.Fatal(err)
	}
	v.Close()
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		setArgon(m, 1, 512<<10, 1) // keyslot 0: 512 MiB
	})
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	lim := UnlockLimits{MaxMemoryKiB: 64 << 10, Budget: NewKDFBudget(64<<10, 1)}

	u := openLuksGo(t, p)
	vol, slot, err := Unseal(context.Background(), v, []byte("one"), lim, u.unseal, nil)
	if err != nil || slot != 1 || vol == nil || vol.UUID != v.Header.UUID {
		t.Fatalf("keyslot 1 within the limit: slot %d, %+v, %v", slot, vol, err)
	}
	u.tried = nil
	_, _, err = Unseal(context.Background(), v, []byte("zero"), lim, u.unseal, nil)
	if !errors.Is(err, ErrKDFLimit) || !strings.Contains(err.Error(), "0 (524288 KiB)") {
		t.Fatalf("want ErrKDFLimit naming keyslot 0, got %v", err)
	}
	if !slices.Equal(u.tried, []int{1}) {
		t.Fatalf("luks.go was asked to open keyslots %v, want only [1]", u.tried)
	}
	if _, _, err := Unseal(context.Background(), v, []byte("neither"), UnlockLimits{MaxMemoryKiB: 64 << 10}, u.unseal, nil); !errors.Is(err, ErrKDFLimit) {
		t.Fatalf("a wrong passphrase with a keyslot left out: %v", err)
	}
}

// An unseal whose context ends returns then, not when luks.go's key
// derivation is done; what that derivation returns later is discarded.
func TestUnsealStopsWhenTheContextEnds(t *testing.T) {
	p := withSlowSlots(t, 1)
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		keyslot0(m)["priority"] = 0 // only the slow keyslot 1 is tried
	})
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	u := openLuksGo(t, p)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err = Unseal(ctx, v, []byte("wrong"), UnlockLimits{}, u.unseal, func(*luksgo.Volume) {})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "abandoned") {
		t.Fatalf("want the deadline, got %v", err)
	}
	if took := time.Since(start); took > 600*time.Millisecond {
		t.Fatalf("the unseal returned %v after its context ended", took-100*time.Millisecond)
	}
}

// The token is read with luks.go and must agree with the header this
// package validated: a header rewritten since (here by another handle)
// is refused instead of answered from either reading.
func TestTransitTokenReadByLuksGoMustAgree(t *testing.T) {
	tok := &TransitToken{Mount: "transit", KeyName: "volumes", KeyVersion: 1, Ciphertext: "vault:v1:one"}
	p, v := formatImage(t, 32<<20, FormatOptions{TransitToken: tok})
	id, got, err := v.TransitToken()
	if err != nil || id != 0 || got.KeyName != "volumes" || got.Ciphertext != "vault:v1:one" || !slices.Equal(got.Keyslots, []int{0}) {
		t.Fatalf("token %d %+v %v", id, got, err)
	}
	w, err := Open(p, true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.SetTransitToken(TransitToken{Keyslots: []int{0}, Mount: "transit", KeyName: "volumes", KeyVersion: 2, Ciphertext: "vault:v2:two"}); err != nil {
		t.Fatal(err)
	}
	if _, got, err := v.TransitToken(); err == nil || !strings.Contains(err.Error(), "luks.go reads the vco-transit token differently") {
		t.Fatalf("a header rewritten after it was validated: token %+v, %v", got, err)
	}
	if _, got, err := w.TransitToken(); err != nil || got.KeyVersion != 2 || got.Ciphertext != "vault:v2:two" {
		t.Fatalf("the rewritten token: %+v %v", got, err)
	}
}

// With the primary header damaged luks.go cannot read the volume; the
// token comes from the secondary copy, through this package.
func TestTransitTokenFromTheSecondaryWhenThePrimaryIsDamaged(t *testing.T) {
	tok := &TransitToken{KeyName: "volumes", KeyVersion: 1, Ciphertext: "vault:v1:one"}
	p, v := formatImage(t, 32<<20, FormatOptions{TransitToken: tok})
	v.Close()
	corrupt(t, p, offCsum, []byte{1, 2, 3})
	if _, err := luksgo.Open(p); err == nil {
		t.Fatal("luks.go read a primary header with a wrong checksum")
	}
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if v.Header.Source != "secondary" {
		t.Fatalf("read from %s", v.Header.Source)
	}
	if _, got, err := v.TransitToken(); err != nil || got == nil || got.Ciphertext != "vault:v1:one" {
		t.Fatalf("token %+v %v", got, err)
	}
}

// luks.go unlocks from the Snapshot, which holds the header as it was
// validated: a header rewritten on the device afterwards (here with a key
// derivation cost far beyond the bounds, which would keep luks.go busy for
// days) is not what luks.go reads.
func TestSnapshotIsWhatWasValidated(t *testing.T) {
	pass := []byte("pw")
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: pass, KDF: KDFParams{Type: "pbkdf2", Iterations: 1000}})
	before := readRange(t, p, 0, formatHdrSize)
	rewriteJSON(t, p, 1, []bool{true, false}, func(m map[string]any) {
		kdf0(m)["iterations"] = 1 << 30
	})
	if bytes.Equal(readRange(t, p, 0, formatHdrSize), before) {
		t.Fatal("the header on the device was not rewritten")
	}
	if _, err := Open(p, false); err == nil {
		t.Fatal("the validator admitted 2^30 pbkdf2 iterations")
	}
	snap, err := v.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	if got := readRange(t, SnapshotPath(snap), 0, formatHdrSize); !bytes.Equal(got, before) {
		t.Fatal("the snapshot's header is not the primary copy that was validated")
	}
	d, err := luksgo.Open(SnapshotPath(snap))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	start := time.Now()
	vol, err := d.UnsealVolume(0, pass)
	if err != nil || vol.UUID != v.Header.UUID {
		t.Fatalf("luks.go on the snapshot: %+v %v", vol, err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("luks.go took %v: it derived with the rewritten cost", took)
	}
}

// A volume read from its secondary copy snapshots that copy as the
// primary, which luks.go reads.
func TestSnapshotOfTheSecondary(t *testing.T) {
	pass := []byte("pw")
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: pass})
	v.Close()
	corrupt(t, p, binHeaderSize+10, []byte("garbage"))
	v, err := Open(p, false)
	if err != nil || v.Header.Source != "secondary" {
		t.Fatalf("%+v %v", v, err)
	}
	defer v.Close()
	snap, err := v.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	d, err := luksgo.Open(SnapshotPath(snap))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.UnsealVolume(0, pass); err != nil {
		t.Fatal(err)
	}
}

func readRange(t *testing.T, p string, off, n int64) []byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}
