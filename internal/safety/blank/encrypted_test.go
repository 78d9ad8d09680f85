package blank

import (
	"context"
	"crypto/rand"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The plaintext of a freshly formatted LUKS2 volume reads as noise: Prove
// refuses it, ProveEncrypted accepts it, and neither accepts it once a
// filesystem's signature is there.
func TestProveEncryptedTakesNoiseNotSignatures(t *testing.T) {
	ctx := context.Background()
	p := filepath.Join(t.TempDir(), "plain.img")
	noise := make([]byte, 8<<20)
	if _, err := rand.Read(noise); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, noise, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Prove(ctx, p); err == nil {
		t.Fatal("Prove took noise for blank")
	}
	pr, err := ProveEncrypted(ctx, p)
	if err != nil || !pr.Valid() || pr.From() != 0 || pr.Device() != p {
		t.Fatalf("ProveEncrypted on noise: %+v %v", pr, err)
	}
	// The same noise with a filesystem made on it.
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", p).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	_, err = ProveEncrypted(ctx, p)
	if nb := (*NotBlankError)(nil); !errors.As(err, &nb) || !strings.Contains(nb.Found, "ext4") {
		t.Fatalf("ProveEncrypted on a filesystem: %v", err)
	}
}
