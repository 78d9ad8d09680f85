package crypt

import (
	"bytes"
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
)

var testKDF = luks2.KDFParams{Type: "argon2id", Time: 4, MemoryKiB: 8 << 10, Threads: 1}

// fakeTransit runs the real client against the FAKE transit engine.
func fakeTransit(t *testing.T) (*transittest.Fake, *transit.Client) {
	t.Helper()
	f := transittest.New()
	f.Rotate("volumes")
	f.StaticToken("hvs.test")
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c, err := transit.New(transit.Config{Address: srv.URL, Token: "hvs.test"})
	if err != nil {
		t.Fatal(err)
	}
	return f, c
}

func image(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "vol.img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 32<<20); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestWrappedPassphraseLifecycle(t *testing.T) {
	f, c := fakeTransit(t)
	ctx := context.Background()
	p := image(t)
	key := TransitKey{Mount: "transit", Name: "volumes"}
	v, err := FormatWrapped(ctx, c, key, p, luks2.FormatOptions{KDF: testKDF, DigestIterations: 1000})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	checkTokenInTheFirstHeader(t, v)
	pass, key0 := unwrapOpensAndIsNotStored(ctx, t, c, v, p)

	// Key rotation in Vault, then rewrap: same passphrase, newer version.
	f.Rotate("volumes")
	ver, err := RewrapToken(ctx, c, v)
	if err != nil || ver != 2 {
		t.Fatalf("rewrap: %d %v", ver, err)
	}
	f.MinDecryptionVersion["volumes"] = 2
	pass2, err := UnwrapPassphrase(ctx, c, v)
	if err != nil || !bytes.Equal(pass, pass2) {
		t.Fatalf("after rewrap: %v", err)
	}

	rotatePassphraseKeepsTheKey(ctx, t, c, v, pass, key0)
}

// checkTokenInTheFirstHeader: the transit token of a volume just formatted
// is in slot 0, names the key and its version 1, and was written with the
// header's first generation.
func checkTokenInTheFirstHeader(t *testing.T, v *luks2.Volume) {
	t.Helper()
	id, tok, err := v.TransitToken()
	if err != nil || id != 0 || tok.KeyVersion != 1 || tok.KeyName != "volumes" || tok.Mount != "transit" || !strings.HasPrefix(tok.Ciphertext, "vault:v1:") {
		t.Fatalf("token %d %+v %v", id, tok, err)
	}
	if v.Header.Seqid != 1 {
		t.Fatalf("the token was written in a second header generation (seqid %d)", v.Header.Seqid)
	}
}

// unwrapOpensAndIsNotStored unwraps the passphrase of the volume on image
// p: it opens the volume (for cryptsetup too, where installed) and is
// nowhere in the header. It returns the passphrase and the volume key.
func unwrapOpensAndIsNotStored(ctx context.Context, t *testing.T, c *transit.Client, v *luks2.Volume, p string) (pass, volumeKey []byte) {
	t.Helper()
	pass, err := UnwrapPassphrase(ctx, c, v)
	if err != nil {
		t.Fatal(err)
	}
	key0, _, err := v.Unlock(pass)
	if err != nil {
		t.Fatalf("the unwrapped passphrase does not open the volume: %v", err)
	}
	// The passphrase is nowhere in the header.
	raw, _ := os.ReadFile(p)
	if bytes.Contains(raw[:64<<10], pass) {
		t.Fatal("the plaintext passphrase is stored on the device")
	}
	if _, err := exec.LookPath("cryptsetup"); err == nil {
		cmd := exec.Command("cryptsetup", "open", "--test-passphrase", "--key-file", "-", p)
		cmd.Stdin = bytes.NewReader(pass)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("cryptsetup: %v %s", err, out)
		}
	}
	return pass, key0
}

// rotatePassphraseKeepsTheKey: passphrase rotation makes a new keyslot,
// the token follows, the old slot (and passphrase pass) goes; the volume
// key key0 stays.
func rotatePassphraseKeepsTheKey(ctx context.Context, t *testing.T, c *transit.Client, v *luks2.Volume, pass, key0 []byte) {
	t.Helper()
	if err := RotatePassphrase(ctx, c, v, testKDF); err != nil {
		t.Fatal(err)
	}
	if _, _, err := v.Unlock(pass); err == nil {
		t.Fatal("the old passphrase still opens the volume")
	}
	pass3, err := UnwrapPassphrase(ctx, c, v)
	if err != nil {
		t.Fatal(err)
	}
	key1, slot, err := v.Unlock(pass3)
	if err != nil || slot != 1 || !bytes.Equal(key0, key1) {
		t.Fatalf("after rotation: slot %d %v", slot, err)
	}
	if got := v.Slots(); len(got) != 1 {
		t.Fatalf("slots %v", got)
	}
}

// A transit engine that refuses leaves the device untouched.
func TestFormatWrappedWritesNothingWhenTransitFails(t *testing.T) {
	_, c := fakeTransit(t)
	p := image(t)
	_, err := FormatWrapped(context.Background(), c, TransitKey{Name: "no-such-key"}, p, luks2.FormatOptions{KDF: testKDF})
	if err == nil || !strings.Contains(err.Error(), "no-such-key") || !strings.Contains(err.Error(), p) {
		t.Fatalf("FormatWrapped with a missing key: %v", err)
	}
	raw, _ := os.ReadFile(p)
	for _, b := range raw {
		if b != 0 {
			t.Fatal("the device was written")
		}
	}
}
