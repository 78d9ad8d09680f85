package driver

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
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
			return nil, failf(ErrPrecondition, "volume %s: unwrapping its passphrase with transit key %q: %v; check the node plugin's access to the transit engine",
				volumeID, tok.Token.KeyName, err)
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
			return nil, failf(ErrPrecondition, "volume %s: wrapping a new passphrase with transit key %q: %v; nothing was written to the disk",
				volumeID, d.cfg.TransitKey.Name, err)
		}
		return &StageEncryption{Passphrase: pass, FormatIfBlank: true, Token: &luks2.TransitToken{
			Mount: d.cfg.TransitKey.Mount, KeyName: d.cfg.TransitKey.Name, KeyVersion: ct.Version, Ciphertext: ct.Text}}, nil
	default:
		return nil, failf(ErrPrecondition, "volume %s is encrypted, but %s holds %s instead of a LUKS2 header; it is never formatted over data",
			volumeID, tok.Device, tok.Detail)
	}
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
