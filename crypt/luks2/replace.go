package luks2

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// ErrTokenChanged is ReplaceTransitToken's refusal when the volume's
// vco-transit token is no longer the one the caller read.
var ErrTokenChanged = errors.New("the volume's transit token changed since it was read")

// ReplaceTransitToken stores with in place of the volume's vco-transit
// token, which must still be replaces (else ErrTokenChanged): a rewrap of
// the same passphrase by a newer version of the same transit key. Before
// anything is written, passphrase must open one of the token's keyslots
// (within lim), so a token is only replaced by the caller who holds the
// volume's passphrase; the caller has checked that with unwraps to it.
// The keyslots stay those of the old token. The write is the header's
// own (writeHeaders): a crash at any point leaves the old token or the
// new one, each of which unwraps to the same passphrase.
func (v *Volume) ReplaceTransitToken(ctx context.Context, passphrase []byte, replaces, with TransitToken, lim UnlockLimits) error {
	_, cur, err := v.transitToken()
	if err != nil {
		return err
	}
	if err := checkReplacement(cur, replaces, with); err != nil {
		return fmt.Errorf("%s: %w", v.path, err)
	}
	key, slot, err := v.UnlockContext(ctx, passphrase, lim)
	if err != nil {
		return fmt.Errorf("%s: the passphrase given with the new token does not open the volume: %w", v.path, err)
	}
	clear(key)
	if !slices.Contains(cur.Keyslots, slot) {
		return fmt.Errorf("%s: the passphrase opens keyslot %d, which the transit token does not name (%v)", v.path, slot, cur.Keyslots)
	}
	with.Keyslots = slices.Clone(cur.Keyslots)
	_, err = v.SetTransitToken(with)
	return err
}

// checkReplacement refuses with as a replacement of cur, read by the
// caller as replaces, unless it is a newer wrap by the same key.
func checkReplacement(cur *TransitToken, replaces, with TransitToken) error {
	switch {
	case cur == nil:
		return fmt.Errorf("no %s token to replace", TransitTokenType)
	case cur.Ciphertext != replaces.Ciphertext || cur.KeyVersion != replaces.KeyVersion:
		return ErrTokenChanged
	case with.Mount != cur.Mount || with.KeyName != cur.KeyName:
		return fmt.Errorf("the new token names transit key %q of mount %q, the volume's is %q of mount %q: a rewrap keeps the key", with.KeyName, with.Mount, cur.KeyName, cur.Mount)
	case with.KeyVersion <= cur.KeyVersion:
		return fmt.Errorf("the new token's key version %d is not newer than the volume's %d", with.KeyVersion, cur.KeyVersion)
	}
	return with.Check()
}
