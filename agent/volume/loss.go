package volume

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// refuse is P2: the disk is held elsewhere; set it read-only, mount
// nothing, say who holds it.
func (m *Manager) refuse(c *Claim, dev *Device, held *fence.HeldError) {
	if err := m.host.SetReadOnly(dev, true); err != nil {
		m.log.Error("could not set a refused disk read-only", "volume", c.Volume, "device", dev.Path, "err", err)
	}
	m.o.Metrics.refusals.Inc()
	m.publish(events.Event{Type: events.DiskRefused, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(held.Holder), HolderNode: held.HolderNode, Reason: "held-by-another-node",
		Message: fmt.Sprintf("volume %s: %v", c.Volume, held)})
	m.log.Warn("disk refused", "volume", c.Volume, "device", dev.Path, "holder", held.Holder.String(), "holder_node", held.HolderNode)
}

// onLost is given to fencers that notice a loss by themselves. I/O stops
// at once, without waiting for the volume's lock (an API call may hold
// it); the loss is then recorded and announced under the lock. It
// reports stopped (the fencer may then tell the taker so) only when the
// disk was set read-only, the filesystem stopped and every layer below
// it drained.
func (m *Manager) onLost(volume string) func(*fence.LostError) bool {
	return func(lost *fence.LostError) bool {
		l := m.getLive(volume)
		stopped := true
		if l != nil {
			if err := m.host.SetReadOnly(l.dev, true); err != nil {
				m.log.Error("could not set a fenced disk read-only", "volume", volume, "err", err)
				stopped = false
			}
		}
		c, err := m.store.Get(volume)
		// Whatever the phase: a stage between its mount and its record
		// has the filesystem mounted too (stopFilesystem leaves a path
		// that is no mount point alone).
		if err == nil && c != nil && !c.Block && c.StagingPath != "" {
			if err := m.host.StopFilesystem(c.StagingPath, c.MountDevice()); err != nil {
				m.log.Error("could not stop writes to the filesystem of a fenced volume", "volume", volume, "err", err)
				stopped = false
			}
		}
		go m.recordLoss(volume, lost)
		if l == nil || err != nil || c == nil {
			m.log.Warn("the stop of a lost claim's I/O cannot be confirmed here", "volume", volume)
			return false
		}
		if err := m.host.Drain(c, l.dev); err != nil {
			m.log.Error("could not show the fenced volume's devices quiet", "volume", volume, "err", err)
			stopped = false
		}
		return stopped
	}
}

func (m *Manager) recordLoss(volume string, lost *fence.LostError) {
	var release func()
	for i := 0; ; i++ {
		var err error
		if release, err = m.locks.try(volume, "recording a lost claim"); err == nil {
			break
		}
		if i > 600 {
			m.log.Error("the volume stayed busy; its loss is recorded by the next claim check", "volume", volume)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer release()
	c, err := m.store.Get(volume)
	if err != nil || c == nil || c.State == StateLost {
		return
	}
	var dev *Device
	if l := m.getLive(volume); l != nil {
		dev = l.dev
	}
	m.lose(c, dev, lost)
	m.updateGauge()
}

// lose is P4: stop I/O at once, say so, and remember it.
func (m *Manager) lose(c *Claim, dev *Device, lost *fence.LostError) (stopped bool) {
	stopped = m.stopIO(c, dev)
	m.clearClaimOf(c)
	c.State, c.Detail, c.HolderKey, c.HolderNode = StateLost, lost.Error(), lost.Holder, lost.HolderNode
	c.IONotStopped = !stopped
	m.recordLost(c)
	m.o.Metrics.fences.Inc()
	m.publish(events.Event{Type: events.DiskFenced, Volume: c.Volume, Device: c.Device, Serial: c.Serial,
		HolderKey: uint64(lost.Holder), HolderNode: lost.HolderNode, Reason: "claim-lost",
		Message: fmt.Sprintf("volume %s: %v", c.Volume, lost)})
	m.log.Error("claim lost; I/O to the disk stopped", "volume", c.Volume, "device", c.Device, "reason", lost.Reason)
	return stopped
}

// lostRecordTries is how many times a lost claim's record is written
// before the agent gives up, a second apart.
const lostRecordTries = 5

// recordLost writes the record of the lost claim c. Until it is written
// the record says the claim is held, which the API calls, the release
// guard and the next agent process act on: a write that fails is retried
// (the claim check writes it again too, as its fence check finds the loss
// again).
func (m *Manager) recordLost(c *Claim) {
	for i := 1; ; i++ {
		err := m.store.Put(c)
		if err == nil {
			return
		}
		if i == lostRecordTries {
			m.log.Error("could not record a lost claim; the claim check records it again", "volume", c.Volume, "err", err)
			return
		}
		m.log.Warn("could not record a lost claim; retrying", "volume", c.Volume, "err", err)
		time.Sleep(time.Second)
	}
}

// lostUnused makes, for a lost claim c whose record is about to go (its
// unstage) or stop saying lost (a granted restage, dropLost), the release
// guard's proof that nothing of the volume is in use on its disk, which a
// held claim's release makes: a mapping the teardown before could not
// find or detach (a lookup that failed reads as none) would otherwise
// stay over the disk another node holds, with no record of it. A proof
// that cannot be made at the recorded device node is made where the disk
// is found now; a disk found gone is reached by nothing of this node. The
// error is FAILED_PRECONDITION for something in use, UNAVAILABLE for a
// proof that could not be made.
func (m *Manager) lostUnused(ctx context.Context, c *Claim) error {
	err := m.host.InUse(usageOf(c, c.Device))
	if err != nil && !inUse(err) {
		dev, lerr := m.locate(ctx, c.Locator)
		switch {
		case agenterr.KindOf(lerr) == agenterr.NotFound:
			return nil
		case lerr == nil:
			err = m.host.InUse(usageOf(c, dev.Path))
			dev.Close()
		}
	}
	switch {
	case inUse(err):
		return agenterr.New(agenterr.FailedPrecondition, "%v", err)
	case err != nil:
		return agenterr.New(agenterr.Unavailable, "it cannot be shown that nothing of it is in use on this node: %v", err)
	}
	return nil
}

// stopIO stops the I/O of a lost claim: the disk read-only, the
// filesystem stopped, and, once both are, every layer drained (as the
// engine's loss handler has it, onLost), so that nothing queued can still
// land. It reports whether all of it succeeded.
func (m *Manager) stopIO(c *Claim, dev *Device) bool {
	stopped := true
	if dev != nil {
		if err := m.host.SetReadOnly(dev, true); err != nil {
			m.log.Error("could not set a fenced disk read-only", "volume", c.Volume, "device", dev.Path, "err", err)
			stopped = false
		}
	}
	if !c.Block && c.Phase == PhaseStaged {
		if err := m.host.StopFilesystem(c.StagingPath, c.MountDevice()); err != nil {
			m.log.Error("could not stop writes to the filesystem of a fenced volume", "volume", c.Volume, "staging", c.StagingPath, "err", err)
			stopped = false
		}
	}
	if stopped && dev != nil {
		if err := m.host.Drain(c, dev); err != nil {
			m.log.Error("could not show the fenced volume's devices quiet", "volume", c.Volume, "err", err)
			stopped = false
		}
	}
	return stopped
}

// stopAgain tries again to stop the I/O of a lost claim whose stop failed
// (Claim.IONotStopped), and records it when it succeeds; it reports
// whether the I/O is stopped now.
func (m *Manager) stopAgain(c *Claim, dev *Device) bool {
	if !c.IONotStopped {
		return true
	}
	if !m.stopIO(c, dev) {
		return false
	}
	c.IONotStopped = false
	if err := m.store.Put(c); err != nil {
		m.log.Error("recording the stopped I/O of a lost claim", "volume", c.Volume, "err", err)
	}
	m.log.Info("the I/O of a fenced volume is stopped now", "volume", c.Volume)
	return true
}

// fsIocShutdown is FS_IOC_SHUTDOWN (_IOR('X', 125, __u32)), which ext4 and
// xfs implement; with NOLOGFLUSH the filesystem stops without writing.
const (
	fsIocShutdown        = 0x8004587d
	fsShutdownNoLogFlush = 2
)

// stopFilesystem remounts the filesystem mounted at p (the staging path
// of a claim whose device is device) read-only (the superblock, so every
// bind mount of it too); when files are open for writing and the remount
// is refused, it shuts the filesystem down instead. The block layer's
// read-only flag alone does not stop a mounted filesystem from writing.
//
// p is opened once, beneath the kubelet root and through no symlink, and
// both the remount and the shutdown act on that descriptor. Only a mount
// root is touched, and only one whose filesystem is on device (when the
// device node is there to compare): a claim recorded as staged whose
// staging path is no longer mounted (an unstage killed after its
// unmount), or a path swapped since it was checked, would otherwise have
// the remount and the shutdown land on another filesystem -- the node's
// root.
func stopFilesystem(root, p, device string) error {
	f, err := openBeneath(root, p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w; left alone", p, err)
	}
	defer f.Close()
	if mp, err := isMountRoot(f); err != nil || !mp {
		if err != nil {
			return fmt.Errorf("%s: is it a mount point? %w; left alone", p, err)
		}
		return nil
	}
	var mst, dst unix.Stat_t
	if device != "" && unix.Fstat(int(f.Fd()), &mst) == nil && unix.Stat(device, &dst) == nil && mst.Dev != dst.Rdev {
		return fmt.Errorf("%s holds the filesystem of device %d:%d, not %s's; left alone", p, unix.Major(mst.Dev), unix.Minor(mst.Dev), device)
	}
	err = unix.Mount("", fdPath(f), "", unix.MS_REMOUNT|unix.MS_RDONLY, "")
	if err == nil {
		return nil
	}
	if serr := unix.IoctlSetPointerInt(int(f.Fd()), fsIocShutdown, fsShutdownNoLogFlush); serr != nil {
		return fmt.Errorf("remount read-only: %v; shutdown: %v", err, serr)
	}
	return nil
}
