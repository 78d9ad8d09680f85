package driver

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
)

// passphrase gets what the agent needs to open an encrypted volume. The
// agent reads the device first: a LUKS2 header's transit token is
// unwrapped; a blank device gets a new random passphrase, wrapped before
// anything is written, which the agent formats with and records in the
// header; anything else is never formatted. The passphrase lives only in
// memory for the one stage call.
func (d *Driver) passphrase(ctx context.Context, volumeID string, pc map[string]string) (*StageEncryption, error) {
	tok, err := d.cfg.Agent.VolumeToken(ctx, volumeID, pc)
	if err != nil {
		return nil, fmt.Errorf("reading the LUKS2 header of volume %s: %w", volumeID, err)
	}
	switch tok.Content {
	case ContentLUKS2:
		if tok.Token == nil {
			return nil, failf(ErrPrecondition, "volume %s: the LUKS2 header on %s has no vco-transit token, so its passphrase is not held by the transit engine; "+
				"it was not formatted by vco-storage and cannot be opened by it", volumeID, tok.Device)
		}
		pass, err := d.cfg.Transit.Decrypt(ctx, tok.Token.KeyName, tok.Token.Ciphertext)
		if err != nil {
			return nil, unwrapFailure(volumeID, tok.Token, err)
		}
		return &StageEncryption{Passphrase: pass}, nil
	case ContentBlank:
		pass, err := newPassphrase()
		if err != nil {
			return nil, err
		}
		ct, err := d.cfg.Transit.Encrypt(ctx, d.cfg.TransitKey.Name, pass)
		if err != nil {
			clear(pass)
			return nil, failf(ErrPrecondition, "volume %s: wrapping a new passphrase with transit key %q: %v; nothing was written to the disk; %s",
				volumeID, d.cfg.TransitKey.Name, err, keyBackendAdvice(err))
		}
		return &StageEncryption{Passphrase: pass, FormatIfBlank: true, Token: &luks2.TransitToken{
			Mount: d.cfg.TransitKey.Mount, KeyName: d.cfg.TransitKey.Name, KeyVersion: ct.Version, Ciphertext: ct.Text}}, nil
	default:
		return nil, failf(ErrPrecondition, "volume %s is encrypted, but %s holds %s instead of a LUKS2 header; it is never formatted over data",
			volumeID, tok.Device, tok.Detail)
	}
}

// unwrapFailure says why the passphrase of volume, wrapped as tok says,
// could not be unwrapped, and what the operator can do.
func unwrapFailure(volumeID string, tok *luks2.TransitToken, err error) error {
	var te *transit.Error
	if errors.As(err, &te) && te.TooOld() {
		return failf(ErrPrecondition, "volume %s: its passphrase is wrapped by version %d of transit key %q (mount %s), "+
			"which the key's min_decryption_version no longer allows; set min_decryption_version to %d or lower and the kubelet's retry opens it "+
			"(rewrap every volume before raising it: docs/encryption.md, \"Key rotation\")",
			volumeID, tok.KeyVersion, tok.KeyName, tok.Mount, tok.KeyVersion)
	}
	return failf(ErrPrecondition, "volume %s: unwrapping its passphrase (version %d of transit key %q): %v; %s",
		volumeID, tok.KeyVersion, tok.KeyName, err, keyBackendAdvice(err))
}

// keyBackendAdvice is what the operator can do about a failed request to
// the key backend.
func keyBackendAdvice(err error) string {
	if a, ok := specificAdvice(err); ok {
		return a
	}
	return "check the node plugin's access to the transit engine"
}

// specificAdvice is what to do about a key backend's answer that says
// its cause (sealed, no answer, a login refused); false for any other.
func specificAdvice(err error) (string, bool) {
	var te *transit.Error
	switch {
	case !errors.As(err, &te):
		return "", false
	case te.Sealed():
		return "the key backend is sealed: unseal it and the kubelet's retry stages the volume", true
	case te.Unanswered():
		return "the key backend did not answer: check csi-key-backend-config's address and the network from this node to it", true
	case te.LoginRefused():
		return "the key backend refused the node plugin's login: check that the role binds the node plugin's ServiceAccount, its namespace and the audience vault (docs/encryption.md)", true
	}
	return "", false
}

// newPassphrase is 32 random bytes as base64 text, the form package crypt
// formats volumes with, so an operator who unwraps one by hand can pass it
// through files and pipes unchanged.
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
