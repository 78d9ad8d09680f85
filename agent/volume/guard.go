package volume

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// The release guard (docs/architecture.md, "The release guard"): a fence
// is given up only when this node has proven that nothing of the volume is
// in use. release is the manager's only call of Fencer.Release; unstage,
// a stage's rollback and the start-up check of a stage or unstage cut
// short all come through it. When the proof fails the fence is kept, the
// caller keeps the claim where the checks renew and watch it, and the
// refusal is said in the journal, as a DiskClaimed event (reason
// fence-kept) and in the caller's error.

// usage is what the release guard looks at for one volume: its disk, its
// dm-crypt mapping, and the paths it may be mounted at.
type usage struct {
	Disk   string
	Mapper string
	// Paths are the staging path and every recorded publication.
	Paths []string
}

func usageOf(c *Claim, disk string) usage {
	return usage{Disk: disk, Mapper: mapperOf(c),
		Paths: append([]string{c.StagingPath}, c.Publications...)}
}

// FenceKeptError says why the release guard kept a fence.
type FenceKeptError struct {
	Volume string
	Err    error
}

func (e *FenceKeptError) Error() string {
	return fmt.Sprintf("volume %s: its fence is kept, not released: %v", e.Volume, e.Err)
}
func (e *FenceKeptError) Unwrap() error { return e.Err }

// release gives up the fence f of claim c on dev for the reason why (for
// the log), after proving that nothing of the volume is in use on this
// node and flushing the disk, so that nothing of this node lands after
// another node may have claimed it. A fence the proof keeps is reported
// as a *FenceKeptError (FailedPrecondition).
//
// mark, when set, runs after the proof and the flush, right before the
// release: the unstage records the claim unstaging there.
func (m *Manager) release(ctx context.Context, c *Claim, dev *Device, f fence.Fencer, why string, mark func() error) error {
	if err := m.host.InUse(usageOf(c, dev.Path)); err != nil {
		kept := &FenceKeptError{Volume: c.Volume, Err: err}
		m.o.Metrics.fenceKept.Inc()
		m.log.Error("the release guard kept a fence: something of the volume is still in use on this node", "volume", c.Volume,
			"device", dev.Path, "why", why, "err", err)
		m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: c.Serial, HolderKey: uint64(c.Key),
			Reason: "fence-kept", Message: fmt.Sprintf("%v (%s); the claim stays recorded and checked: find what uses it, then unstage it again", kept, why)})
		return agenterr.New(agenterr.FailedPrecondition, "%w; the claim stays recorded and checked: find what uses it, then unstage it again", kept)
	}
	if err := m.host.Flush(dev); err != nil {
		return agenterr.New(agenterr.Unavailable, "volume %s: flushing its disk %s before releasing the fence: %v; nothing was released, the claim stays recorded: retry", c.Volume, dev.Path, err)
	}
	if mark != nil {
		if err := mark(); err != nil {
			return err
		}
	}
	return f.Release(ctx)
}

// unmapAll detaches the volume's data mapping: the one its record names,
// and one over its disk the record does not name (a stage cut short
// between the attach and its record), which the release guard would
// otherwise find in use for ever. The second is looked for at the device
// node the record names only while the claim's disk is not missing: a
// disk removed leaves its node (and device number) to the next disk
// attached, whose data mapping is another volume's.
func (m *Manager) unmapAll(c *Claim) error {
	if err := m.unmapRecorded(c); err != nil {
		return err
	}
	if c.Device == "" || c.Missing {
		return nil
	}
	if p, ok := m.host.DataMapping(c.Device); ok && p != c.DataDevice {
		m.log.Warn("detaching a data mapping of the volume's disk that its record does not name", "volume", c.Volume, "device", c.Device, "mapping", p)
		return m.unmapData(p)
	}
	return nil
}

// unmapRecorded detaches the data mapping c's record names, only if it is
// a loop device over c's disk: a damaged or hostile record never makes
// the agent detach (or make writable) another device. The record stops
// naming it as it is detached (unmapNamed).
func (m *Manager) unmapRecorded(c *Claim) error {
	if c.DataDevice == "" {
		// A pod device named without one is over nothing of the
		// record's: it stops naming it.
		return m.unmapPodRecorded(c)
	}
	if !m.host.MapsDisk(c.DataDevice, c.Device) {
		m.log.Warn("the data mapping the claim's record names is not a loop device over its disk; left alone", "volume", c.Volume, "device", c.Device, "mapping", c.DataDevice)
		return nil
	}
	return m.unmapNamed(c)
}

// unmapNamed detaches the data mapping c's record names, and records
// first that it names it no longer: the kernel gives a detached loop
// device's number to the next one, which may be another volume's over the
// disk that took this one's device node since, and a retry, or the next
// agent process after a crash right after the detach, would take it for
// this volume's. A detach that fails names it again. An agent that dies
// between the record and the detach leaves the mapping unnamed, which
// unmapAll finds over the claim's disk. A record that cannot be written
// does not stop the detach (the release guard gives a fence up only with
// no mapping over its disk); its error is returned after it.
func (m *Manager) unmapNamed(c *Claim) error {
	// The pod device, over the data mapping, goes first.
	if err := m.unmapPodRecorded(c); err != nil {
		return err
	}
	p := c.DataDevice
	c.DataDevice = ""
	perr := m.store.Put(c)
	if err := m.unmapData(p); err != nil {
		// Named again on disk too, whatever the first write answered:
		// one whose answer was lost may have landed.
		c.DataDevice = p
		if perr := m.store.Put(c); perr != nil {
			m.log.Error("could not record the data mapping a failed detach left", "volume", c.Volume, "mapping", p, "err", perr)
		}
		return err
	}
	return perr
}

// inUse reports whether err is the release guard keeping a fence because
// something of the volume is in use (not because the proof could not be
// made).
func inUse(err error) bool { return errors.As(err, new(*inuse.Error)) }

// fenceKept reports whether err is the release guard keeping a fence.
func fenceKept(err error) bool { return errors.As(err, new(*FenceKeptError)) }
