package crypt

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
)

// Wrapper is what the passphrase flow needs from a transit engine;
// *transit.Client is the implementation.
type Wrapper interface {
	Encrypt(ctx context.Context, key string, plaintext []byte) (transit.Ciphertext, error)
	Decrypt(ctx context.Context, key, ciphertext string) ([]byte, error)
	Rewrap(ctx context.Context, key, ciphertext string) (transit.Ciphertext, error)
}

// TransitKey names the transit key that wraps volume passphrases.
type TransitKey struct {
	Mount string // transit mount path, recorded in the token
	Name  string
}

// newPassphrase is 32 random bytes as base64 text, so that an operator who
// unwraps one by hand can pass it through files and pipes unchanged.
func newPassphrase() ([]byte, error) {
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return nil, err
	}
	defer clear(raw)
	out := make([]byte, base64.RawStdEncoding.EncodedLen(len(raw)))
	base64.RawStdEncoding.Encode(out, raw)
	return out, nil
}

// FormatWrapped formats device with a new random passphrase, wrapped by the
// transit key and recorded in the first header as a vco-transit token. The
// passphrase is wrapped before anything is written, so an unreachable or
// refusing transit engine leaves the device untouched. It returns the open
// volume; the passphrase is not kept.
func FormatWrapped(ctx context.Context, w Wrapper, key TransitKey, device string, o luks2.FormatOptions) (*luks2.Volume, error) {
	pass, err := newPassphrase()
	if err != nil {
		return nil, err
	}
	defer clear(pass)
	ct, err := w.Encrypt(ctx, key.Name, pass)
	if err != nil {
		return nil, fmt.Errorf("format %s: wrap the new passphrase: %w", device, err)
	}
	o.Passphrase = pass
	o.TransitToken = &luks2.TransitToken{Mount: key.Mount, KeyName: key.Name, KeyVersion: ct.Version, Ciphertext: ct.Text}
	return luks2.Format(device, o)
}

// UnwrapPassphrase reads the volume's vco-transit token and asks the
// transit engine for the passphrase. The caller must clear it.
func UnwrapPassphrase(ctx context.Context, w Wrapper, v *luks2.Volume) ([]byte, error) {
	_, tok, err := v.TransitToken()
	if err != nil {
		return nil, err
	}
	if tok == nil {
		return nil, fmt.Errorf("%s: no %s token: the volume's passphrase is not held by a transit key", v.Path(), luks2.TransitTokenType)
	}
	pass, err := w.Decrypt(ctx, tok.KeyName, tok.Ciphertext)
	if err != nil {
		return nil, fmt.Errorf("%s: unwrap the passphrase: %w", v.Path(), err)
	}
	return pass, nil
}

// RewrapToken re-encrypts the stored ciphertext under the newest version of
// its transit key (after the key was rotated in Vault) and stores it. The
// passphrase and keyslots do not change.
func RewrapToken(ctx context.Context, w Wrapper, v *luks2.Volume) (int, error) {
	_, tok, err := v.TransitToken()
	if err != nil {
		return 0, err
	}
	if tok == nil {
		return 0, fmt.Errorf("%s: no %s token to rewrap", v.Path(), luks2.TransitTokenType)
	}
	ct, err := w.Rewrap(ctx, tok.KeyName, tok.Ciphertext)
	if err != nil {
		return 0, fmt.Errorf("%s: rewrap: %w", v.Path(), err)
	}
	if ct.Version == tok.KeyVersion && ct.Text == tok.Ciphertext {
		return ct.Version, nil
	}
	tok.KeyVersion, tok.Ciphertext = ct.Version, ct.Text
	if _, err := v.SetTransitToken(*tok); err != nil {
		return 0, err
	}
	return ct.Version, nil
}

// RotatePassphrase replaces the volume's passphrase with a new random one.
// Each step leaves a working keyslot whose passphrase the token unwraps:
// the new keyslot is added first (the token still opens the old one), then
// the token is switched to the new passphrase, and only then are the old
// keyslots removed.
func RotatePassphrase(ctx context.Context, w Wrapper, v *luks2.Volume, kdf luks2.KDFParams) error {
	_, tok, err := v.TransitToken()
	if err != nil {
		return err
	}
	if tok == nil {
		return fmt.Errorf("%s: no %s token: nothing to rotate", v.Path(), luks2.TransitTokenType)
	}
	old, err := UnwrapPassphrase(ctx, w, v)
	if err != nil {
		return err
	}
	defer clear(old)
	pass, err := newPassphrase()
	if err != nil {
		return err
	}
	defer clear(pass)
	ct, err := w.Encrypt(ctx, tok.KeyName, pass)
	if err != nil {
		return fmt.Errorf("%s: wrap the new passphrase: %w", v.Path(), err)
	}
	slot, err := v.AddKeyslot(old, pass, kdf)
	if err != nil {
		return err
	}
	oldSlots := tok.Keyslots
	tok.Keyslots, tok.KeyVersion, tok.Ciphertext = []int{slot}, ct.Version, ct.Text
	if _, err := v.SetTransitToken(*tok); err != nil {
		return err
	}
	var errs []error
	for _, s := range oldSlots {
		if err := v.RemoveKeyslot(s, pass); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s: new passphrase in keyslot %d and token updated, but an old keyslot remains: %w", v.Path(), slot, errors.Join(errs...))
	}
	return nil
}
