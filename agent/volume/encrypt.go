package volume

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// An encrypted volume's passphrase is made and wrapped by the node plugin
// (through the transit engine) and handed to the agent for each stage; the
// agent keeps only the wrapped form, in the LUKS2 header it writes. The
// first stage of a blank volume therefore carries both the passphrase and
// its wrapped form; later ones carry the passphrase the plugin unwrapped
// from the header's token, which VolumeToken reads.

// prepareLUKS makes sure target carries the volume's LUKS2 header: it
// formats a blank device when the request asks to (never a device with
// data, never twice), and reports whether it did.
func (m *Manager) prepareLUKS(ctx context.Context, c *Claim, target string, r StageRequest) (bool, error) {
	if c.Mapper != "" {
		// A stage cut short after the mapping was made: close it, the
		// open below makes it again.
		if err := m.o.Crypt.Close(ctx, m.mapperToClose(c)); err != nil {
			return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: closing the dm-crypt mapping left by an interrupted stage: %v", c.Volume, err)
		}
		c.Mapper = ""
	}
	ct, err := m.o.Crypt.Inspect(ctx, target)
	if err != nil {
		return false, agenterr.New(agenterr.Unavailable, "volume %s: %v", c.Volume, err)
	}
	switch ct.Kind {
	case ContentLUKS2:
		if c.LUKSFormatting && !c.LUKSFormatted {
			// Our format finished; the agent stopped before recording it.
			c.LUKSFormatted, c.LUKSFormatting = true, false
			if err := m.store.Put(c); err != nil {
				return false, err
			}
		}
		return false, nil
	case ContentBlank:
		return m.formatBlankLUKS(ctx, c, target, r)
	}
	return m.formatCutShortLUKS(ctx, c, target, r, ct)
}

// formatBlankLUKS formats a blank target when the request asks to, and
// never a volume this agent formatted before.
func (m *Manager) formatBlankLUKS(ctx context.Context, c *Claim, target string, r StageRequest) (bool, error) {
	switch {
	case c.LUKSFormatted:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: this agent made a LUKS2 header on the volume earlier, but %s now shows no signature; it will not format it again: check that the right disk is attached",
			c.Volume, target)
	case !r.FormatLUKS:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: %s carries no LUKS2 header and the request does not ask to format it (format_if_blank)", c.Volume, target)
	case r.ReadOnly:
		return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s is blank and the volume is read-only; there is nothing to open", c.Volume, target)
	}
	proof, err := m.proveBlank(ctx, c.Volume, target, "LUKS2 header")
	if err != nil {
		return false, err
	}
	return m.formatLUKS(ctx, c, proof, r)
}

// formatCutShortLUKS formats again a target that holds what ct found
// instead of a LUKS2 header only when that is this agent's own format cut
// short (docs/architecture.md P5); anything else is refused.
func (m *Manager) formatCutShortLUKS(ctx context.Context, c *Claim, target string, r StageRequest, ct Content) (bool, error) {
	if !c.LUKSFormatting || c.LUKSFormatted || c.Formatted || !r.FormatLUKS || r.Token == nil {
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: %s carries %s, not a LUKS2 header; the agent never formats over existing data: check that the right disk is attached, or wipe it by hand if its data is not wanted",
			c.Volume, target, ct.Detail)
	}
	// What this agent's own format leaves lies in the header area; past
	// it the device must still be as blank as it was proven when that
	// format began.
	proof, err := m.host.ProvePast(ctx, target, luksHeaderArea)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb):
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the LUKS2 format this agent began on %s was cut short, but %s is not as that format left it: it holds %s past the header area; it is not formatted again: check that the right disk is attached",
			c.Volume, target, target, nb.Found)
	case err != nil:
		return false, agenterr.New(agenterr.Unavailable, "volume %s: %s was not formatted again, what it holds past its LUKS2 header area could not be read: %v", c.Volume, target, err)
	}
	m.log.Warn("the LUKS2 format this agent began on the volume was cut short; formatting it again", "volume", c.Volume, "device", target, "found", ct.Detail)
	return m.formatLUKS(ctx, c, proof, r)
}

// formatLUKS formats the device proof names, marking the claim before and
// after, so a crash in between is recognised as the agent's own
// unfinished format.
func (m *Manager) formatLUKS(ctx context.Context, c *Claim, proof blank.Proof, r StageRequest) (bool, error) {
	target := proof.Device()
	if r.Token == nil {
		return false, agenterr.New(agenterr.InvalidArgument,
			"volume %s: formatting LUKS2 needs the passphrase's wrapped form (transit_token) to keep in the header; without it the passphrase could never be recovered", c.Volume)
	}
	if err := r.Token.Check(); err != nil {
		return false, agenterr.New(agenterr.InvalidArgument, "volume %s: %v", c.Volume, err)
	}
	c.LUKSFormatting = true
	if err := m.store.Put(c); err != nil {
		return false, err
	}
	if err := m.o.Crypt.Format(ctx, proof, r.Passphrase, *r.Token); err != nil {
		if ct, ierr := m.o.Crypt.Inspect(ctx, target); ierr == nil && ct.Kind == ContentBlank {
			// Nothing was written: the device is not ours yet.
			c.LUKSFormatting = false
			if perr := m.store.Put(c); perr != nil {
				m.log.Error("could not record that a LUKS2 format wrote nothing", "volume", c.Volume, "err", perr)
			}
		}
		if errors.Is(err, luks2.ErrSignature) {
			return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
		}
		return false, agenterr.New(agenterr.Internal, "volume %s: formatting LUKS2 on %s: %v", c.Volume, target, err)
	}
	c.LUKSFormatted, c.LUKSFormatting = true, false
	if err := m.store.Put(c); err != nil {
		return false, err
	}
	m.log.Info("made a LUKS2 header on a blank device", "volume", c.Volume, "device", target,
		"transit_key", r.Token.KeyName, "transit_key_version", r.Token.KeyVersion)
	return true, nil
}

// TokenResult is VolumeToken's answer.
type TokenResult struct {
	Content
	// Device is what was read: the disk, or the mapping of its data area.
	Device string
}

// VolumeToken reads what the volume's device holds where LUKS2 goes,
// without changing the device: the node plugin unwraps the passphrase
// from the token before it stages an encrypted volume.
func (m *Manager) VolumeToken(ctx context.Context, volume string, loc Locator) (res TokenResult, err error) {
	c, release, err := m.tokenClaim(volume, "reading the LUKS2 token")
	if err != nil {
		return res, err
	}
	defer release()
	if m.o.Crypt == nil {
		return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: this agent has no LUKS2 support; install an agent built with it", volume)
	}
	if c != nil && c.Phase == PhaseStaged {
		res.Device = c.BaseDevice()
	} else {
		var done func()
		if res.Device, done, err = m.unstagedDataArea(ctx, volume, loc); err != nil {
			return res, err
		}
		defer done()
	}
	res.Content, err = m.o.Crypt.Inspect(ctx, res.Device)
	if err != nil {
		return res, agenterr.New(agenterr.Unavailable, "volume %s: %v", volume, err)
	}
	return res, nil
}

// tokenClaim takes the lock of volume for op, a short call on its LUKS2
// token that waits out a short internal holder, and reads its claim
// record (nil when none). release must be called once err is nil.
func (m *Manager) tokenClaim(volume, op string) (c *Claim, release func(), err error) {
	if volume == "" {
		return nil, nil, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if release, err = m.locks.tryAWhile(volume, op); err != nil {
		return nil, nil, err
	}
	if c, err = m.store.Get(volume); err != nil {
		release()
		return nil, nil, err
	}
	return c, release, nil
}

// unstagedDataArea is where a volume that is not staged here keeps its
// data, to read: the disk itself, or a read-only mapping of the data area
// a lease puts after its own. done closes what was opened.
func (m *Manager) unstagedDataArea(ctx context.Context, volume string, loc Locator) (path string, done func(), err error) {
	if loc.IsZero() {
		return "", nil, agenterr.New(agenterr.InvalidArgument, "volume %s: the device locator names nothing (pci address, serial or wwn)", volume)
	}
	dev, err := m.locateAttaching(ctx, loc)
	if err != nil {
		return "", nil, fmt.Errorf("volume %s: %w", volume, err)
	}
	ch, err := m.o.Fencers.Choose(ctx, dev, volume, nil)
	if err != nil {
		dev.Close()
		return "", nil, agenterr.New(agenterr.Unavailable, "volume %s: choosing how %s is fenced, to find its data area: %v", volume, dev.Path, err)
	}
	closeChoice(ch)
	if err := m.leaseDataRule(ctx, dev, volume, &ch); err != nil {
		dev.Close()
		return "", nil, err
	}
	if ch.DataOffset == 0 {
		return dev.Path, func() { dev.Close() }, nil
	}
	p, unmap, err := m.readOnlyDataMapping(dev.Path, ch.DataOffset)
	if err != nil {
		dev.Close()
		return "", nil, agenterr.New(agenterr.Unavailable, "volume %s: %v", volume, err)
	}
	return p, func() { unmap(); dev.Close() }, nil
}

// readOnlyDataMapping returns a mapping of disk's data area to read: the
// stage's own when there is one, else a read-only loop device that done
// detaches.
func (m *Manager) readOnlyDataMapping(disk string, offset int64) (string, func(), error) {
	blank.DropBuffers(disk) // as dataMapping does
	if p, ok := m.findDataMapping(disk, offset); ok {
		return p, func() {}, nil
	}
	p, err := loopdev.Attach(disk, offset, true)
	if err != nil {
		return "", nil, fmt.Errorf("mapping the data area of %s from byte %d to read it: %w", disk, offset, err)
	}
	return p, func() {
		if err := dropDataMapping(p); err != nil {
			m.log.Error("could not detach a read-only data mapping", "device", p, "err", err)
		}
	}, nil
}
