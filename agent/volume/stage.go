package volume

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// StageRequest is StageVolume's input.
type StageRequest struct {
	Volume      string
	Locator     Locator
	StagingPath string
	FsType      string
	Block       bool
	MountFlags  []string
	ReadOnly    bool
	Grant       *fence.Grant
	// Encrypted volumes carry the passphrase (never stored or logged).
	Encrypted  bool
	Passphrase []byte
	// FormatLUKS gives a blank device a LUKS2 header holding Token, the
	// passphrase wrapped by the transit engine.
	FormatLUKS    bool
	Token         *luks2.TransitToken
	AllowUnfenced bool
	// NeverPublished is the controller's word that no node was given the
	// disk before this stage's: the reclaim wait is skipped (acquire).
	NeverPublished bool
}

// StageResult says what Stage did.
type StageResult struct {
	Device    string
	Method    fence.Method
	Formatted bool
}

// maxVolumeID is CSI's limit on a volume id; it also keeps the claim
// record's file name (the id in base64) under the kernel's 255 bytes.
const maxVolumeID = 128

// checkVolumeID refuses an id a claim could not be recorded under, or
// that would put control characters into log lines and journal fields.
func checkVolumeID(v string) error {
	if v == "" {
		return agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if len(v) > maxVolumeID {
		return agenterr.New(agenterr.InvalidArgument, "the volume id is %d bytes long; at most %d are accepted", len(v), maxVolumeID)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return agenterr.New(agenterr.InvalidArgument, "volume id %q holds a control character", v)
		}
	}
	return nil
}

func fsTypeOf(r StageRequest) (string, error) {
	if r.Block {
		if r.FsType != "" {
			return "", agenterr.New(agenterr.InvalidArgument, "volume %s: a raw block volume has no filesystem, but fs_type %q was given", r.Volume, r.FsType)
		}
		if len(r.MountFlags) > 0 {
			return "", agenterr.New(agenterr.InvalidArgument, "volume %s: a raw block volume takes no mount flags", r.Volume)
		}
		return "", nil
	}
	switch r.FsType {
	case "":
		return "ext4", nil
	case "ext4", "xfs":
		return r.FsType, nil
	}
	return "", agenterr.New(agenterr.InvalidArgument, "volume %s: filesystem type %q is not supported; use ext4 or xfs", r.Volume, r.FsType)
}

func checkFlags(volume string, flags []string) error {
	for _, f := range flags {
		if f == "" || strings.ContainsAny(f, ",\n") {
			return agenterr.New(agenterr.InvalidArgument, "volume %s: mount flag %q is empty or holds a comma or newline; give one option per flag", volume, f)
		}
	}
	return nil
}

// compatible reports how a retried stage differs from the recorded one.
func compatible(c *Claim, r StageRequest, staging, fsType string) error {
	var diff []string
	if c.StagingPath != staging {
		diff = append(diff, fmt.Sprintf("staging path %s, not %s", c.StagingPath, staging))
	}
	if c.Block != r.Block {
		diff = append(diff, fmt.Sprintf("block=%v, not %v", c.Block, r.Block))
	}
	if c.FsType != fsType {
		diff = append(diff, fmt.Sprintf("filesystem %q, not %q", c.FsType, fsType))
	}
	if c.ReadOnly != r.ReadOnly {
		diff = append(diff, fmt.Sprintf("read_only=%v, not %v", c.ReadOnly, r.ReadOnly))
	}
	if c.Encrypted != r.Encrypted {
		diff = append(diff, fmt.Sprintf("encrypted=%v, not %v", c.Encrypted, r.Encrypted))
	}
	if !c.Locator.Equal(r.Locator) {
		diff = append(diff, fmt.Sprintf("device %s, not %s", c.Locator, r.Locator))
	}
	if !slices.Equal(c.MountFlags, r.MountFlags) {
		diff = append(diff, fmt.Sprintf("mount flags %v, not %v", c.MountFlags, r.MountFlags))
	}
	if len(diff) == 0 {
		return nil
	}
	return agenterr.New(agenterr.AlreadyExists, "volume %s is already staged on this node with %s; unstage it first to stage it differently",
		c.Volume, strings.Join(diff, ", "))
}

// Stage implements StageVolume: the volume's disk is fenced, unlocked and
// mounted at the staging path (stage.go). A retry of a stage that is
// intact answers as the stage did.
func (m *Manager) Stage(ctx context.Context, r StageRequest) (res StageResult, err error) {
	defer m.count("stage", &err)
	staging, fsType, err := m.checkStage(r)
	if err != nil {
		return res, err
	}
	release, err := m.locks.try(r.Volume, "stage")
	if err != nil {
		return res, err
	}
	defer release()

	c, err := m.store.Get(r.Volume)
	if err != nil {
		return res, err
	}
	if c == nil {
		if other := m.stagedAt(staging, r.Volume); other != "" {
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: the staging path %s is volume %s's; refused, nothing touched", r.Volume, staging, other)
		}
		c = &Claim{Volume: r.Volume, Locator: r.Locator, StagingPath: staging, FsType: fsType, Block: r.Block,
			MountFlags: r.MountFlags, ReadOnly: r.ReadOnly, Encrypted: r.Encrypted}
	} else if done, err := m.restage(ctx, c, r, staging, fsType); err != nil {
		return res, err
	} else if done != nil {
		return *done, nil
	}
	return m.stage(ctx, c, r)
}

// checkStage refuses a request no stage could carry out, and returns its
// staging path and filesystem type.
func (m *Manager) checkStage(r StageRequest) (staging, fsType string, err error) {
	if err := checkVolumeID(r.Volume); err != nil {
		return "", "", err
	}
	if r.Locator.IsZero() {
		return "", "", agenterr.New(agenterr.InvalidArgument, "volume %s: the device locator names nothing (pci address, serial or wwn)", r.Volume)
	}
	if staging, err = confineStaging(m.o.Config.KubeletRoot, r.StagingPath, r.Block); err != nil {
		return "", "", err
	}
	if fsType, err = fsTypeOf(r); err != nil {
		return "", "", err
	}
	if err := checkFlags(r.Volume, r.MountFlags); err != nil {
		return "", "", err
	}
	if r.Encrypted && len(r.Passphrase) == 0 {
		return "", "", agenterr.New(agenterr.InvalidArgument, "volume %s is encrypted but the request carries no passphrase", r.Volume)
	}
	return staging, fsType, nil
}

// A stage takes the steps of a volume's life on a node in their order
// (docs/architecture.md, "A volume's life"): open and verify the disk,
// fence it, map its data region, unlock it, make a raw block volume's pod
// device (poddev.go), mount it, record it. A step
// that changes something pushes its undo onto the stage's rollback; when a
// step fails, the undos run last first. So whatever fails leaves nothing
// mounted, no dm-crypt mapping and no fence held, and the disk closed --
// unless something of the volume is still in use: the release guard then
// keeps the fence, and the claim stays staged and checked (guard.go). A
// first attempt that wrote nothing on the disk leaves no record (nor a data
// mapping), any other stays recorded as interrupted, and its retry
// finishes it without formatting twice.

// staging is one stage in progress.
type staging struct {
	m     *Manager
	c     *Claim
	r     StageRequest
	isNew bool // no claim was recorded before this stage

	dev    *Device
	choice Choice
	// acquired: the fence is taken; the disk is this node's until the
	// rollback releases it.
	acquired bool
	// live: the claim went live; its live record closes the disk and the
	// fencer.
	live bool
	// kept: the rollback's release was refused by the release guard
	// (guard.go): something of the volume is in use, so the fence, the
	// live entry and a staged record stay, and the claim check renews
	// and watches them.
	kept bool
	// releaseFailed: the rollback's release failed; the fence may be
	// held, so the claim is not forgotten.
	releaseFailed bool
	formatted     bool // a filesystem or a LUKS2 header was made
	// unlocked is how the LUKS2 volume was mapped; headerNote tells the
	// DiskClaimed event of a damaged header it was opened in spite of.
	unlocked   Mapped
	headerNote string
	undo       rollback
	// took says how long each step took, for the log: where a slow
	// stage spends its time (docs/benchmarks.md).
	took []string
	// parts are the timed parts of the step under way (fence: choose,
	// prepare, acquire), logged after its total.
	parts []string
}

// timed runs one part of a step and notes how long it took.
func (s *staging) timed(name string, run func() error) error {
	start := time.Now()
	err := run()
	s.parts = append(s.parts, fmt.Sprintf("%s %s", name, time.Since(start).Round(time.Millisecond)))
	return err
}

// rollback is a stack of undos.
type rollback []func()

func (r *rollback) push(undo func()) { *r = append(*r, undo) }

// run runs the undos, the last pushed first.
func (r *rollback) run() {
	for i := len(*r) - 1; i >= 0; i-- {
		(*r)[i]()
	}
	*r = nil
}

// step is one named step of a stage.
type step struct {
	name string
	run  func(context.Context) error
}

// stage takes the steps of a stage of the claim c, recorded or new.
func (m *Manager) stage(ctx context.Context, c *Claim, r StageRequest) (StageResult, error) {
	s := &staging{m: m, c: c, r: r, isNew: c.Phase == ""}
	err := s.run(ctx, []step{{"open", s.openDisk}, {"fence", s.fence}, {"map", s.mapDataRegion}, {"unlock", s.unlock}, {"pod", s.mapPodDevice}, {"mount", s.mount}, {"record", s.record}})
	if err != nil {
		return StageResult{Formatted: s.formatted}, err
	}
	return StageResult{Device: c.MountDevice(), Method: c.Method, Formatted: s.formatted}, nil
}

// run takes steps in order, timing each; when one fails, the undos run.
func (s *staging) run(ctx context.Context, steps []step) error {
	for _, st := range steps {
		start := time.Now()
		err := st.run(ctx)
		took := fmt.Sprintf("%s %s", st.name, time.Since(start).Round(time.Millisecond))
		if len(s.parts) > 0 {
			took += " (" + strings.Join(s.parts, ", ") + ")"
			s.parts = nil
		}
		s.took = append(s.took, took)
		if err != nil {
			s.undo.run()
			return err
		}
	}
	return nil
}

// openDisk finds the disk the locator names, opens and verifies it, and
// records the claim before anything touches the disk: from that record on
// the uevent watcher leaves the disk alone (Classify).
func (s *staging) openDisk(ctx context.Context) error {
	m, c := s.m, s.c
	dev, err := m.locateAttaching(ctx, s.r.Locator)
	if err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	s.dev = dev
	s.undo.push(s.unrecord)
	s.undo.push(func() {
		if s.kept {
			return
		}
		m.setLive(c.Volume, nil)
		dev.Close()
	})
	// The refusals below and the record are made under watchMu, which
	// every stage records under: a stage that waited for its disk, or
	// ran beside another, never records a disk or a staging path
	// another volume's claim was recorded with meanwhile.
	m.watchMu.Lock()
	defer m.watchMu.Unlock()
	// One disk, one volume: a second volume staged from the same disk
	// would mount it twice, and its unstage would release the fence the
	// first one still relies on.
	if other := m.claimedBy(dev, c.Volume); other != "" {
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: disk %s is already staged on this node as volume %s; unstage that volume first", c.Volume, dev.Path, other)
	}
	// One staging path, one volume (Stage refuses it before the wait
	// for the disk too): this stage's rollback and unstage would take
	// down the other volume's mount there.
	if other := m.stagedAt(c.StagingPath, c.Volume); other != "" {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: the staging path %s is volume %s's; refused, nothing touched", c.Volume, c.StagingPath, other)
	}
	m.setLive(c.Volume, nil)
	c.Device, c.DevNum, c.Serial, c.Missing = dev.Path, dev.DevNum(), dev.Serial, false
	// A stage retried over one cut short is claiming again: a crash
	// from here on leaves a record that says a stage was under way,
	// never "interrupted" over what this stage mounts.
	c.Phase = PhaseClaiming
	return m.store.Put(c)
}

// locateAttaching locates loc's disk, and waits up to volumes.attach_wait
// for one that is not there yet: the controller's attach has returned and
// the hot-plug is still under way in this VM (its uevent, the driver's
// probe). A NOT_FOUND at once would have the kubelet retry on its backoff
// (0.5 s, 1 s, 2 s, ...), seconds after the disk appeared. It looks again
// as soon as the uevent watcher has decided about a disk, and every
// attachPoll in any case (the watcher may be off, or decide before the
// disk is ready).
func (m *Manager) locateAttaching(ctx context.Context, loc Locator) (*Device, error) {
	deadline := time.Now().Add(m.o.Config.AttachWait)
	if loc.BackingFile != "" {
		deadline = time.Now() // a loop device is attached by hand, not hot-plugged
	}
	for {
		// Taken before the look, so that a disk decided about between
		// the look and the wait wakes it.
		seen := m.diskSeen()
		dev, err := m.locate(ctx, loc)
		if agenterr.KindOf(err) != agenterr.NotFound || !time.Now().Before(deadline) {
			return dev, err
		}
		t := time.NewTimer(m.attachPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-seen:
			t.Stop()
		case <-t.C:
		}
	}
}

// attachPoll is how often a stage waiting for its disk looks again when
// no uevent wakes it.
const attachPoll = 100 * time.Millisecond

// diskSeen is closed the next time the watcher has decided about a disk.
func (m *Manager) diskSeen() <-chan struct{} {
	m.seenMu.Lock()
	defer m.seenMu.Unlock()
	if m.seen == nil {
		m.seen = make(chan struct{})
	}
	return m.seen
}

// sawDisk wakes the stages waiting for a disk (diskSeen).
func (m *Manager) sawDisk() {
	m.seenMu.Lock()
	defer m.seenMu.Unlock()
	if m.seen != nil {
		close(m.seen)
		m.seen = nil
	}
}

// stagedAt names another volume whose claim records the staging path
// (the kubelet gives each volume its own): a stage there would take that
// volume's mount for its own, and its rollback or unstage would take it
// down.
func (m *Manager) stagedAt(staging, volume string) string {
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume != volume && o.StagingPath == staging {
			return o.Volume
		}
	}
	return ""
}

// claimedBy names another volume whose claim, staged (lost too) or a
// stage under way or cut short, is on the disk dev: a second volume's
// stage beside one under way would take the same node's fence and its
// rollback would release it under the first; a lost claim keeps its
// mount, mappings and read-only flags until its unstage, which would take
// down what a second volume's stage reused of them. A claim whose disk
// the checks miss is on dev when it names dev's serial: its device number
// may since be another disk's, its serial is not; without a serial, its
// device number counts.
func (m *Manager) claimedBy(dev *Device, volume string) string {
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume == volume {
			continue
		}
		if o.DevNum == dev.DevNum() && (!o.Missing || o.Serial == "") {
			return o.Volume
		}
		if o.Missing && o.Serial != "" && o.Serial == dev.Serial {
			return o.Volume
		}
	}
	return ""
}

// unrecord undoes the claim's record: a first attempt that wrote nothing
// on the disk is forgotten; any other is recorded as interrupted.
func (s *staging) unrecord() {
	m, c := s.m, s.c
	if !s.kept && c.State == StateUnfenced && c.Device != "" {
		// No fence, so no release guard made the proof: an unmount or
		// a close of the rollback that failed leaves the volume in use,
		// and the record must say so.
		if err := m.host.InUse(usageOf(c, c.Device)); err != nil {
			c.Phase = PhaseStaged
			c.Detail = fmt.Sprintf("its stage failed and something of it is left on this node: %v", err)
			if perr := m.store.Put(c); perr != nil {
				m.log.Error("could not record the volume left in use by its failed stage", "volume", c.Volume, "err", perr)
			}
			return
		}
	}
	if s.kept {
		c.Phase = PhaseStaged
		c.Detail = "its stage failed and its fence was kept: something of the volume is still in use on this node"
		if err := m.store.Put(c); err != nil {
			m.log.Error("could not record the volume whose fence was kept", "volume", c.Volume, "err", err)
		}
		return
	}
	if s.forgotten() {
		if err := m.store.Delete(c.Volume); err != nil {
			m.log.Error("could not remove the claim record of a failed stage", "volume", c.Volume, "err", err)
		}
		return
	}
	c.Phase = PhaseInterrupted
	if err := m.store.Put(c); err != nil {
		m.log.Error("could not record the interrupted stage", "volume", c.Volume, "err", err)
	}
}

// forgotten reports whether a failed stage leaves no record: it is the
// volume's first, and it made or began no filesystem, wrote or began no
// LUKS2 header and wrote no fencing metadata.
func (s *staging) forgotten() bool {
	c := s.c
	return s.isNew && !s.kept && !s.releaseFailed && !c.Formatted && c.Formatting == nil && !c.LUKSFormatted && !c.LUKSFormatting && !c.FenceFormatted
}

// fence chooses how the disk is fenced and takes the fence (P1-P3,
// docs/fencing.md), or refuses the disk. The claim then goes live: the
// periodic check watches its fence.
func (s *staging) fence(ctx context.Context) error {
	m, c, dev := s.m, s.c, s.dev
	if err := s.timed("choose", func() error { return s.chooseFence(ctx) }); err != nil {
		return err
	}
	if s.choice.Fencer == nil {
		if err := s.unfenced(); err != nil {
			return err
		}
	} else if err := s.takeFence(ctx); err != nil {
		return err
	}
	// A refusal earlier may have left the device read-only; it is ours now.
	if ro, rerr := m.host.ReadOnly(dev); rerr == nil && ro && !s.r.ReadOnly {
		if err := m.host.SetReadOnly(dev, false); err != nil {
			return fmt.Errorf("volume %s: %w", c.Volume, err)
		}
		m.log.Info("cleared the read-only flag of a disk now claimed by this node", "volume", c.Volume, "device", dev.Path)
	}
	m.setLive(c.Volume, &live{dev: dev, fencer: s.choice.Fencer})
	s.live = true
	return nil
}

// chooseFence asks the fencer factory how the disk is fenced; a disk that
// carries the lease area is staged past it whatever fences it
// (leaseDataRule).
func (s *staging) chooseFence(ctx context.Context) error {
	m, c, dev := s.m, s.c, s.dev
	choice, err := m.o.Fencers.Choose(ctx, dev, c.Volume, m.onLost(c.Volume))
	if err != nil {
		// A refusal the factory classified keeps its kind; anything
		// else is for the kubelet to retry.
		kind := agenterr.Unavailable
		var classified *agenterr.Error
		if errors.As(err, &classified) {
			kind = classified.Kind
		}
		return agenterr.New(kind, "volume %s: choosing how to fence %s: %v", c.Volume, dev.Path, err)
	}
	if err := m.leaseDataRule(ctx, dev, c.Volume, &choice); err != nil {
		closeChoice(choice)
		return err
	}
	s.choice = choice
	s.undo.push(func() {
		// What the fencer holds open (the lease's descriptor) is the
		// live claim's to close once it went live, the stage's before.
		if !s.live && !s.kept {
			closeChoice(choice)
		}
	})
	return nil
}

// unfenced admits a disk that offers no fencing only with the explicit
// opt-in of both the request and the agent's configuration.
func (s *staging) unfenced() error {
	m, c, dev := s.m, s.c, s.dev
	if !s.r.AllowUnfenced || !m.o.Config.AllowUnfenced {
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: disk %s offers no fencing: %s; such a disk is staged only with an explicit opt-in (the request's allow_unfenced and the agent's volumes.allow_unfenced)",
			c.Volume, dev.Path, s.choice.Reason)
	}
	m.log.Warn("staging a volume WITHOUT fencing by explicit opt-in: nothing stops another node from writing this disk",
		"volume", c.Volume, "device", dev.Path, "reason", s.choice.Reason)
	c.Method, c.State, c.Key = fence.MethodNone, StateUnfenced, 0
	return nil
}

// takeFence claims the disk with the chosen fencer, writing the method's
// metadata on a blank disk first; a disk held by another node is refused
// (P2), one held by a node the request's grant names is taken over (P3).
func (s *staging) takeFence(ctx context.Context) error {
	m, c, dev, choice := s.m, s.c, s.dev, s.choice
	if err := s.writableForLease(ctx); err != nil {
		return err
	}
	if err := s.timed("prepare", func() error { return s.prepareFence(ctx) }); err != nil {
		return err
	}
	var claim fence.Acquired
	err := s.timed("acquire", func() (err error) {
		claim, err = m.acquire(ctx, choice.Fencer, c.Volume, dev, s.r.Grant, s.r.NeverPublished)
		return err
	})
	if err != nil {
		if !errors.As(err, new(*fence.HeldError)) && !errors.As(err, new(*fence.LostError)) {
			// The acquire's outcome is not known (an error, a timeout, an
			// answer lost after the claim landed): whatever it took is
			// given back, through the release guard, as a rollback's
			// release.
			s.undo.push(func() { s.releaseAcquired(context.WithoutCancel(ctx)) })
		}
		return s.notAcquired(ctx, err)
	}
	s.acquired = true
	s.undo.push(func() { s.releaseAcquired(context.WithoutCancel(ctx)) })
	c.Method, c.State, c.Key = choice.Method, StateHeld, claim.Key
	if len(claim.Preempted) > 0 {
		s.announceTakeover(claim)
	}
	return nil
}

// releaseAcquired is the rollback's release of the fence this stage took,
// through the release guard. A fence the guard keeps goes live (if it was
// not yet) and the stage is recorded as staged (unrecord), so that the
// claim check renews it; the request's error says why.
func (s *staging) releaseAcquired(ctx context.Context) {
	m, c, dev := s.m, s.c, s.dev
	err := m.release(ctx, c, dev, s.choice.Fencer, "the rollback of a failed stage", nil)
	switch {
	case fenceKept(err):
		// Recorded as held: the claim check then renews the fence, or
		// finds it not this node's and stops the volume's I/O.
		s.kept = true
		c.Method, c.State = s.choice.Method, StateHeld
		if c.DataOffset == 0 {
			// Where the data starts, for the repair that maps it.
			c.DataOffset = s.choice.DataOffset
		}
		if !s.live {
			m.setLive(c.Volume, s.keptLive())
			s.live = true
		}
	case err != nil:
		// The fence may still be held: the claim stays recorded, as
		// held, so that the unstage or the start-up check releases it.
		s.releaseFailed = true
		c.Method, c.State = s.choice.Method, StateHeld
		m.log.Error("could not release the fence after a failed stage; the claim stays recorded for its unstage", "volume", c.Volume, "device", dev.Path, "err", err)
	}
}

// keptLive is the live entry of a fence the rollback's release guard
// kept. A fencer whose acquire answered an error never took what the disk
// may name as this node's (a lease an earlier agent process took, which
// nobody renews now): it does not go live. The claim is taken back as at
// start instead (reconcileFence: the lease resumed and renewed, or found
// lost), by the claim check or by the repeated stage, which repairs
// nothing before; until then a lease is listed as not resumed, so that
// the host watchdog is not fed for it.
func (s *staging) keptLive() *live {
	if s.acquired {
		return &live{dev: s.dev, fencer: s.choice.Fencer}
	}
	closeChoice(s.choice)
	return &live{dev: s.dev, unresumed: s.c.Method == fence.MethodLease}
}

// writableForLease clears the read-only flag a refusal earlier left on the
// disk: the lease is taken by writing this node's slot on it. Until the
// fence is taken, a failure sets the flag again.
func (s *staging) writableForLease(ctx context.Context) error {
	m, c, dev := s.m, s.c, s.dev
	if s.choice.Method != fence.MethodLease {
		return nil
	}
	if ro, rerr := m.host.ReadOnly(dev); rerr != nil || !ro {
		return nil
	}
	if err := m.host.SetReadOnly(dev, false); err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	s.undo.push(func() {
		if s.acquired {
			return
		}
		if err := m.host.SetReadOnly(dev, true); err != nil {
			m.log.Error("could not set a disk read-only again after a failed claim", "volume", c.Volume, "device", dev.Path, "err", err)
		}
	})
	return nil
}

// prepareFence writes the fencing method's metadata (the lease area) on a
// blank disk, and records that it did: from then on the disk holds what
// this agent wrote, and a failed stage is not forgotten.
func (s *staging) prepareFence(ctx context.Context) error {
	m, c, dev, choice := s.m, s.c, s.dev, s.choice
	if choice.Prepare == nil {
		return nil
	}
	wrote, err := choice.Prepare(ctx)
	if err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: preparing %s for %s fencing: %v", c.Volume, dev.Path, choice.Method, err)
	}
	if !wrote {
		return nil
	}
	c.FenceFormatted = true
	m.log.Info("wrote the fencing metadata on a blank disk", "volume", c.Volume, "device", dev.Path, "fence", choice.Method)
	return m.store.Put(c)
}

// notAcquired turns a failed acquire into the stage's answer. A disk held
// by another node is refused (refuse, P2).
func (s *staging) notAcquired(ctx context.Context, err error) error {
	c := s.c
	var held *fence.HeldError
	var lost *fence.LostError
	switch {
	case errors.As(err, &held):
		s.m.refuse(c, s.dev, held)
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, held)
	case errors.As(err, &lost):
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	case errors.Is(err, lease.ErrDamaged):
		// A retry reads the same damage: the operator must look.
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v; the disk's lease area is damaged (docs/fencing.md): nothing was written, check the disk", c.Volume, err)
	case ctx.Err() != nil:
		// The caller gave up (the reclaim wait outlasted its deadline):
		// its code says so, and its retry waits again.
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	return agenterr.New(agenterr.Unavailable, "volume %s: fencing %s: %v", c.Volume, s.dev.Path, err)
}

// announceTakeover publishes TakeoverGranted for a claim that preempted
// other holders with the controller's grant.
func (s *staging) announceTakeover(claim fence.Acquired) {
	c, dev := s.c, s.dev
	keys := make([]string, len(claim.Preempted))
	for i, k := range claim.Preempted {
		keys[i] = k.String()
	}
	s.m.publish(events.Event{Type: events.TakeoverGranted, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(claim.Preempted[0]), Reason: "takeover-granted",
		Message: fmt.Sprintf("volume %s: took disk %s over from key(s) %s with the controller's grant", c.Volume, dev.Path, strings.Join(keys, ", "))})
}

// mapDataRegion puts the volume past the metadata a fencing method keeps
// at the start of the disk (the lease area), on a mapping of the disk from
// the data offset (datamap.go).
func (s *staging) mapDataRegion(context.Context) error {
	m, c := s.m, s.c
	// A pod device the record names from before (a stage cut short, a
	// repair) is over the data mapping the record names: it goes first.
	if err := m.unmapPodRecorded(c); err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	c.DataOffset, c.DataDevice = s.choice.DataOffset, ""
	if c.DataOffset > 0 {
		p, err := m.mapData(s.dev.Path, c.DataOffset, s.r.ReadOnly)
		if err != nil {
			return fmt.Errorf("volume %s: %w", c.Volume, err)
		}
		c.DataDevice = p
		s.undo.push(s.unmapDataRegion)
	}
	return m.store.Put(c)
}

// unmapDataRegion detaches the data mapping of a stage that is forgotten,
// or whose fence the rollback is about to release: the release guard
// gives a fence up only with no mapping over its disk. A stage that stays
// recorded without having taken the fence keeps it: its retry finds it
// again (findDataMapping) and its unstage detaches it. The record stops
// naming what is detached (unmapNamed).
func (s *staging) unmapDataRegion() {
	if !s.forgotten() && !s.acquired {
		return
	}
	if err := s.m.unmapNamed(s.c); err != nil {
		s.m.log.Error("could not detach the data mapping of a failed stage", "volume", s.c.Volume, "err", err)
	}
}

// unlock opens an encrypted volume's LUKS2 header, formatting a blank
// device when the request asks to (encrypt.go), and maps it with dm-crypt
// (docs/encryption.md).
func (s *staging) unlock(ctx context.Context) error {
	m, c, r := s.m, s.c, s.r
	if !r.Encrypted {
		return nil
	}
	if m.o.Crypt == nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is encrypted, but this agent has no LUKS2 support; install an agent built with it", c.Volume)
	}
	target := c.BaseDevice()
	formatted, err := m.prepareLUKS(ctx, c, target, r)
	if err != nil {
		return err
	}
	s.formatted = formatted
	mp, err := m.o.Crypt.Open(ctx, target, mapperName(c.Volume), r.Passphrase, r.ReadOnly)
	if err != nil {
		hint := ""
		if errors.Is(err, luks2.ErrWrongPassphrase) {
			hint = "; the node plugin must unwrap the passphrase kept in the header's transit token (GetVolumeToken)"
		}
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: opening LUKS2 on %s: %w%s", c.Volume, target, err, hint)
	}
	s.undo.push(func() {
		if err := m.o.Crypt.Close(context.WithoutCancel(ctx), mapperName(c.Volume)); err != nil {
			// Still open: the record keeps naming it.
			m.log.Error("could not close the dm-crypt mapping after a failed stage", "volume", c.Volume, "err", err)
			return
		}
		c.Mapper = ""
	})
	s.unlocked = mp
	if len(mp.HeaderDamage) > 0 {
		s.headerNote = fmt.Sprintf("; its LUKS2 header is damaged (%s), opened from the %s copy by %s; 'vco-agent luks repair' rewrites both copies",
			strings.Join(mp.HeaderDamage, "; "), mp.Source, mp.Reader)
		m.log.Warn("opened an encrypted volume whose LUKS2 header is damaged", "volume", c.Volume, "device", target,
			"source", mp.Source, "reader", mp.Reader, "damage", strings.Join(mp.HeaderDamage, "; "))
	}
	c.Mapper = mp.Path
	return m.store.Put(c)
}

// mount mounts the volume's filesystem at the staging path, making one
// only on a device proven blank (mount.go); a raw block volume has none.
func (s *staging) mount(ctx context.Context) error {
	m, c := s.m, s.c
	if s.r.Block {
		return nil
	}
	made, err := m.mountFS(ctx, c, c.MountDevice())
	if err != nil {
		return err
	}
	s.undo.push(func() {
		if err := m.unmountIfMounted(c.StagingPath); err != nil {
			m.log.Error("could not unmount after a failed stage", "volume", c.Volume, "err", err)
		}
	})
	s.formatted = s.formatted || made
	if made {
		return nil
	}
	// A filesystem smaller than its device is grown to fill it (grow.go).
	return m.growMounted(c, c.MountDevice())
}

// record records the claim as staged and announces it (DiskClaimed).
func (s *staging) record(context.Context) error {
	m, c, dev := s.m, s.c, s.dev
	c.Phase, c.Detail = PhaseStaged, ""
	if err := m.store.Put(c); err != nil {
		return err
	}
	msg := fmt.Sprintf("volume %s staged on %s", c.Volume, c.MountDevice())
	if c.State == StateUnfenced {
		msg += " without fencing (explicit opt-in)"
	} else {
		msg += fmt.Sprintf(", fenced with %s key %s", c.Method, c.Key)
	}
	msg += s.headerNote
	m.markClaimed(dev.Name)
	m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(c.Key), Reason: "staged", Message: msg})
	m.log.Info("volume staged", "volume", c.Volume, "device", dev.Path, "mapped", c.Mapper, "unlocked_by", s.unlocked.Reader, "staging", c.StagingPath,
		"fs", c.FsType, "fence", c.Method, "formatted", s.formatted, "steps", strings.Join(s.took, ", "))
	return nil
}
