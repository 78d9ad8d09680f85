package volume

import (
	"context"
	"errors"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// TokenWriter is the part of an Encryption that rewrites a LUKS2
// header's vco-transit token in place (LUKS has it).
type TokenWriter interface {
	// ReplaceToken stores with in place of the transit token of the
	// header on device, which must still be replaces, once passphrase
	// has opened the token's keyslot (luks2.ReplaceTransitToken).
	ReplaceToken(ctx context.Context, device string, passphrase []byte, replaces, with luks2.TransitToken) error
}

// UpdateVolumeToken stores a rewrap of a staged encrypted volume's
// passphrase by a newer version of its transit key in the volume's LUKS2
// header, in place of the token replaces, which the node plugin read and
// rewrapped. Only a volume staged and fenced here is written, and only
// once its disk is proven still at the device node its record names and
// its fence proven still held (stillOurs): its fence keeps every other
// node off the header while it is rewritten. The passphrase is checked
// against the header first and never kept.
func (m *Manager) UpdateVolumeToken(ctx context.Context, volume string, passphrase []byte, replaces, with luks2.TransitToken) (TokenResult, error) {
	var res TokenResult
	c, release, err := m.tokenClaim(volume, "rewriting the LUKS2 token")
	if err != nil {
		return res, err
	}
	defer release()
	tw, ok := m.o.Crypt.(TokenWriter)
	if !ok {
		return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: this agent cannot rewrite LUKS2 tokens; install an agent built with LUKS2 support", volume)
	}
	if err := tokenWritable(volume, c); err != nil {
		return res, err
	}
	// Written through the recorded device node: only while it is still
	// the volume's disk, under the volume's fence.
	if err := m.stillOurs(ctx, c, "token rewrite"); err != nil {
		return res, err
	}
	res.Device = c.BaseDevice()
	uctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := tw.ReplaceToken(uctx, res.Device, passphrase, replaces, with); err != nil {
		if errors.Is(err, luks2.ErrTokenChanged) {
			return res, agenterr.New(agenterr.Aborted, "volume %s: its LUKS2 token changed since it was read; read it again and rewrap that", volume)
		}
		return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: the LUKS2 token was not rewritten: %v", volume, err)
	}
	res.Content, err = m.o.Crypt.Inspect(ctx, res.Device)
	if err != nil {
		return res, agenterr.New(agenterr.Unavailable, "volume %s: the token was rewritten, but reading it back failed: %v", volume, err)
	}
	return res, nil
}

// tokenWritable refuses a token rewrite unless the volume is an
// encrypted volume staged here, not read-only, under a fence this node
// holds (or, by the operator's choice, unfenced).
func tokenWritable(volume string, c *Claim) error {
	switch {
	case c == nil || c.Phase != PhaseStaged:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is not staged on this node: its token is rewritten on the node that stages it, or at its next stage", volume)
	case !c.Encrypted:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is not encrypted: it has no LUKS2 token", volume)
	case c.State != StateHeld && c.State != StateUnfenced, c.Missing:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is %s on this node: its header is not written until it is staged again", volume, c.ListState())
	case c.ReadOnly:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged read-only here: its header is not written; its token is rewritten at a stage that is not read-only", volume)
	}
	return nil
}

// ReplaceToken implements TokenWriter.
func (l *LUKS) ReplaceToken(ctx context.Context, device string, passphrase []byte, replaces, with luks2.TransitToken) error {
	v, err := luks2.Open(device, true)
	if err != nil {
		return err
	}
	defer v.Close()
	return v.ReplaceTransitToken(ctx, passphrase, replaces, with, l.unlockLimits())
}
