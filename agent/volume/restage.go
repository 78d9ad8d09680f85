package volume

// A repeated NodeStage of a recorded claim: an intact stage answers as it
// did, what is missing is repaired under the held fence, and the first
// stage's path (whose rollback releases) never runs over a volume in use.

import (
	"context"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// restage takes up the recorded claim c for a stage request: a stage that
// is intact is done (its result returned); a lost claim starts over only
// with a grant and unpublished; any other goes through the stage again.
func (m *Manager) restage(ctx context.Context, c *Claim, r StageRequest, staging, fsType string) (done *StageResult, err error) {
	if err := compatible(c, r, staging, fsType); err != nil {
		return nil, err
	}
	switch {
	case c.State == StateLost && r.Grant == nil:
		return nil, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s; staging it again needs a takeover grant from the controller", r.Volume, c.Detail)
	case c.State == StateLost && len(c.Publications) > 0:
		return nil, agenterr.New(agenterr.FailedPrecondition, "volume %s lost its fence and is still published at %v; unpublish it before staging it again", r.Volume, c.Publications)
	case c.State == StateLost:
		return nil, m.dropLost(ctx, c)
	case c.Phase != PhaseStaged:
		if err := m.takenBackBefore(ctx, c); err != nil {
			return nil, err
		}
		return nil, m.notInUseBefore(ctx, c)
	case m.notTakenBack(c.Volume):
		// Staged by an earlier agent process, whose lease this one has
		// not taken back: a stage now would let go of what keeps the
		// host watchdog unfed for it before holding anything.
		return nil, agenterr.New(agenterr.Unavailable, "volume %s: the agent has not yet taken back the lease it held for this volume before it restarted (the claim check retries every %s); the stage can be retried after that", c.Volume, m.o.Config.CheckInterval)
	}
	return m.restaged(ctx, c, r)
}

// takenBackBefore takes back, before the first stage's path runs over it,
// a stage cut short whose disk the start-up check could not find (its
// record missing): the fence that stage may have taken before its record
// named it is released through the release guard (takeBackCutShort), as
// the unstage would. Otherwise the stage's record, its disk found again,
// would no longer say so: a stage failing before its own acquire leaves
// it interrupted with nothing held, and the unstage forgets it with that
// fence still on the disk. c is updated to the claim as recorded after.
func (m *Manager) takenBackBefore(ctx context.Context, c *Claim) error {
	if !c.Missing {
		return nil
	}
	now, err := m.takeBackCutShort(ctx, c)
	switch {
	case err != nil:
		return err
	case now == nil:
		return agenterr.New(agenterr.Unavailable, "volume %s: its stage was cut short and its disk was not found, so its claim was let go of; retry the stage", c.Volume)
	case now.Phase == PhaseStaged:
		// Still in use, taken back as staged: the retry takes it up so.
		return agenterr.New(agenterr.Unavailable, "volume %s: its stage was cut short and something of it is still in use (%s); it is checked as staged now: retry the stage", c.Volume, now.Detail)
	}
	*c = *now
	return nil
}

// notInUseBefore refuses to run the first stage's path over a claim whose
// stage was cut short while something of the volume is still in use (a
// mount of an earlier agent process that the start-up check could not
// take back yet): that path's rollback would take down what it did not
// make. UNAVAILABLE: the claim check takes it back, then the retry runs.
func (m *Manager) notInUseBefore(ctx context.Context, c *Claim) error {
	if m.unresolved(c.Volume) {
		return agenterr.New(agenterr.Unavailable, "volume %s: its stage was cut short and the agent has not taken it back since it started (the claim check retries every %s); retry the stage after that", c.Volume, m.o.Config.CheckInterval)
	}
	if c.Device == "" {
		return nil
	}
	err := m.host.InUse(usageOf(c, c.Device))
	if err != nil && !inUse(err) {
		// The proof could not be made at the recorded device node: the
		// disk may be attached again at another, where it is made.
		if dev, lerr := m.locate(ctx, c.Locator); lerr == nil {
			if dev.Path != c.Device {
				err = m.host.InUse(usageOf(c, dev.Path))
			}
			dev.Close()
		}
	}
	if err != nil {
		return agenterr.New(agenterr.Unavailable, "volume %s: its stage was cut short and %v; the claim check takes it back, retry the stage after that", c.Volume, err)
	}
	return nil
}

// restaged answers a repeated stage of a staged claim. It never runs the
// first stage's path over it (that path's rollback would release the
// fence of a volume in use): an intact stage is done; a live entry or a
// fencer missing is taken back as the claim check would (reconcile); a
// staging path found unmounted, with nothing of the volume in use, is
// mounted again (repair); anything it cannot tell now is UNAVAILABLE, for
// the kubelet to retry.
func (m *Manager) restaged(ctx context.Context, c *Claim, r StageRequest) (*StageResult, error) {
	if l := m.getLive(c.Volume); l == nil || (c.State == StateHeld && l.fencer == nil) {
		// Opened at start without its fencer, or not at all: taken back
		// as the claim check does, which never releases.
		m.reconcile(ctx, c, m.newScan())
		now, err := m.store.Get(c.Volume)
		if err != nil {
			return nil, err
		}
		l := m.getLive(c.Volume)
		if now == nil || now.Phase != PhaseStaged || now.Abnormal() || m.notTakenBack(c.Volume) ||
			(now.State == StateHeld && (l == nil || l.fencer == nil)) {
			return nil, agenterr.New(agenterr.Unavailable, "volume %s is staged, but the agent could not take its disk and fence back yet (%s); the claim check retries every %s: retry the stage after that",
				c.Volume, detailOf(now), m.o.Config.CheckInterval)
		}
		c = now
	}
	mounted, err := m.stillStaged(ctx, c)
	if err != nil {
		return nil, err
	}
	if !mounted {
		if err := m.repair(ctx, c, r); err != nil {
			return nil, err
		}
	}
	m.log.Info("volume already staged", "volume", c.Volume, "device", c.MountDevice(), "staging", c.StagingPath)
	return &StageResult{Device: c.MountDevice(), Method: c.Method}, nil
}

// detailOf says why a claim (nil: gone) is not usable, for an error.
func detailOf(c *Claim) string {
	switch {
	case c == nil:
		return "its claim is gone: its disk was not found"
	case c.Detail != "":
		return c.Detail
	}
	return "its lease is not resumed yet"
}

// stillStaged checks a recorded stage with a live entry: device verified
// and fence intact, or an error (UNAVAILABLE when a retry may find it so,
// FAILED_PRECONDITION for a fence lost); it reports whether the staging
// path is mounted (a raw block volume has none: true).
func (m *Manager) stillStaged(ctx context.Context, c *Claim) (bool, error) {
	if err := m.holdsStill(ctx, c, m.getLive(c.Volume), "stage"); err != nil {
		return false, err
	}
	if c.Block {
		return m.blockIntact(c), nil
	}
	mp, err := m.host.IsMountPoint(c.StagingPath)
	if err != nil {
		return false, agenterr.New(agenterr.Unavailable, "volume %s is staged, but whether %s is mounted could not be read: %v; retry the stage", c.Volume, c.StagingPath, err)
	}
	if mp {
		if err := m.stagingHolds(c); err != nil {
			return false, err
		}
	}
	return mp, nil
}

// stagingHolds refuses a staging mount that is not on the volume's device
// as its claim names it now: a disk removed and attached again at another
// device node, which the claim check takes back there, leaves the mount on
// the device it had before (or on a data mapping over it), which is gone:
// every I/O of it fails. So does a disk attached again at its own node
// (the same device number, a new block device): a data mapping over it
// from before maps the device that left (MapsDiskNow). A staging path with nothing mounted passes (the
// caller says so).
func (m *Manager) stagingHolds(c *Claim) error {
	src, err := m.mountSource(c.StagingPath)
	if err != nil {
		return agenterr.New(agenterr.Unavailable, "volume %s: what is mounted at its staging path %s could not be read: %v; retry", c.Volume, c.StagingPath, err)
	}
	if src == "" {
		return nil
	}
	what := fmt.Sprintf("%s, not the volume's device %s", src, c.MountDevice())
	if sameDevice(src, c.MountDevice()) {
		if c.DataDevice == "" || m.host.MapsDiskNow(c.DataDevice, c.Device) {
			return nil
		}
		what = fmt.Sprintf("%s over the data mapping %s, which no longer maps its disk %s as it is attached now", src, c.DataDevice, c.Device)
	}
	return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged, but its staging path %s holds %s (its disk was removed and attached again); unpublish and unstage the volume, then stage it again",
		c.Volume, c.StagingPath, what)
}

// blockIntact reports whether what a staged raw block volume's device is
// made of is still there: its dm-crypt mapping (an unstage stopped after
// closing it has taken it off the record) and its data mapping (a loop
// device over its disk as it is attached now; the lease always keeps its
// area before the data, also when a stage failed before recording where
// the data starts). Otherwise a publish would hand the pod the
// ciphertext disk, or a loop device that maps nothing.
func (m *Manager) blockIntact(c *Claim) bool {
	if c.Encrypted && (c.Mapper == "" || !m.host.MappingOpen(c.Mapper)) {
		return false
	}
	needsData := c.DataOffset > 0 || c.Method == fence.MethodLease
	if needsData && (c.DataDevice == "" || !m.host.MapsDiskNow(c.DataDevice, c.Device)) {
		return false
	}
	return m.podDeviceIntact(c)
}

// repair mounts a staged volume whose staging path is no longer mounted
// (unmounted by hand, or by an unstage that stopped after its unmount):
// its data mapping, its dm-crypt mapping and the mount are made again by
// the stage's own steps, under the fence the claim holds, which the
// repair's rollback never releases. A publication still mounted means the
// filesystem is in use elsewhere: refused, nothing touched.
func (m *Manager) repair(ctx context.Context, c *Claim, r StageRequest) error {
	if l := m.getLive(c.Volume); c.State == StateHeld && (l == nil || l.fencer == nil) {
		return agenterr.New(agenterr.Unavailable, "volume %s is staged, but the agent has not taken its fence back yet; the claim check retries every %s: retry the stage after that", c.Volume, m.o.Config.CheckInterval)
	}
	for _, p := range c.Publications {
		if mp, err := m.host.IsMountPoint(p); err != nil || mp {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged and published at %s, but its staging path %s is not mounted; unpublish it, then stage it again",
				c.Volume, p, c.StagingPath)
		}
	}
	if err := m.closeStaleMapping(ctx, c); err != nil {
		return err
	}
	l := m.getLive(c.Volume)
	ch, err := m.repairChoice(ctx, c, l)
	if err != nil {
		return err
	}
	s := &staging{m: m, c: c, r: r, dev: l.dev, live: true, choice: ch}
	m.log.Warn("the staging path of a staged volume is not mounted; mounting it again", "volume", c.Volume, "staging", c.StagingPath)
	return s.run(ctx, []step{{"map", s.mapDataRegion}, {"unlock", s.unlock}, {"pod", s.mapPodDevice}, {"mount", s.mount}, {"record", s.record}})
}

// repairChoice is how a repair stages the volume again: with the fence
// its claim holds and the data offset recorded; a lease volume whose stage
// stopped before recording where its data starts (a raw block volume has
// no filesystem to say it) asks its fencing again, and the lease always
// puts the data past its area.
func (m *Manager) repairChoice(ctx context.Context, c *Claim, l *live) (Choice, error) {
	ch := Choice{Fencer: l.fencer, Method: c.Method, DataOffset: c.DataOffset}
	if ch.DataOffset > 0 || c.Method != fence.MethodLease {
		return ch, nil
	}
	fresh, err := m.o.Fencers.Choose(ctx, l.dev, c.Volume, nil)
	if err != nil {
		return ch, agenterr.New(agenterr.Unavailable, "volume %s is staged, but where its data starts could not be read to map it again: %v; retry the stage", c.Volume, err)
	}
	closeChoice(fresh)
	if fresh.Method != fence.MethodLease || fresh.DataOffset == 0 {
		return ch, agenterr.New(agenterr.FailedPrecondition, "volume %s is staged with the lease, but its disk %s no longer offers it; where its data starts is unknown, nothing was mapped", c.Volume, l.dev.Path)
	}
	ch.DataOffset = fresh.DataOffset
	return ch, nil
}

// closeStaleMapping closes, before a repair opens it again, the dm-crypt
// mapping of an encrypted volume whose staging path is not mounted: one
// left over the data mapping of a disk that went away and came back (a
// stage cut short between the open and its record leaves it unnamed), which
// the open would find in its way. A mapping in use is not closed (the
// close refuses), and the repair stops there.
func (m *Manager) closeStaleMapping(ctx context.Context, c *Claim) error {
	if (c.Mapper == "" && !c.Encrypted) || m.o.Crypt == nil {
		return nil
	}
	if err := m.o.Crypt.Close(ctx, m.mapperToClose(c)); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged, but its staging path is not mounted and its dm-crypt mapping could not be closed to open it again: %v", c.Volume, err)
	}
	c.Mapper = ""
	return m.store.Put(c)
}

// dropLost undoes what is left of a lost claim so that a granted stage can
// start over: the read-only staging mount, the dm-crypt mapping and the
// data mapping go, before the live entry that keeps a lost lease whose
// I/O was not shown stopped listed for the host watchdog; the record
// keeps Formatted. The record stops saying lost only once the release
// guard's proof shows nothing of the volume in use on its disk: a granted
// stage that fails before its acquire (or whose acquire is refused) would
// otherwise leave the lost claim's data mapping over the disk another node
// holds, under no fence of this node and no longer recorded as fenced.
func (m *Manager) dropLost(ctx context.Context, c *Claim) error {
	if err := m.unmountIfMounted(c.StagingPath); err != nil {
		return err
	}
	if (c.Mapper != "" || c.Encrypted) && m.o.Crypt != nil {
		if err := m.o.Crypt.Close(context.Background(), m.mapperToClose(c)); err != nil {
			return fmt.Errorf("volume %s: closing the dm-crypt mapping of the lost claim: %w", c.Volume, err)
		}
		c.Mapper = ""
	}
	if err := m.unmapAll(c); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: detaching the data mapping of the lost claim: %v; the claim stays lost: stop what still uses the mapping, then stage the volume again", c.Volume, err)
	}
	if err := m.lostUnused(ctx, c); err != nil {
		return agenterr.New(agenterr.KindOf(err), "volume %s lost its fence, and %v; it stays recorded as lost: retry the stage", c.Volume, err)
	}
	m.setLive(c.Volume, nil)
	// Nothing of the claim is left on the node: no I/O of it can run.
	c.IONotStopped = false
	c.Phase, c.State, c.Detail, c.HolderKey, c.HolderNode = PhaseInterrupted, "", "", 0, ""
	return m.store.Put(c)
}
