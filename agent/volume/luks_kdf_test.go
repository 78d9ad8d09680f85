package volume

import (
	"context"
	"errors"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// kdfImage formats an image file (no device-mapper needed: these tests
// never get past the unlock) whose only keyslot derives with kdf.
func kdfImage(t *testing.T, kdf luks2.KDFParams) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 32<<20); err != nil {
		t.Fatal(err)
	}
	v, err := luks2.Format(p, luks2.FormatOptions{Passphrase: []byte(secret), KDF: kdf, DigestIterations: 1000})
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
	return p
}

// Defect 5: the agent unlocks under the volume's lock, and a header's cost
// is whatever its writer chose. Open gives up when the request's context
// ends instead of finishing every key derivation first. (On the code
// before the fix it ran the derivation to its end and answered with a
// wrong passphrase, a second or more later.)
func TestLUKSOpenGivesUpWhenTheContextEnds(t *testing.T) {
	// Half a second or more of pbkdf2 (2^22 sha256 blocks); well inside
	// the header bounds.
	p := kdfImage(t, luks2.KDFParams{Type: "pbkdf2", Hash: "sha256", Iterations: 1 << 21})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := (&LUKS{}).Open(ctx, p, "vco-kdf-test", []byte("not the passphrase"), false)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the request's deadline, got %v", err)
	}
	if took > 700*time.Millisecond {
		t.Fatalf("Open answered %v after the request's deadline", took-200*time.Millisecond)
	}
}

// The agent's own bound applies when the caller sets none.
func TestLUKSOpenUnlockTimeout(t *testing.T) {
	p := kdfImage(t, luks2.KDFParams{Type: "pbkdf2", Hash: "sha256", Iterations: 1 << 21})
	l := &LUKS{UnlockTimeout: 200 * time.Millisecond}
	start := time.Now()
	_, err := l.Open(context.Background(), p, "vco-kdf-test", []byte("not the passphrase"), false)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "longer than the agent allows (200ms)") {
		t.Fatalf("want the agent's unlock timeout, got %v", err)
	}
	if took := time.Since(start); took > 700*time.Millisecond {
		t.Fatalf("Open took %v with a 200ms unlock timeout", took)
	}
}

// A keyslot declaring more memory than the agent allows is not derived at
// all, and the error says so. The default limit admits the agent's own
// keyslots.
func TestLUKSOpenSkipsKeyslotsAboveTheMemoryLimit(t *testing.T) {
	if DefaultKDFMaxMemoryKiB < luks2.DefaultKDF.MemoryKiB || DefaultKDFBudgetKiB < DefaultKDFMaxMemoryKiB {
		t.Fatalf("the default limits (%d KiB per derivation, %d KiB at once) do not admit the agent's own keyslots (%d KiB)",
			DefaultKDFMaxMemoryKiB, DefaultKDFBudgetKiB, luks2.DefaultKDF.MemoryKiB)
	}
	p := kdfImage(t, luks2.KDFParams{Type: "argon2id", Time: 1, MemoryKiB: 32 << 10, Threads: 1})
	l := &LUKS{KDFMaxMemoryKiB: 16 << 10}
	_, err := l.Open(context.Background(), p, "vco-kdf-test", []byte(secret), false)
	if !errors.Is(err, luks2.ErrKDFLimit) || !strings.Contains(err.Error(), "0 (32768 KiB)") {
		t.Fatalf("want the keyslot left out for its memory, got %v", err)
	}
}

// The agent does not format a volume its own unlock would refuse, and
// writes nothing when it refuses.
func TestLUKSFormatKeepsWithinTheUnlockLimit(t *testing.T) {
	p := filepath.Join(t.TempDir(), "blank.img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 32<<20); err != nil {
		t.Fatal(err)
	}
	l := &LUKS{KDF: luks2.KDFParams{MemoryKiB: 32 << 10}, KDFMaxMemoryKiB: 16 << 10}
	proof, err := blank.Prove(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	err = l.Format(context.Background(), proof, []byte(secret), wrapped)
	if err == nil || !strings.Contains(err.Error(), "cannot open") {
		t.Fatalf("want a refusal, got %v", err)
	}
	if ct, err := l.Inspect(context.Background(), p); err != nil || ct.Kind != ContentBlank {
		t.Fatalf("the refused format left %+v (%v)", ct, err)
	}
}
