package volume

// NodeUnstage: the stage's steps taken back, last first, the fence given
// up through the release guard, the record forgotten.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// lockedClaim begins an operation op on volume that names one path
// (what it is, for errors): it checks that there is a volume id, confines
// the path beneath the kubelet root, takes the volume's lock and reads its
// claim (nil when this node does not know the volume). The caller calls
// release when done.
func (m *Manager) lockedClaim(op, volume, what, path string) (confined string, c *Claim, release func(), err error) {
	if volume == "" {
		return "", nil, nil, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if confined, err = confine(m.o.Config.KubeletRoot, what, path); err != nil {
		return "", nil, nil, err
	}
	if release, err = m.locks.try(volume, op); err != nil {
		return "", nil, nil, err
	}
	if c, err = m.store.Get(volume); err != nil {
		release()
		return "", nil, nil, err
	}
	return confined, c, release, nil
}

// Unstage implements UnstageVolume: unmount, close LUKS2, release the
// fence, forget the claim. A volume the agent does not know is unstaged.
func (m *Manager) Unstage(ctx context.Context, volume, stagingPath string) (err error) {
	defer m.count("unstage", &err)
	staging, c, release, err := m.lockedClaim("unstage", volume, "staging path", stagingPath)
	if err != nil {
		return err
	}
	defer release()
	if c == nil {
		return nil
	}
	if c.StagingPath != staging {
		return agenterr.New(agenterr.InvalidArgument, "volume %s is staged at %s, not %s", volume, c.StagingPath, staging)
	}
	if len(c.Publications) > 0 {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is still published at %v; unpublish it first", volume, c.Publications)
	}
	if c, err = m.takeBackCutShort(ctx, c); err != nil || c == nil {
		return err
	}
	return m.unstage(ctx, c)
}

// takeBackCutShort takes back, as the start-up check does, a stage cut
// short whose disk that check could not verify, or a stage whose record
// still says claiming (its last record, which would have named the fence
// it could not release, failed): the fence it may have taken before its
// record named it is released through the release guard then, never
// forgotten with the record. It returns the claim as recorded after (nil:
// forgotten, its disk gone), or UNAVAILABLE while the disk still cannot
// be told.
func (m *Manager) takeBackCutShort(ctx context.Context, c *Claim) (*Claim, error) {
	if c.Phase == PhaseStaged || !m.cutShort(c) {
		return c, nil
	}
	m.reconcile(ctx, c, m.newScan())
	now, err := m.store.Get(c.Volume)
	if err != nil || now == nil {
		return nil, err
	}
	if now.Phase != PhaseStaged && (now.Missing || m.unresolved(now.Volume)) {
		return nil, agenterr.New(agenterr.Unavailable, "volume %s: its stage was cut short and its disk could not be checked to release what that stage took (%s); nothing was released, the claim stays recorded: retry the unstage",
			c.Volume, detailOf(now))
	}
	return now, nil
}

// unstage takes the steps of a stage back, last first: unmount, flush,
// close LUKS2, detach the data mapping, release the fence, forget the
// claim. A step that fails stops it; the claim stays recorded and the
// retry takes up where it stopped.
func (m *Manager) unstage(ctx context.Context, c *Claim) error {
	if err := m.unmountIfMounted(c.StagingPath); err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	if err := m.flushLayers(c); err != nil {
		return err
	}
	if err := m.closeLUKS(ctx, c); err != nil {
		return err
	}
	if err := m.unmapAll(c); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	if err := m.releaseFence(ctx, c); err != nil {
		return err
	}
	if err := m.forget(c); err != nil {
		return err
	}
	m.clearClaimOf(c)
	msg := fmt.Sprintf("volume %s unstaged from %s and its disk %s released", c.Volume, c.StagingPath, c.Device)
	switch {
	case c.State == StateLost:
		msg = fmt.Sprintf("volume %s unstaged from %s; its disk %s was lost to another holder before and stays read-only on this node", c.Volume, c.StagingPath, c.Device)
	case c.Detail == detachedDetail:
		msg = fmt.Sprintf("volume %s unstaged from %s; %s (%s): the node it went to takes it over with a grant", c.Volume, c.StagingPath, detachedDetail, c.Device)
	}
	m.publish(events.Event{Type: events.DiskReleased, Volume: c.Volume, Device: c.Device, Serial: c.Serial, HolderKey: uint64(c.Key),
		Reason: "unstaged", Message: msg})
	m.log.Info("volume unstaged", "volume", c.Volume, "device", c.Device, "staging", c.StagingPath)
	return nil
}

// forget removes the record of an unstaged claim -- unless it names a
// format of this agent's that a crash cut short (an mkfs or a LUKS2
// header begun, not finished): only the record tells those leftovers from
// foreign data, so it stays, as interrupted with nothing held, for the
// next stage of the volume on this node to make the format again
// (mount.go, cutShortFormatProof).
func (m *Manager) forget(c *Claim) error {
	if (c.Formatting == nil || c.Formatted) && (!c.LUKSFormatting || c.LUKSFormatted) {
		return m.store.Delete(c.Volume)
	}
	c.Phase, c.State, c.Publications, c.Detail = PhaseInterrupted, "", nil, "unstaged; a format of this agent's was cut short on it, which the next stage makes again"
	return m.store.Put(c)
}

// flushLayers pushes down a held volume's writes that may still sit in the
// page cache of the devices the pod wrote through (a raw block volume's;
// the data mapping is a buffered loop device, so even the disk's own cache
// holds them) before those devices go; the disk is flushed again right
// before the fence is released (releaseHeld): nothing of this node lands
// after another node may have claimed the disk. A lost claim's disk is
// read-only and another node's: its writes were failed on purpose, and
// there is no fence to release.
func (m *Manager) flushLayers(c *Claim) error {
	if c.State != StateHeld {
		return nil
	}
	for _, p := range []string{c.Mapper, c.PodDevice, c.DataDevice} {
		if err := m.host.FlushPath(p); err != nil {
			return agenterr.New(agenterr.Unavailable, "volume %s: %v; nothing was released, the claim stays recorded: retry the unstage", c.Volume, err)
		}
	}
	return nil
}

// closeLUKS closes the volume's dm-crypt mapping, and records that it did.
func (m *Manager) closeLUKS(ctx context.Context, c *Claim) error {
	if c.Mapper == "" && (!c.Encrypted || m.o.Crypt == nil) {
		// An encrypted volume's mapping is closed by its name even when
		// the record does not say it is open: a stage cut short between
		// the open and its record leaves it so.
		return nil
	}
	if m.o.Crypt == nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s has the dm-crypt mapping %s open, but this agent has no LUKS2 support to close it", c.Volume, c.Mapper)
	}
	if err := m.o.Crypt.Close(ctx, m.mapperToClose(c)); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: closing the dm-crypt mapping: %v", c.Volume, err)
	}
	c.Mapper = ""
	return m.store.Put(c)
}

// releaseFence gives back the fence of a held claim and lets go of what
// the manager holds open for the volume.
func (m *Manager) releaseFence(ctx context.Context, c *Claim) error {
	if c.State == StateLost {
		// Not this node's to release; its record goes only once the
		// release guard's proof shows nothing of the volume in use.
		if err := m.lostUnused(ctx, c); err != nil {
			return agenterr.New(agenterr.KindOf(err), "volume %s lost its fence, and %v; the claim stays recorded: retry the unstage", c.Volume, err)
		}
	}
	if c.State == StateHeld {
		l, opened, done, err := m.fenceToRelease(ctx, c)
		if err != nil {
			return err
		}
		defer done()
		if l != nil {
			if gone, err := m.detached(ctx, c, l); err != nil || gone {
				if gone {
					m.dropDetached(c, l, opened)
				}
				return err
			}
			if err := m.releaseHeld(ctx, c, l); err != nil {
				if opened {
					// Opened here: the claim check takes the
					// fence back and renews it (checkOne).
					l.close()
				}
				return err
			}
			if opened {
				l.close()
			}
		}
	}
	m.setLive(c.Volume, nil)
	return nil
}

// fenceToRelease is what releases a held claim's fence: its live entry;
// or, when it was not opened since start (the device went away, or
// reconcile failed), its disk opened now (opened: closed by the caller);
// or, when it was opened without its fencer (the start-up check could not
// choose it), its device with a fencer chosen now, which done closes (the
// device stays the live entry's). nil when the disk is gone: nothing of
// this node reaches it, nothing can release its fence from here.
func (m *Manager) fenceToRelease(ctx context.Context, c *Claim) (l *live, opened bool, done func(), err error) {
	done = func() {}
	l = m.getLive(c.Volume)
	switch {
	case l == nil:
		l, err = m.openToRelease(ctx, c)
		return l, l != nil, done, err
	case l.fencer == nil:
		ch, err := m.o.Fencers.Choose(ctx, l.dev, c.Volume, nil)
		if err != nil || ch.Fencer == nil {
			return nil, false, done, agenterr.New(agenterr.Unavailable, "volume %s: the fencing of its disk %s could not be chosen to release it (%v); nothing was released, the claim stays recorded: retry the unstage", c.Volume, c.Device, err)
		}
		return &live{dev: l.dev, fencer: ch.Fencer}, false, func() { closeChoice(ch) }, nil
	}
	return l, false, done, nil
}

// detached reports whether the held claim's disk is no longer attached to
// this node: the device the claim holds open fails its identity check and
// a scan finds the disk nowhere (the platform detached it, as it does
// when another node takes the volume over). A disk found at another
// device node is taken back there, and the unstage is to be retried, as
// it is when the lookup fails (it says nothing of where the disk is).
func (m *Manager) detached(ctx context.Context, c *Claim, l *live) (bool, error) {
	verr := l.dev.Verify(ctx)
	if verr == nil {
		return false, nil
	}
	switch m.cameBack(ctx, c, l, m.newScan()) {
	case diskGone:
		return true, nil
	case diskMoved:
		return false, agenterr.New(agenterr.Unavailable, "volume %s: its disk was attached again at another device node while it was unstaged; the claim was taken back there: retry the unstage", c.Volume)
	case diskUnknown:
		// Only a lookup that finds the disk nowhere tells it was
		// detached: a fence left on a disk still here has no record
		// left to release it.
		return false, agenterr.New(agenterr.Unavailable, "volume %s: its disk %s failed its identity check (%v) and could not be looked up; nothing was released, the claim stays recorded: retry the unstage", c.Volume, c.Device, verr)
	}
	return false, nil
}

// dropDetached lets go of a held claim whose disk is no longer attached:
// its fence cannot be released from here, and nothing of this node
// reaches the disk (its mounts and mappings were taken down before). The
// fence stays on the disk, for the node the disk went to to take over
// with a grant, or to lapse (a lease nobody renews).
func (m *Manager) dropDetached(c *Claim, l *live, opened bool) {
	m.log.Warn("the volume's disk is no longer attached to this node: its fence is left on the disk, not released", "volume", c.Volume, "device", c.Device)
	c.Detail = detachedDetail
	if opened {
		l.close()
	}
	m.setLive(c.Volume, nil)
}

// detachedDetail marks, for the unstage's event, a claim dropped because
// its disk was detached from this node.
const detachedDetail = "its disk was detached from this node; its fence was not released from here"

// openToRelease opens the claim's disk and its fencer: nil when the disk
// is gone (nothing on this node can release its fence then, and nothing
// of this node reaches it), an error when it cannot be told now.
func (m *Manager) openToRelease(ctx context.Context, c *Claim) (*live, error) {
	dev, err := m.locate(ctx, c.Locator)
	if agenterr.KindOf(err) == agenterr.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, agenterr.New(agenterr.Unavailable, "volume %s: its disk could not be opened to release its fence (%v); nothing was released, the claim stays recorded: retry the unstage", c.Volume, err)
	}
	ch, err := m.o.Fencers.Choose(ctx, dev, c.Volume, nil)
	if err != nil {
		dev.Close()
		return nil, agenterr.New(agenterr.Unavailable, "volume %s: the fencing of its disk %s could not be chosen to release it (%v); nothing was released, the claim stays recorded: retry the unstage", c.Volume, dev.Path, err)
	}
	if ch.Fencer == nil {
		dev.Close()
		return nil, nil
	}
	return &live{dev: dev, fencer: ch.Fencer}, nil
}

// releaseHeld releases the fence of a held claim through the release
// guard (guard.go), which flushes the disk first. The claim is recorded
// unstaging right before the release: an agent restarted before the
// record is gone knows the missing claim was its own release, not a loss.
// A release that fails or is kept leaves the claim staged, checked as ever
// until the retry.
func (m *Manager) releaseHeld(ctx context.Context, c *Claim, l *live) error {
	marked := false
	err := m.release(ctx, c, l.dev, l.fencer, "unstage", func() error {
		c.Phase, marked = PhaseUnstaging, true
		return m.store.Put(c)
	})
	if !marked {
		c.Phase = PhaseStaged
		return err
	}
	if err == nil || errors.As(err, new(*fence.LostError)) {
		return nil
	}
	c.Phase = PhaseStaged
	if perr := m.store.Put(c); perr != nil {
		m.log.Error("recording a claim whose release failed", "volume", c.Volume, "err", perr)
	}
	return agenterr.New(agenterr.Unavailable, "volume %s: releasing the fence of %s: %v; the claim stays recorded, retry", c.Volume, c.Device, err)
}

// flushDevice writes a block device's page cache down and flushes the
// device's write cache (fsync on a block device does both). A variable so
// that a test can make it fail.
var flushDevice = func(f *os.File) error {
	if err := f.Sync(); err != nil {
		return fmt.Errorf("flushing %s: %w", f.Name(), err)
	}
	return nil
}

// flushPath flushes the block device at p; a device that is not there
// (already closed or detached by an earlier attempt) holds nothing.
func flushPath(p string) error {
	if p == "" {
		return nil
	}
	if strings.HasPrefix(filepath.Base(p), "loop") && !loopBound(p) {
		// A detached loop device keeps its node, and a flush of it fails.
		return nil
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENODEV) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening %s to flush it: %w", p, err)
	}
	defer f.Close()
	return flushDevice(f)
}
