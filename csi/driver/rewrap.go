package driver

import (
	"context"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// TokenRewriter is what a rewrap needs of the agent beyond NodeAgent:
// the token of a volume staged on this node, and the rewrite of it.
// csi/agentnode's Agent is one.
type TokenRewriter interface {
	StagedVolumeToken(ctx context.Context, volumeID string) (VolumeToken, error)
	UpdateVolumeToken(ctx context.Context, volumeID string, passphrase []byte, replaces, with luks2.TransitToken) (VolumeToken, error)
}

// Rewrapped is what Rewrap did to a volume's token: its key version before
// and after (equal when it was already the newest).
type Rewrapped struct {
	Key      string
	From, To int
}

// Rewrap brings the token of an encrypted volume staged on this node to
// the newest version of its transit key (docs/encryption.md, "Key
// rotation"): the transit engine rewraps the token's ciphertext; when the
// version is newer, both ciphertexts are unwrapped and must give the same
// passphrase, and the agent stores the new token in place of the old one
// once that passphrase has opened the volume. Nothing is written when
// the version is already the newest or any step fails. The passphrase is
// held only for the call.
func Rewrap(ctx context.Context, a TokenRewriter, w crypt.Wrapper, volumeID string) (Rewrapped, error) {
	tok, err := a.StagedVolumeToken(ctx, volumeID)
	if err != nil {
		return Rewrapped{}, err
	}
	if tok.Content != ContentLUKS2 || tok.Token == nil {
		return Rewrapped{}, failf(ErrPrecondition, "volume %s holds %s, not a LUKS2 header with a transit token: nothing to rewrap", volumeID, describeContent(tok))
	}
	old := *tok.Token
	r := Rewrapped{Key: old.KeyName, From: old.KeyVersion, To: old.KeyVersion}
	ct, err := w.Rewrap(ctx, old.KeyName, old.Ciphertext)
	if err != nil {
		return r, failf(ErrPrecondition, "volume %s: rewrapping its passphrase (version %d of transit key %q): %v; %s",
			volumeID, old.KeyVersion, old.KeyName, err, rewrapAdvice(err))
	}
	if ct.Version <= old.KeyVersion {
		return r, nil
	}
	pass, err := samePassphrase(ctx, w, volumeID, old, ct.Text)
	if err != nil {
		return r, err
	}
	defer clear(pass)
	with := luks2.TransitToken{Mount: old.Mount, KeyName: old.KeyName, KeyVersion: ct.Version, Ciphertext: ct.Text}
	if _, err := a.UpdateVolumeToken(ctx, volumeID, pass, old, with); err != nil {
		return r, fmt.Errorf("volume %s: storing its token rewrapped by version %d of transit key %q: %w", volumeID, ct.Version, old.KeyName, err)
	}
	r.To = ct.Version
	return r, nil
}

// rewrapAfterStage brings the token of an encrypted volume just staged to
// the newest version of its key (Rewrap), so that volumes rewrap as they
// are used after a rotation. It never fails the stage: what it did or why
// it could not is logged.
func (d *Driver) rewrapAfterStage(ctx context.Context, volumeID string) {
	a, ok := d.cfg.Agent.(TokenRewriter)
	if !ok {
		return
	}
	log := d.cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	r, err := Rewrap(ctx, a, d.cfg.Transit, volumeID)
	switch {
	case err != nil:
		log.Warn("the token of the volume just staged was not rewrapped; it stays usable with its key version", "volume", volumeID, "err", err)
	case r.To > r.From:
		log.Info("rewrapped the token of the volume just staged", "volume", volumeID, "key", r.Key, "from_version", r.From, "to_version", r.To)
	}
}

// samePassphrase unwraps the old token and the rewrap and returns the
// passphrase when both give the same one.
func samePassphrase(ctx context.Context, w crypt.Wrapper, volumeID string, old luks2.TransitToken, rewrapped string) ([]byte, error) {
	pass, err := w.Decrypt(ctx, old.KeyName, old.Ciphertext)
	if err != nil {
		return nil, unwrapFailure(volumeID, &old, err)
	}
	again, err := w.Decrypt(ctx, old.KeyName, rewrapped)
	if err != nil {
		clear(pass)
		return nil, failf(ErrPrecondition, "volume %s: unwrapping the rewrap of its passphrase with transit key %q: %v; nothing was written; %s",
			volumeID, old.KeyName, err, keyBackendAdvice(err))
	}
	defer clear(again)
	if subtle.ConstantTimeCompare(pass, again) != 1 {
		clear(pass)
		return nil, failf(ErrPrecondition, "volume %s: the transit engine's rewrap of its passphrase unwraps to another passphrase; nothing was written: check the key backend", volumeID)
	}
	return pass, nil
}

// rewrapAdvice adds to keyBackendAdvice what a refused rewrap most often
// means: a policy made before rewrap was in it.
func rewrapAdvice(err error) string {
	if a, ok := specificAdvice(err); ok {
		return a
	}
	return "the node plugin's policy must allow update on <transitMount>/rewrap/<transitKey> (docs/encryption.md)"
}

// describeContent names what a device holds, for a message.
func describeContent(t VolumeToken) string {
	switch {
	case t.Content == ContentLUKS2:
		return "a LUKS2 header without a transit token"
	case t.Detail != "":
		return fmt.Sprintf("%s (%s)", t.Content, t.Detail)
	}
	return string(t.Content)
}
