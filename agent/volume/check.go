package volume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
)

// reconcileWorkers is how many claims the start-up check takes back side
// by side: enough for every lease volume a node can carry to wait out its
// settle time together (the wait is a sleep, the disk I/O a few blocks).
const reconcileWorkers = 64

// Reconcile re-verifies every recorded claim at start: a claim still ours
// is kept (its device opened and its fence watched), a lost one is fenced
// (P4), and one whose device is gone is cleaned up. A stage cut short by a
// crash has its partial fence released and stays recorded, so its retry
// never formats twice.
//
// Claims are checked side by side: resuming a lease waits its settle
// time (2d) on the disk, and after a restart the host watchdog is fed
// again only once every recorded lease is resumed, which must come within
// W/2 of the earlier process's exit (docs/upgrade.md); one after the
// other, four lease volumes would take that long in settle waits alone;
// lease claims are started first.
func (m *Manager) Reconcile(ctx context.Context) {
	claims, errs := m.store.List()
	for _, err := range errs {
		m.log.Error("a claim record cannot be read; its volume is left alone", "err", err)
	}
	disks := m.newScan()
	startUpOrder(claims)
	slots := make(chan struct{}, max(m.workers, 1))
	var wg sync.WaitGroup
	for _, c := range claims {
		release, err := m.locks.try(c.Volume, "start-up check")
		if err != nil {
			continue
		}
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			defer release()
			m.reconcile(ctx, c, disks)
		})
	}
	wg.Wait()
	m.updateGauge()
}

// startUpOrder puts the lease claims first, in the order they came, then
// the others: with more claims than workers, every lease is taken back
// before a reservation or unfenced claim holds a worker.
func startUpOrder(claims []*Claim) {
	slices.SortStableFunc(claims, func(a, b *Claim) int {
		return cmpBool(b.Method == fence.MethodLease, a.Method == fence.MethodLease)
	})
}

// reconcile re-verifies one claim; disks is the pass's shared scan.
func (m *Manager) reconcile(ctx context.Context, c *Claim, disks *diskScan) {
	log := m.log.With("volume", c.Volume, "device", c.Device)
	dev, err := disks.locate(ctx, c.Locator, m.o.Config.AllowLoopDevices)
	if err != nil {
		m.notLocated(ctx, c, err, log)
		return
	}
	resolved := true
	defer func() {
		if resolved {
			m.checked(c.Volume)
		}
	}()
	if c.Missing {
		// Found and verified: recorded at once, or the claim would be
		// reported missing until a periodic check found it again.
		c.Missing, c.Detail = false, ""
		if err := m.store.Put(c); err != nil {
			log.Error("recording that the claimed disk is back", "err", err)
		}
	}
	if c.DevNum != dev.DevNum() || c.Device != dev.Path {
		log.Info("the claimed disk has a new device node", "now", dev.Path, "devnum", dev.DevNum())
		c.Device, c.DevNum = dev.Path, dev.DevNum()
		// Recorded at once: a repair's mount and the release guard name
		// the disk by the record.
		if err := m.store.Put(c); err != nil {
			log.Error("recording the claim's new device node", "err", err)
		}
	}
	switch {
	case c.Phase != PhaseStaged:
		resolved = m.reconcileInterrupted(ctx, c, dev, log)
	case c.State == StateLost:
		if err := m.host.SetReadOnly(dev, true); err != nil {
			log.Error("keeping a fenced disk read-only", "err", err)
		}
		// A lease lost before the restart whose I/O could not be
		// stopped keeps the host watchdog unfed until a stop succeeds.
		running := c.Method == fence.MethodLease && !m.stopAgain(c, dev) && m.mayBeWriting()
		m.setLive(c.Volume, &live{dev: dev, ioRunning: running})
	case c.State == StateUnfenced:
		m.setLive(c.Volume, &live{dev: dev})
		log.Info("unfenced claim kept (explicit opt-in)")
	default:
		m.reconcileFence(ctx, c, dev, log)
	}
}

// notLocated acts on a claim whose disk the check could not locate (err).
func (m *Manager) notLocated(ctx context.Context, c *Claim, err error, log *slog.Logger) {
	switch {
	case ctx.Err() != nil:
		// Cut short by the agent's stop: nothing is concluded of the
		// disk; the next process checks the claim again.
	case agenterr.KindOf(err) != agenterr.NotFound && mayBeLease(c) && m.mayBeWriting():
		// Its disk cannot be told from another (a scan that failed, a
		// serial that does not match), and a mount of the earlier
		// process may still write to it: the lease stays listed as not
		// resumed, and the host watchdog unfed, until a check finds the
		// disk (or it is found gone).
		log.Error("cannot verify a recorded lease claim's device; the volume is reported abnormal, and the host watchdog is not fed until the check finds its disk", "err", err)
		m.markMissing(c, err)
	case agenterr.KindOf(err) == agenterr.NotFound:
		defer m.checked(c.Volume)
		m.cleanupGone(c, err)
	default:
		defer m.checked(c.Volume)
		log.Error("cannot verify a recorded claim's device; the volume is reported abnormal", "err", err, "fence", c.Method, "phase", c.Phase, "data", c.DataDevice)
		m.markMissing(c, err)
	}
}

// markMissing records that the check could not find c's disk again.
func (m *Manager) markMissing(c *Claim, why error) {
	c.Missing, c.Detail = true, fmt.Sprintf("the agent could not find its disk again: %v", why)
	if err := m.store.Put(c); err != nil {
		m.log.Error("recording the claim", "volume", c.Volume, "err", err)
	}
}

// reconcileInterrupted takes back what a stage or an unstage cut short
// had done, the mount, the mappings and the partial fence, and keeps the
// record for the retry. The fence goes through the release guard: when
// something of the volume is still in use (an unmount that failed, a
// mount the record does not know), the fence is kept and the claim is
// taken back as staged, so that the checks renew and watch it (or find it
// lost, and stop its I/O); when the guard cannot make its proof, the
// record stays as it is and the claim is not resolved: a lease claim
// stays listed as not taken back, and the check tries again. It reports
// whether the claim was resolved.
func (m *Manager) reconcileInterrupted(ctx context.Context, c *Claim, dev *Device, log *slog.Logger) bool {
	if m.getLive(c.Volume) != nil {
		// Taken back in this process (the claim check, the unstage) as
		// the start-up check takes back a stage a process's death cut
		// short: its stage's live entry and fencer go first, so that no
		// engine of that stage renews what this releases, nor finds it
		// lost once released.
		m.setLive(c.Volume, nil)
	}
	m.takeDownInterrupted(ctx, c, log)
	held := false
	ch, err := m.o.Fencers.Choose(ctx, dev, c.Volume, nil)
	if err != nil && (mayBeLease(c) || c.Method != fence.MethodNone) {
		log.Error("cannot choose the fencing of an interrupted stage to release it; the check tries again", "err", err)
		return m.unresolvedInterrupted(c, dev)
	}
	if err != nil || ch.Fencer == nil {
		// The disk offers no fencing now (or, for a stage without
		// fencing, its choice failed): nothing to release, but what
		// is still in use stays watched, as a staged claim: a fenced one
		// (reconcileFence then finds the fencing gone and stops its I/O)
		// or one staged without fencing by opt-in.
		if perr := m.host.InUse(usageOf(c, dev.Path)); perr != nil {
			m.keepInterruptedInUse(ctx, c, dev, perr, log)
			return true
		}
	}
	if err == nil && ch.Fencer != nil {
		err := m.release(ctx, c, dev, ch.Fencer, "the start-up check of a stage or unstage cut short", nil)
		closeChoice(ch)
		switch {
		case inUse(err):
			// Recorded with its fencing as chosen now: a stage cut short
			// before its record named the method must still be listed
			// for the host watchdog and checked as what it is.
			c.Phase, c.State, c.Detail, c.Method = PhaseStaged, StateHeld, err.Error(), ch.Method
			if c.DataOffset == 0 {
				c.DataOffset = ch.DataOffset
			}
			if perr := m.store.Put(c); perr != nil {
				log.Error("recording the interrupted stage whose fence was kept", "err", perr)
			}
			m.reconcileFence(ctx, c, dev, log)
			return true
		case fenceKept(err):
			return m.unresolvedInterrupted(c, dev)
		}
		held = err != nil && !errors.As(err, new(*fence.LostError))
		if held {
			// Its unstage (or the retried stage) releases it.
			log.Warn("releasing the fence of an interrupted stage failed; the claim stays recorded as held", "err", err)
			c.Method = ch.Method
		}
	}
	dev.Close()
	unstaging := c.Phase == PhaseUnstaging
	c.Phase, c.State = PhaseInterrupted, ""
	if held {
		c.State = StateHeld
	}
	if err := m.store.Put(c); err != nil {
		log.Error("recording the interrupted stage", "err", err)
	}
	if unstaging {
		log.Info("found an unstage cut short after it began releasing the disk; released it, and its retry removes the record")
	} else {
		log.Info("found a stage cut short; its retry will finish it")
	}
	return true
}

// keepInterruptedInUse records a stage cut short whose volume is still in
// use (why) as staged, and watches it as the checks watch any.
func (m *Manager) keepInterruptedInUse(ctx context.Context, c *Claim, dev *Device, why error, log *slog.Logger) {
	c.Phase, c.State, c.Detail = PhaseStaged, StateHeld, why.Error()
	if c.Method == fence.MethodNone {
		c.State = StateUnfenced
	}
	if err := m.store.Put(c); err != nil {
		log.Error("recording the interrupted stage still in use", "err", err)
	}
	if c.State == StateUnfenced {
		m.setLive(c.Volume, &live{dev: dev})
		return
	}
	m.reconcileFence(ctx, c, dev, log)
}

// takeDownInterrupted unmounts, closes and detaches what a stage or
// unstage cut short left of the volume; what fails is logged, and the
// release guard then finds it in use.
func (m *Manager) takeDownInterrupted(ctx context.Context, c *Claim, log *slog.Logger) {
	if err := m.unmountIfMounted(c.StagingPath); err != nil {
		log.Error("unmounting an interrupted stage", "err", err)
	}
	if (c.Mapper != "" || c.Encrypted) && m.o.Crypt != nil {
		if err := m.o.Crypt.Close(ctx, m.mapperToClose(c)); err != nil {
			log.Error("closing the dm-crypt mapping of an interrupted stage", "err", err)
		} else {
			c.Mapper = ""
		}
	}
	if err := m.unmapAll(c); err != nil {
		log.Error("detaching the data mapping of an interrupted stage", "err", err)
	}
}

// unresolvedInterrupted leaves a stage cut short as it is recorded for the
// check to try again; a lease claim stays listed as not taken back, which
// stops the host watchdog's feeding until it is.
func (m *Manager) unresolvedInterrupted(c *Claim, dev *Device) bool {
	dev.Close()
	m.mu.Lock()
	if mayBeLease(c) {
		m.unchecked[c.Volume] = true
	}
	m.retakes[c.Volume] = true
	m.mu.Unlock()
	return false
}

// reconcileFence takes back the fence of a held claim (resuming the lease,
// which the process holding it renews) and checks it (P4).
func (m *Manager) reconcileFence(ctx context.Context, c *Claim, dev *Device, log *slog.Logger) {
	// A lease-fenced volume whose lease cannot be taken back now stays
	// mounted; it is listed as unresumed, so that the host watchdog is not
	// fed until a periodic check resumes it (or finds it lost). In the
	// first process after a boot, only when this process had the claim
	// live and something of the volume is in use (ownInUse): no mount of
	// an earlier process survived the boot, and a host whose lease disk
	// cannot be read would be reset over and over.
	unresumed := c.Method == fence.MethodLease && (m.mayBeWriting() || m.ownInUse(c, dev))
	ch, err := m.o.Fencers.Choose(ctx, dev, c.Volume, m.onLost(c.Volume))
	if err != nil {
		m.setLive(c.Volume, &live{dev: dev, unresumed: unresumed})
		log.Error("cannot check the fence of a recorded claim; the periodic check retries", "err", err)
		return
	}
	if ch.Fencer == nil {
		l := &live{dev: dev, ioRunning: unresumed}
		m.setLive(c.Volume, l)
		stopped := m.lose(c, dev, &fence.LostError{Device: dev.Path, Reason: "the disk no longer offers the fencing it was claimed with (" + ch.Reason + ")"})
		m.setRunning(c.Volume, unresumed && !stopped)
		return
	}
	if r, ok := ch.Fencer.(resumer); ok {
		if err := r.Resume(ctx); err != nil {
			var lost *fence.LostError
			retake := retakeNone
			if errors.As(err, &lost) {
				retake = m.retakenUnused(ctx, c, dev, ch, lost)
			}
			switch {
			case retake == retakeDone:
				m.setLive(c.Volume, &live{dev: dev, fencer: ch.Fencer})
				return
			case lost != nil && retake == retakeNone:
				lf, _ := ch.Fencer.(*leaseFencer)
				if lf != nil {
					// Listed as a loss being stopped (the feeding
					// withheld) from now until the stop's outcome.
					lf.loss.Store(lossStopping)
				}
				m.setLive(c.Volume, &live{dev: dev, fencer: ch.Fencer})
				stopped := m.lose(c, dev, lost)
				if lf != nil {
					// What the engine's loss handler records when it
					// finds a loss itself: a stop that failed keeps
					// the host watchdog unfed.
					lf.loss.Store(lossOutcome(stopped))
				}
				return
			}
			closeChoice(ch)
			m.setLive(c.Volume, &live{dev: dev, unresumed: unresumed})
			log.Error("cannot resume the fence of a recorded claim; the periodic check retries (a lease not resumed stops the host watchdog's feeding until it is)", "err", err)
			return
		}
	}
	m.setLive(c.Volume, &live{dev: dev, fencer: ch.Fencer})
	m.checkFence(ctx, c, dev, ch.Fencer)
	if c.State == StateHeld && c.Detail == "" {
		log.Info("claim re-verified at start")
	}
}

// ownInUse reports whether c's claim is live in this process (made live
// by a stage, or taken back since it started) and the release guard's
// proof does not show nothing of the volume in use on dev: what is in use
// then may be this process's own (a fence a failed stage's rollback kept
// over the volume's data mapping), also in the first process after a
// boot.
func (m *Manager) ownInUse(c *Claim, dev *Device) bool {
	return m.getLive(c.Volume) != nil && m.host.InUse(usageOf(c, dev.Path)) != nil
}

// cleanupGone forgets a claim whose disk is no longer attached: whatever
// is still mounted of it is detached, the mapping closed, the record
// removed.
func (m *Manager) cleanupGone(c *Claim, why error) {
	log := m.log.With("volume", c.Volume, "device", c.Device)
	var failed []error
	for _, p := range append(append([]string(nil), c.Publications...), c.StagingPath) {
		// Reached beneath the kubelet root without following a symlink
		// (unmountBeneath), as every unmount of the agent's.
		if err := m.host.Detach(p); err != nil {
			failed = append(failed, fmt.Errorf("detaching the mount at %s: %w", p, err))
		}
	}
	if (c.Mapper != "" || c.Encrypted) && m.o.Crypt != nil {
		if err := m.o.Crypt.Close(context.Background(), m.mapperToClose(c)); err != nil {
			failed = append(failed, fmt.Errorf("closing the dm-crypt mapping: %w", err))
		}
	}
	if err := m.unmapRecorded(c); err != nil {
		failed = append(failed, fmt.Errorf("detaching the data mapping: %w", err))
	}
	if len(failed) > 0 {
		// The record is what lets the next check find what is left.
		err := errors.Join(failed...)
		log.Error("cleaning up a claim whose disk is gone failed; the claim stays, and the check tries again", "err", err)
		m.markMissing(c, fmt.Errorf("%v; cleaning up what is left failed: %v", why, err))
		return
	}
	m.setLive(c.Volume, nil)
	if err := m.forgetGone(c); err != nil {
		log.Error("removing the claim of a vanished disk", "err", err)
	}
	m.clearClaimOf(c)
	m.publish(events.Event{Type: events.DiskReleased, Volume: c.Volume, Device: c.Device, Serial: c.Serial, Reason: "device-gone",
		Message: fmt.Sprintf("volume %s: its disk %s is gone (%v); the claim was cleaned up", c.Volume, c.Device, why)})
	log.Warn("claimed disk is gone; claim cleaned up", "why", why)
}

// forgetGone forgets the claim of a disk that is no longer attached. A
// record kept for a format cut short (forget) no longer names the device
// node and number the disk had: the kernel gives them to the next disk
// attached, which the record would claim (claimedBy, Classify); the next
// stage of the volume finds its disk by its locator.
func (m *Manager) forgetGone(c *Claim) error {
	kept := *c
	kept.Device, kept.DevNum = "", ""
	return m.forget(&kept)
}

// checkFence runs one fence check and acts on a loss.
func (m *Manager) checkFence(ctx context.Context, c *Claim, dev *Device, f fence.Fencer) {
	err := f.Check(ctx)
	var lost *fence.LostError
	switch {
	case err == nil:
		m.o.Metrics.checks.WithLabelValues("ok").Inc()
		if c.Detail != "" {
			c.Detail = ""
			_ = m.store.Put(c)
		}
	case errors.As(err, &lost):
		m.o.Metrics.checks.WithLabelValues("lost").Inc()
		if r, ok := f.(fence.Reestablisher); ok {
			if lost = m.reestablish(ctx, c, dev, r, lost); lost == nil {
				return
			}
		}
		if lost.Holder == 0 {
			// A unit attention says the claim is gone but not to whom;
			// the reservation says, for the event and the operator.
			if e, ok := f.(*pr.Engine); ok {
				if st, err := e.Status(ctx); err == nil && st.Reservation != nil && st.Reservation.Key != c.Key {
					cp := *lost
					cp.Holder, cp.HolderNode = st.Reservation.Key, st.Reservation.Node
					lost = &cp
				}
			}
		}
		m.lose(c, dev, lost)
	default:
		m.o.Metrics.checks.WithLabelValues("error").Inc()
		m.log.Warn("claim check failed; retried at the next interval", "volume", c.Volume, "device", dev.Path, "err", err)
	}
}

// CheckAll checks every staged claim once: the fence of fenced ones, the
// device of unfenced ones. A volume busy with an API call is skipped.
func (m *Manager) CheckAll(ctx context.Context) {
	start := time.Now()
	claims, errs := m.store.List()
	m.recordsGone(claims, errs)
	// Scanned only if a claim has no open device to verify.
	disks := m.newScan()
	for _, c := range claims {
		if ctx.Err() != nil {
			// The agent is stopping: the claims not reached yet are
			// checked by the next process.
			break
		}
		if !m.checkDue(c) {
			continue
		}
		release, err := m.locks.try(c.Volume, "claim check")
		if err != nil {
			continue
		}
		// Re-read under the lock: an API call may have changed it.
		if now, err := m.store.Get(c.Volume); err == nil && now != nil {
			m.checkOne(ctx, now, disks)
		}
		release()
	}
	m.o.Metrics.checkTime.Observe(time.Since(start).Seconds())
	m.updateGauge()
}

// checkDue reports whether the claim check looks at c: a staged claim
// not lost; a lost one whose I/O was not shown stopped, or whose disk
// was not found at start (checkLost); a stage or unstage cut short whose
// disk the start-up check could not verify, or a stage whose record still
// says claiming (cutShort).
func (m *Manager) checkDue(c *Claim) bool {
	switch {
	case c.Phase != PhaseStaged:
		return m.cutShort(c)
	case c.State == StateLost:
		return c.IONotStopped || c.Missing
	}
	return true
}

// checkLost looks again for the disk of a lost claim that was not found
// at start: until it is found, its record says missing, and its unstage
// leaves a data mapping over it that the record does not name (unmapAll).
// It stops again the I/O of one whose stop failed.
func (m *Manager) checkLost(ctx context.Context, c *Claim, disks *diskScan) {
	l := m.getLive(c.Volume)
	switch {
	case l == nil && (c.IONotStopped || c.Missing):
		m.reconcile(ctx, c, disks)
	case l != nil && c.IONotStopped && m.stopAgain(c, l.dev):
		m.setRunning(c.Volume, false)
	}
}

// cutShort reports whether the claim c, not staged, is a stage or unstage
// cut short that is to be taken back as the start-up check takes one
// back: one whose disk that check could not verify, or a stage whose
// record still says claiming while no stage runs (its last record, which
// would have said what it left, could not be written).
func (m *Manager) cutShort(c *Claim) bool {
	return c.Phase == PhaseClaiming || c.Missing || m.unresolved(c.Volume)
}

func (m *Manager) checkOne(ctx context.Context, c *Claim, disks *diskScan) {
	if c.Phase != PhaseStaged {
		if m.cutShort(c) {
			m.reconcile(ctx, c, disks)
		}
		return
	}
	if c.State == StateLost {
		m.checkLost(ctx, c, disks)
		return
	}
	l := m.getLive(c.Volume)
	if l == nil {
		m.reconcile(ctx, c, disks)
		return
	}
	if err := l.dev.Verify(ctx); err != nil {
		if ctx.Err() != nil {
			// A SCSI identity read cut short by the agent's stop says
			// nothing of the disk: not marked missing.
			return
		}
		switch m.cameBack(ctx, c, l, disks) {
		case diskMoved:
			return
		case diskStill:
			// Found verified at its own device node by a fresh open:
			// the read failed, the disk did not go (while the agent
			// holds it open, its device number is not another disk's).
			m.o.Metrics.checks.WithLabelValues("error").Inc()
			m.log.Warn("the claimed disk's identity read failed, but the disk is still at its device node; retried at the next interval", "volume", c.Volume, "device", c.Device, "err", err)
			return
		}
		m.o.Metrics.checks.WithLabelValues("missing").Inc()
		if !c.Missing {
			c.Missing, c.Detail = true, fmt.Sprintf("the disk %s of volume %s is no longer the device it was staged on: %v", c.Device, c.Volume, err)
			_ = m.store.Put(c)
			m.log.Error("claimed disk vanished or changed", "volume", c.Volume, "device", c.Device, "err", err)
		}
		return
	}
	if c.Missing {
		c.Missing, c.Detail = false, ""
		_ = m.store.Put(c)
		m.log.Info("claimed disk is back", "volume", c.Volume, "device", c.Device)
	}
	if l.fencer == nil {
		if c.State == StateHeld {
			// Opened without its fencer (resuming it failed at start).
			m.reconcile(ctx, c, disks)
			return
		}
		m.o.Metrics.checks.WithLabelValues("ok").Inc()
		return
	}
	m.checkFence(ctx, c, l.dev, l.fencer)
}

// cameBack takes back a claim whose disk is no longer at its device node
// but is attached again at another (removed and added back): found by its
// locator, it is re-verified as the start-up check does (reconcile), under
// the fence the claim holds. It reports where it found the disk.
func (m *Manager) cameBack(ctx context.Context, c *Claim, l *live, disks *diskScan) whereDisk {
	dev, err := disks.locate(ctx, c.Locator, m.o.Config.AllowLoopDevices)
	if agenterr.KindOf(err) == agenterr.NotFound {
		return diskGone
	}
	if err != nil {
		return diskUnknown
	}
	moved := dev.DevNum() != l.dev.DevNum() || dev.Path != l.dev.Path
	dev.Close()
	if !moved {
		return diskStill
	}
	m.log.Info("a claimed disk is attached again at another device node; taking its claim back", "volume", c.Volume, "was", l.dev.Path)
	m.reconcile(ctx, c, disks)
	return diskMoved
}

// whereDisk is what cameBack found of a claim's disk whose identity
// check failed.
type whereDisk int

const (
	// diskGone: not found.
	diskGone whereDisk = iota
	// diskStill: found at the device node the claim holds open.
	diskStill
	// diskMoved: found at another device node, and taken back there.
	diskMoved
	// diskUnknown: the lookup failed (a read that timed out, two disks
	// answering to the locator): it says nothing of where the disk is.
	diskUnknown
)

// Run checks every claim at the configured interval until ctx ends.
func (m *Manager) Run(ctx context.Context) {
	t := time.NewTicker(m.o.Config.CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.CheckAll(ctx)
		}
	}
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}
