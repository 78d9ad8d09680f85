package volume

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
)

// The agent refuses a disk held by another node without being asked
// (docs/architecture.md P2): the uevent watcher (package fence/uevent)
// calls Classify for every disk, whether it appears while the agent runs
// or was attached before the agent started, again after lost uevents and
// at each rescan, and sets a refused one read-only; Refused announces it.

// WatchLock is the watcher's Serialize: a stage records the disk it
// claims under it, so a refusal decided before the record does not land
// after it.
func (m *Manager) WatchLock() sync.Locker { return &m.watchMu }

// Classify is the uevent watcher's classifier: a disk that another node
// holds (its reservation, or a live lease owner with another key) is to be
// refused. It reads, never writes. A disk of one of this agent's claims
// (held, or a stage in progress or cut short: recorded before the disk is
// fenced) is left alone, and so is a disk nobody holds. A claim whose
// disk went away does not cover the disk that now has its device number.
func (m *Manager) Classify(ctx context.Context, ev uevent.Event) (uevent.Verdict, error) {
	node := ev.Node()
	dn := fmtDevnum(ev.Major, ev.Minor)
	claims, _ := m.store.List()
	m.mu.Lock()
	removed := m.removed[dn]
	m.mu.Unlock()
	for _, c := range claims {
		if c.DevNum == dn && c.State != StateLost && !c.Missing && !removed {
			return uevent.Verdict{Method: c.Method}, nil
		}
	}
	f, err := os.OpenFile(node, os.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return uevent.Verdict{}, err
	}
	defer f.Close()
	dev := &Device{Path: node, Name: filepath.Base(node), Major: ev.Major, Minor: ev.Minor, File: f}
	ch, err := m.o.Fencers.Choose(ctx, dev, LookOnly, nil)
	if err != nil {
		return uevent.Verdict{}, err
	}
	if cl, ok := ch.Fencer.(io.Closer); ok {
		defer cl.Close()
	}
	v := uevent.Verdict{Method: ch.Method}
	switch e := ch.Fencer.(type) {
	case *pr.Engine:
		st, err := e.Status(ctx)
		if err != nil {
			return v, err
		}
		if r := st.Reservation; r != nil && r.Key != st.OwnKey {
			v.Refuse, v.Holder, v.HolderNode = true, r.Key, r.Node
		}
	case *leaseFencer:
		owner, err := e.Holder(ctx)
		if err != nil {
			return v, err
		}
		if owner != nil && owner.Live() && owner.Key != e.key {
			v.Refuse, v.Holder, v.HolderNode = true, owner.Key, owner.Node
		}
	}
	if v.Refuse {
		holder := v.Holder.String()
		if v.HolderNode != "" {
			holder += " (node " + v.HolderNode + ")"
		}
		v.Reason = fmt.Sprintf("disk %s is attached to this node while %s holds it by %s; it is set read-only and nothing is mounted", node, holder, v.Method)
	}
	return v, nil
}

// Refused records what the watcher decided about a disk (once per
// appearance or change of outcome): a refusal is counted and published as
// DiskRefused; a failure to classify or to set the disk read-only is
// logged. Any decision wakes the stages waiting for a hot-plugged disk.
func (m *Manager) Refused(d uevent.Decision) {
	// A stage waiting for this disk looks now, not at its next poll.
	m.sawDisk()
	node := d.Event.Node()
	if d.Err != nil {
		m.log.Error("a disk could not be checked or refused", "device", node, "cause", string(d.Cause), "err", d.Err)
	}
	if !d.Verdict.Refuse {
		return
	}
	m.o.Metrics.refusals.Inc()
	msg := d.Verdict.Reason
	if !d.ReadOnly {
		msg += "; setting it read-only FAILED"
	}
	m.publish(events.Event{Type: events.DiskRefused, Device: node, Serial: m.serialOf(node),
		HolderKey: uint64(d.Verdict.Holder), HolderNode: d.Verdict.HolderNode, Reason: "held-by-another-node", Message: msg})
	m.log.Warn("disk held by another node refused", "device", node, "cause", string(d.Cause), "holder", d.Verdict.Holder.String(), "holder_node", d.Verdict.HolderNode,
		"fence", d.Verdict.Method, "read_only", d.ReadOnly, "latency", d.Done.Sub(d.Received).String())
}

// Removed drops what the agent holds of a disk that went away: a claim
// on it is marked missing (abnormal) at once, without waiting for the
// periodic check; one whose volume is busy with a call is marked once the
// call ends, and until then the watcher reads any disk that appears at
// its device number rather than take it for the claim's.
func (m *Manager) Removed(ev uevent.Event) {
	dn := fmtDevnum(ev.Major, ev.Minor)
	claims, _ := m.store.List()
	for _, c := range claims {
		if c.DevNum != dn || c.Missing {
			continue
		}
		m.removedNow(c.Volume, dn, ev.DevName)
	}
	m.updateGauge()
}

// removedNow marks the claim's disk removed under the volume's lock: at
// once, or when the call that holds it ends.
func (m *Manager) removedNow(volume, dn, devName string) {
	for {
		if release, err := m.locks.try(volume, "device removal"); err == nil {
			m.markRemoved(volume, dn, devName)
			release()
			return
		}
		m.mu.Lock()
		m.removed[dn] = true
		m.mu.Unlock()
		if m.locks.whenFree(volume, func() { m.markRemoved(volume, dn, devName); m.updateGauge() }) {
			return
		}
	}
}

// markRemoved records, with the volume's lock held, that the disk of the
// claim at device number dn was removed.
func (m *Manager) markRemoved(volume, dn, devName string) {
	now, err := m.store.Get(volume)
	if err != nil || now == nil || now.DevNum != dn || now.Missing {
		return
	}
	now.Missing, now.Detail = true, fmt.Sprintf("the disk %s of volume %s was removed from this node", now.Device, now.Volume)
	if err := m.store.Put(now); err != nil {
		m.log.Error("recording a removed disk", "volume", now.Volume, "err", err)
	}
	m.log.Error("claimed disk removed", "volume", now.Volume, "device", now.Device)
	m.clearClaimed(devName)
}

// serialOf reads a disk's serial for events; "" when unknown.
func (m *Manager) serialOf(node string) string {
	if d, err := m.finder.ByDevice(node); err == nil {
		return d.Serial
	}
	return ""
}

// The packaged udev rules hide a data disk from systemd and udisks
// (SYSTEMD_READY=0, UDISKS_IGNORE=1) until the agent marks it claimed;
// a change uevent makes udev apply the mark at once.

// markClaimed marks dev claimed for the udev rules.
func (m *Manager) markClaimed(name string) {
	m.claimMark(name, true)
}

// clearClaimOf removes the mark of c's disk on its release or loss,
// named by the device node c's record holds -- unless another claim
// holds its disk at that node now: a disk removed leaves its node name to
// the next disk attached, and the mark is that disk's then.
func (m *Manager) clearClaimOf(c *Claim) {
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume != c.Volume && o.Device == c.Device && !o.Missing {
			m.log.Info("the claim mark of the device node is another volume's now; left alone", "volume", c.Volume, "device", c.Device, "holder", o.Volume)
			return
		}
	}
	m.clearClaimed(filepath.Base(c.Device))
}

// clearClaimed removes the mark on release, loss or removal.
func (m *Manager) clearClaimed(name string) {
	m.claimMark(name, false)
}

func (m *Manager) claimMark(name string, claimed bool) {
	dir := m.o.Config.ClaimedDir
	if dir == "" || name == "" {
		return
	}
	var err error
	if claimed {
		err = uevent.MarkClaimed(dir, name)
	} else {
		err = uevent.ClearClaimed(dir, name)
	}
	if err == nil {
		root := sysfsRoot(m.finder)
		if target, lerr := filepath.EvalSymlinks(filepath.Join(root, "class", "block", name)); lerr == nil {
			if rel, rerr := filepath.Rel(root, target); rerr == nil {
				err = uevent.Trigger(root, "/"+rel, "change")
			}
		}
	}
	if err != nil {
		m.log.Warn("could not update the udev claim mark of a disk", "device", name, "claimed", claimed, "err", err)
	}
}
