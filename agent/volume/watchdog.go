package volume

import (
	"errors"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// What became of a lost lease's I/O (leaseFencer.loss).
const (
	lossNone int32 = iota
	lossStopping
	lossStopped
	lossRunning
)

func lossOutcome(stopped bool) int32 {
	if stopped {
		return lossStopped
	}
	return lossRunning
}

// Leases lists, for the host watchdog, the on-disk leases whose volumes
// this agent has staged: each held one with the issue time of its last
// renewal, and each lost one with whether its I/O was stopped and drained
// (fenced) or not (then its stale renewal stops the feeding), and each
// one held before an agent restart that is not resumed yet: not looked at
// by the start-up check, or whose resume failed.
func (m *Manager) Leases() []watchdog.Lease {
	m.mu.Lock()
	fs := make(map[string]*leaseFencer, len(m.live))
	var out []watchdog.Lease
	for v := range m.unchecked {
		out = append(out, watchdog.Lease{Volume: v, Unresumed: true})
	}
	for v, l := range m.live {
		if f, ok := l.fencer.(*leaseFencer); ok {
			fs[v] = f
		} else if l.unresumed || l.ioRunning {
			out = append(out, watchdog.Lease{Volume: v, Unresumed: l.unresumed, Running: l.ioRunning})
		}
	}
	m.mu.Unlock()
	for v, f := range fs {
		// Health is read without the engine's lock, which an
		// acquisition or a lease I/O may hold for long.
		h := f.Health()
		held, renewed := h.Held, h.RenewedAt
		l := watchdog.Lease{Volume: v, Renewed: renewed, Fail: f.timing.Fail, IOTimeout: f.timing.IOTimeout}
		switch f.loss.Load() {
		case lossStopped:
			l.Fenced = true
		case lossNone:
			// A claim just lost is no longer held, and its loss handler
			// may not have started yet: it stays listed (stale) until
			// the handler says whether its I/O stopped. An engine that
			// never held has no renewal time.
			if !held && (!h.Lost || renewed.IsZero()) {
				continue
			}
		}
		out = append(out, l)
	}
	return out
}

// ExpectRecordedLeases lists every staged claim recorded as lease-fenced by
// an earlier agent process as not resumed yet, until the start-up check
// (Reconcile) has looked at it: called before the host watchdog runs, so
// that a restarted agent feeds its host only for leases it has seen
// renewed, however long the check of many volumes takes. A claim the check
// cannot locate is let go of the list once looked at (it is reported
// abnormal), so a node whose disk is gone is not reset over and over. A
// record that cannot be read is listed until it is fixed or removed.
//
// The first start after the host booted lists none: a reboot took every
// mount and mapping of the earlier process with it, so nothing writes
// under those leases, and a check of many volumes must not have the
// watchdog, which the list would arm, reset a host that just booted. The
// kernel's boot id, kept in the state directory, tells; when either is
// unknown the claims are listed.
func (m *Manager) ExpectRecordedLeases() {
	if m.firstStartSinceBoot() {
		m.mu.Lock()
		m.afterBoot = true
		m.mu.Unlock()
		return
	}
	claims, errs := m.store.List()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range claims {
		if recordedLease(c) && m.live[c.Volume] == nil {
			m.unchecked[c.Volume] = true
		}
	}
	// A record that cannot be read may be a lease's whose volume is
	// mounted: listed until it is fixed (the checks then take it back)
	// or removed (recordsGone).
	for _, err := range errs {
		var re *RecordError
		if errors.As(err, &re) && m.live[re.Volume] == nil {
			m.unchecked[re.Volume] = true
		}
	}
}

// recordsGone takes off the host watchdog's list of leases not resumed
// the volumes that have no record any more, readable or not (claims and
// errs are the store's listing): nothing is known to write under them.
func (m *Manager) recordsGone(claims []*Claim, errs []error) {
	known := map[string]bool{}
	for _, c := range claims {
		known[c.Volume] = true
	}
	for _, err := range errs {
		var re *RecordError
		if !errors.As(err, &re) {
			return // the listing failed: nothing is concluded
		}
		known[re.Volume] = true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for v := range m.unchecked {
		if !known[v] {
			delete(m.unchecked, v)
		}
	}
}

// recordedLease reports whether an earlier agent process may have left
// I/O under c's lease: a staged lease claim not lost (or lost with its I/O
// not shown stopped), or a lease stage or unstage cut short, which may
// have left a mapping over the disk (or a mount the record does not say).
func recordedLease(c *Claim) bool {
	if !mayBeLease(c) {
		return false
	}
	if c.Phase != PhaseStaged {
		return true
	}
	return c.State != StateLost || c.IONotStopped
}

// mayBeLease reports whether c's disk may be fenced with the lease: its
// record says so, or it is a stage cut short before its record named the
// method (a data mapping may already be over the disk).
func mayBeLease(c *Claim) bool {
	return c.Method == fence.MethodLease || (c.Phase != PhaseStaged && c.Method == "")
}

// unresolved reports whether the start-up check has not yet taken back
// volume's claim (it is still listed as not checked, or its take-back is
// retried by the claim check).
func (m *Manager) unresolved(volume string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.unchecked[volume] || m.retakes[volume]
}

// bootIDFile keeps, in the state directory, the boot id of the host's
// boot the agent last started in.
const bootIDFile = "boot-id"

// firstStartSinceBoot reports whether the boot id recorded by the last
// agent start differs from this boot's, and records this boot's.
func (m *Manager) firstStartSinceBoot() bool {
	path := filepath.Join(m.o.StateDir, bootIDFile)
	cur, err := m.bootID()
	if err != nil {
		m.log.Warn("cannot read the kernel's boot id; leases recorded by an earlier process are waited for as after a restart", "err", err)
		forgetBootID(path)
		return false
	}
	prev, perr := os.ReadFile(path)
	if err := writeSmallFile(path, []byte(cur+"\n")); err != nil {
		m.log.Warn("cannot record the kernel's boot id; leases recorded by an earlier process are waited for as after a restart", "path", path, "err", err)
		forgetBootID(path)
		return false
	}
	if perr != nil || strings.TrimSpace(string(prev)) == cur {
		return false
	}
	m.log.Info("first start since the host booted: no mount of the earlier process survived the boot, so its leases are checked without stopping the host watchdog's feeding")
	return true
}

// forgetBootID removes the boot id an earlier boot's process recorded
// when this process could not record its own: left, it would make a later
// process of this boot, one that reads and records the id, take itself
// for the first since the boot and list none of the leases this one may
// have staged. Without a record a later process answers carefully too.
//
// When the removal fails too, the state directory refuses writes: no claim
// can be recorded in it either, so nothing is staged under a lease
// meanwhile.
func forgetBootID(path string) { _ = os.Remove(path) }

// writeSmallFile replaces path with data through a temporary file and a
// rename, following no symlink. Not synced: a boot id lost to a crash
// reads as unknown, which is the careful case.
func writeSmallFile(path string, data []byte) error {
	tmp := path + ".tmp"
	_ = unix.Unlink(tmp)
	fd, err := unix.Open(tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, werr := f.Write(data)
	if err := errors.Join(werr, f.Close()); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// kernelBootID is the kernel's id of the current boot.
func kernelBootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", errors.New("/proc/sys/kernel/random/boot_id is empty")
	}
	return id, nil
}

// mayBeWriting reports whether a lease-fenced volume the check could not
// take back may still have I/O of an earlier agent process's mounts: not
// on the first start after a boot, which took them all.
func (m *Manager) mayBeWriting() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return !m.afterBoot
}

// checked takes a claim off the unchecked list once the start-up check
// has looked at it.
func (m *Manager) checked(volume string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.unchecked, volume)
	delete(m.retakes, volume)
}
