package luks2

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
)

var (
	tokenV1 = TransitToken{Mount: "transit-lab", KeyName: "vco-csi-volumes", KeyVersion: 1, Ciphertext: "vault:v1:b2xk"}
	tokenV2 = TransitToken{Mount: "transit-lab", KeyName: "vco-csi-volumes", KeyVersion: 2, Ciphertext: "vault:v2:bmV3"}
)

// memVolume formats a volume in memory with passphrase pass and tokenV1.
func memVolume(t *testing.T, pass string) *memDevice {
	t.Helper()
	m := &memDevice{b: make([]byte, formatDataOffset+1<<20)}
	tok := tokenV1
	if _, err := format(m, "mem", FormatOptions{Passphrase: []byte(pass), KDF: testKDF, DigestIterations: testDigestIter, TransitToken: &tok}); err != nil {
		t.Fatal(err)
	}
	return m
}

func openMem(t *testing.T, m device) *Volume {
	t.Helper()
	h, err := readHeader(m, "mem")
	if err != nil {
		t.Fatal(err)
	}
	return &Volume{path: "mem", f: m, Header: h, writable: true}
}

func TestReplaceTransitTokenStoresANewerWrapOfTheSamePassphrase(t *testing.T) {
	m := memVolume(t, "pass")
	v := openMem(t, m)
	if err := v.ReplaceTransitToken(context.Background(), []byte("pass"), tokenV1, tokenV2, UnlockLimits{}); err != nil {
		t.Fatal(err)
	}
	_, got, err := openMem(t, m).transitToken()
	if err != nil || got.Ciphertext != tokenV2.Ciphertext || got.KeyVersion != 2 || len(got.Keyslots) != 1 || got.Keyslots[0] != 0 {
		t.Fatalf("the token after the replacement: %+v, %v; want version 2 bound to keyslot 0", got, err)
	}
	if _, _, err := openMem(t, m).Unlock([]byte("pass")); err != nil {
		t.Fatalf("the passphrase after the replacement: %v", err)
	}
}

// A replacement that is not a newer wrap by the same key, a token that
// changed since it was read, or a passphrase that does not open the
// volume writes nothing.
func TestReplaceTransitTokenRefusesAndWritesNothing(t *testing.T) {
	other := tokenV2
	other.KeyName = "another-key"
	otherMount := tokenV2
	otherMount.Mount = "transit-other"
	same := tokenV1
	same.Ciphertext = "vault:v1:YWdhaW4"
	badPrefix := tokenV2
	badPrefix.Ciphertext = "vault:v3:bmV3"
	stale := tokenV1
	stale.Ciphertext = "vault:v1:c3RhbGU"
	for _, c := range []struct {
		name              string
		pass              string
		replaces, with    TransitToken
		says              string
		isChanged, wrongP bool
	}{
		{"changed since read", "pass", stale, tokenV2, "changed since it was read", true, false},
		{"wrong passphrase", "wrong", tokenV1, tokenV2, "does not open the volume", false, true},
		{"another key", "pass", tokenV1, other, "a rewrap keeps the key", false, false},
		{"another mount", "pass", tokenV1, otherMount, "a rewrap keeps the key", false, false},
		{"not newer", "pass", tokenV1, same, "not newer", false, false},
		{"ciphertext of another version", "pass", tokenV1, badPrefix, "not a transit ciphertext of key version 2", false, false},
	} {
		m := memVolume(t, "pass")
		before := bytes.Clone(m.b)
		err := openMem(t, m).ReplaceTransitToken(context.Background(), []byte(c.pass), c.replaces, c.with, UnlockLimits{})
		if err == nil || !strings.Contains(err.Error(), c.says) || errors.Is(err, ErrTokenChanged) != c.isChanged || errors.Is(err, ErrWrongPassphrase) != c.wrongP {
			t.Errorf("%s: %v, want a refusal saying %q", c.name, err, c.says)
		}
		if !bytes.Equal(before, m.b) {
			t.Errorf("%s: the refusal wrote to the device", c.name)
		}
	}
}

// tornDevice is crashDevice whose last write lands cut short: the first
// half of it reaches the device, as a power cut in the middle of a
// multi-sector write may leave it.
type tornDevice struct{ crashDevice }

func (c *tornDevice) WriteAt(b []byte, off int64) (int, error) {
	if c.budget == 0 {
		c.budget--
		_, _ = c.device.WriteAt(b[:len(b)/2], off)
		return 0, errors.New("simulated crash in the middle of a write")
	}
	return c.crashDevice.WriteAt(b, off)
}

// A replacement cut short after any number of writes and syncs, with its
// last write whole or torn, leaves a header that reads, holding the old
// token or the new one, and the passphrase opens the volume.
func TestReplaceTransitTokenCrashLeavesAVolumeThatUnlocks(t *testing.T) {
	sawOld, sawNew := false, false
	for _, torn := range []bool{false, true} {
		complete := false
		for budget := 0; !complete; budget++ {
			m := memVolume(t, "pass")
			var dev device = &crashDevice{device: m, budget: budget}
			if torn {
				dev = &tornDevice{crashDevice{device: m, budget: budget}}
			}
			v := openMem(t, m)
			v.f = dev
			complete = v.ReplaceTransitToken(context.Background(), []byte("pass"), tokenV1, tokenV2, UnlockLimits{}) == nil
			after := openMem(t, m)
			_, tok, err := after.transitToken()
			switch {
			case err != nil || tok == nil:
				t.Fatalf("torn %v, after %d writes: the token reads %+v, %v", torn, budget, tok, err)
			case tok.Ciphertext == tokenV1.Ciphertext && !complete:
				sawOld = true
			case tok.Ciphertext == tokenV2.Ciphertext:
				sawNew = true
			default:
				t.Fatalf("torn %v, after %d writes (complete %v): token %+v", torn, budget, complete, tok)
			}
			if _, _, err := after.Unlock([]byte("pass")); err != nil {
				t.Fatalf("torn %v, after %d writes: the passphrase no longer opens the volume: %v", torn, budget, err)
			}
			if budget > 50 {
				t.Fatal("the replacement never completes")
			}
		}
	}
	if !sawOld || !sawNew {
		t.Fatalf("the crash points never left the old token (%v) or the new one (%v)", sawOld, sawNew)
	}
}
