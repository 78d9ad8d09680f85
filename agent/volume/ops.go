package volume

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
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
		return nil, m.dropLost(c)
	case c.Phase != PhaseStaged:
		return nil, m.notInUseBefore(ctx, c)
	case m.notTakenBack(c.Volume):
		// Staged by an earlier agent process, whose lease this one has
		// not taken back: a stage now would let go of what keeps the
		// host watchdog unfed for it before holding anything.
		return nil, agenterr.New(agenterr.Unavailable, "volume %s: the agent has not yet taken back the lease it held for this volume before it restarted (the claim check retries every %s); the stage can be retried after that", c.Volume, m.o.Config.CheckInterval)
	}
	return m.restaged(ctx, c, r)
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
	l := m.getLive(c.Volume)
	if err := l.dev.Verify(ctx); err != nil {
		// A node that is not the disk's (or is two disks') is a state to
		// fix, said as the first stage's lookup says it; anything else
		// may pass.
		kind := agenterr.Unavailable
		if errors.Is(err, discovery.ErrIdentity) {
			kind = agenterr.FailedPrecondition
		}
		return false, agenterr.New(kind, "volume %s is staged, but its disk %s could not be verified as the disk it was staged on: %v; the claim check looks again, retry the stage", c.Volume, c.Device, err)
	}
	if l.fencer != nil {
		if err := l.fencer.Check(ctx); err != nil {
			var lost *fence.LostError
			if errors.As(err, &lost) {
				m.lose(c, l.dev, lost)
				return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, lost)
			}
			return false, agenterr.New(agenterr.Unavailable, "volume %s: checking the fence of %s: %v", c.Volume, l.dev.Path, err)
		}
	}
	if c.Block {
		return m.blockIntact(c), nil
	}
	mp, err := m.host.IsMountPoint(c.StagingPath)
	if err != nil {
		return false, agenterr.New(agenterr.Unavailable, "volume %s is staged, but whether %s is mounted could not be read: %v; retry the stage", c.Volume, c.StagingPath, err)
	}
	return mp, nil
}

// blockIntact reports whether what a staged raw block volume's device is
// made of is still there: its dm-crypt mapping (an unstage stopped after
// closing it has taken it off the record) and its data mapping (a loop
// device over its disk; the lease always keeps its area before the data,
// also when a stage failed before recording where the data starts). Otherwise a publish would hand the pod the
// ciphertext disk, or a loop device that maps nothing.
func (m *Manager) blockIntact(c *Claim) bool {
	if c.Encrypted && (c.Mapper == "" || !m.host.MappingOpen(c.Mapper)) {
		return false
	}
	needsData := c.DataOffset > 0 || c.Method == fence.MethodLease
	if needsData && (c.DataDevice == "" || !m.host.MapsDisk(c.DataDevice, c.Device)) {
		return false
	}
	return true
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
	l := m.getLive(c.Volume)
	s := &staging{m: m, c: c, r: r, dev: l.dev, live: true,
		choice: Choice{Fencer: l.fencer, Method: c.Method, DataOffset: c.DataOffset}}
	m.log.Warn("the staging path of a staged volume is not mounted; mounting it again", "volume", c.Volume, "staging", c.StagingPath)
	return s.run(ctx, []step{{"map", s.mapDataRegion}, {"unlock", s.unlock}, {"mount", s.mount}, {"record", s.record}})
}

// dropLost undoes what is left of a lost claim so that a granted stage can
// start over: the read-only staging mount and the mapping go; the record
// keeps Formatted.
func (m *Manager) dropLost(c *Claim) error {
	if err := m.unmountIfMounted(c.StagingPath); err != nil {
		return err
	}
	if (c.Mapper != "" || c.Encrypted) && m.o.Crypt != nil {
		if err := m.o.Crypt.Close(context.Background(), m.mapperToClose(c)); err != nil {
			return fmt.Errorf("volume %s: closing the dm-crypt mapping of the lost claim: %w", c.Volume, err)
		}
		c.Mapper = ""
	}
	m.setLive(c.Volume, nil)
	c.Phase, c.State, c.Detail, c.HolderKey, c.HolderNode = PhaseInterrupted, "", "", 0, ""
	return m.store.Put(c)
}

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
// short whose disk that check could not verify: the fence it may have
// taken before its record named it is released through the release guard
// then, never forgotten with the record. It returns the claim as recorded
// after (nil: forgotten, its disk gone), or UNAVAILABLE while the disk
// still cannot be told.
func (m *Manager) takeBackCutShort(ctx context.Context, c *Claim) (*Claim, error) {
	if c.Phase == PhaseStaged || (!c.Missing && !m.unresolved(c.Volume)) {
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
	m.clearClaimed(filepath.Base(c.Device))
	msg := fmt.Sprintf("volume %s unstaged from %s and its disk %s released", c.Volume, c.StagingPath, c.Device)
	if c.State == StateLost {
		msg = fmt.Sprintf("volume %s unstaged from %s; its disk %s was lost to another holder before and stays read-only on this node", c.Volume, c.StagingPath, c.Device)
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
	for _, p := range []string{c.Mapper, c.DataDevice} {
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
	l := m.getLive(c.Volume)
	if c.State == StateHeld {
		if l == nil {
			// Not opened since start (the device went away, or reconcile
			// failed): open it now to release, if it is there.
			var err error
			if l, err = m.openToRelease(ctx, c); err != nil {
				return err
			}
		} else if l.fencer == nil {
			// Opened without its fencer (the start-up check could not
			// choose it): chosen now, the fence is released as any.
			ch, err := m.o.Fencers.Choose(ctx, l.dev, c.Volume, nil)
			if err != nil || ch.Fencer == nil {
				return agenterr.New(agenterr.Unavailable, "volume %s: the fencing of its disk %s could not be chosen to release it (%v); nothing was released, the claim stays recorded: retry the unstage", c.Volume, c.Device, err)
			}
			defer closeChoice(ch)
			l = &live{dev: l.dev, fencer: ch.Fencer}
		}
		if l != nil && l.fencer != nil {
			if err := m.releaseHeld(ctx, c, l); err != nil {
				if l != m.getLive(c.Volume) {
					// Opened here: the claim check takes the
					// fence back and renews it (checkOne).
					l.close()
				}
				return err
			}
		}
	}
	if l != nil && l != m.getLive(c.Volume) {
		l.close()
	}
	m.setLive(c.Volume, nil)
	return nil
}

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

// PublishRequest is PublishVolume's input.
type PublishRequest struct {
	Volume      string
	StagingPath string
	TargetPath  string
	Block       bool
	ReadOnly    bool
	MountFlags  []string
}

// Publish implements PublishVolume: a bind mount of the staging path (or,
// for a raw block volume, of the device node onto a file) at the target.
func (m *Manager) Publish(ctx context.Context, r PublishRequest) (err error) {
	defer m.count("publish", &err)
	staging, target, err := m.checkPublish(r)
	if err != nil {
		return err
	}
	release, err := m.locks.try(r.Volume, "publish")
	if err != nil {
		return err
	}
	defer release()
	c, err := m.store.Get(r.Volume)
	if err != nil {
		return err
	}
	if err := publishable(r, c, staging, target); err != nil {
		return err
	}
	if err := m.stillOurs(ctx, c); err != nil {
		return err
	}
	if c.Block && !m.blockIntact(c) {
		// Bound as it is, the pod would get the ciphertext disk, or the
		// disk with its lease area.
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged, but its device is not whole (its dm-crypt or data mapping is gone): stage it again first", c.Volume)
	}
	mp, _ := m.host.IsMountPoint(target)
	if mp {
		if err := m.publishedAlready(c, target); err != nil {
			return err
		}
	}
	// Recorded before the bind: a crash between the two leaves a record
	// that says more than the node, which Unpublish undoes, never a
	// publication the record does not know (which it would refuse).
	recorded := slices.Contains(c.Publications, target)
	if !recorded {
		c.Publications = append(c.Publications, target)
		if err := m.store.Put(c); err != nil {
			return err
		}
	}
	if !mp {
		if err := m.bind(r, c, staging, target); err != nil {
			// Taken back only when the target is shown not mounted: a
			// bind whose answer was lost keeps its record, for
			// Unpublish.
			if now, merr := m.host.IsMountPoint(target); !recorded && merr == nil && !now {
				c.Publications = slices.DeleteFunc(c.Publications, func(p string) bool { return p == target })
				if perr := m.store.Put(c); perr != nil {
					m.log.Error("could not take back the record of a failed publish", "volume", r.Volume, "target", target, "err", perr)
				}
			}
			return err
		}
	}
	m.log.Info("volume published", "volume", r.Volume, "target", target, "read_only", r.ReadOnly)
	return nil
}

// publishable refuses a publication of the claim c (nil: none) that the
// stage does not allow.
func publishable(r PublishRequest, c *Claim, staging, target string) error {
	switch {
	case c == nil || c.Phase != PhaseStaged:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is not staged on this node; stage it first", r.Volume)
	case c.StagingPath != staging:
		return agenterr.New(agenterr.InvalidArgument, "volume %s is staged at %s, not %s", r.Volume, c.StagingPath, staging)
	case c.Abnormal():
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %s", r.Volume, c.Detail)
	case c.Block != r.Block:
		return agenterr.New(agenterr.InvalidArgument, "volume %s is staged as a %s volume; it cannot be published as a %s volume", r.Volume, kindName(c.Block), kindName(r.Block))
	case c.ReadOnly && !r.ReadOnly:
		return agenterr.New(agenterr.InvalidArgument, "volume %s is staged read-only; it can only be published read-only", r.Volume)
	case target == staging:
		return agenterr.New(agenterr.InvalidArgument, "volume %s: the target path is the staging path", r.Volume)
	}
	return nil
}

// checkPublish refuses a request no publish could carry out, and returns
// its staging and target paths.
func (m *Manager) checkPublish(r PublishRequest) (staging, target string, err error) {
	if r.Volume == "" {
		return "", "", agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if staging, err = confine(m.o.Config.KubeletRoot, "staging path", r.StagingPath); err != nil {
		return "", "", err
	}
	if target, err = confineTarget(m.o.Config.KubeletRoot, r.TargetPath, r.Block); err != nil {
		return "", "", err
	}
	if err := checkFlags(r.Volume, r.MountFlags); err != nil {
		return "", "", err
	}
	return staging, target, nil
}

// stillOurs proves, before a publish or an expansion, that the claim's disk is still at
// the device node it was staged on (a raw block volume is bound from that
// node, which the kernel may have given another disk since) and that a
// fenced claim's fence is still this node's (an unstage whose release
// answered an error may have released it, and a raw block volume keeps
// no mount that would stop the publish): a pod is never given a disk
// that is not its volume's, or that no fence keeps (P1).
func (m *Manager) stillOurs(ctx context.Context, c *Claim) error {
	l := m.getLive(c.Volume)
	if l == nil || (c.State == StateHeld && l.fencer == nil) {
		return agenterr.New(agenterr.Unavailable, "volume %s is staged, but the agent has not taken its disk and fence back yet; the claim check retries every %s: retry the publish after that", c.Volume, m.o.Config.CheckInterval)
	}
	if err := l.dev.Verify(ctx); err != nil {
		kind := agenterr.Unavailable
		if errors.Is(err, discovery.ErrIdentity) {
			kind = agenterr.FailedPrecondition
		}
		return agenterr.New(kind, "volume %s is staged, but its disk %s could not be verified as the disk it was staged on: %v; the claim check looks again", c.Volume, c.Device, err)
	}
	if c.State != StateHeld {
		return nil
	}
	if err := l.fencer.Check(ctx); err != nil {
		var lost *fence.LostError
		if errors.As(err, &lost) {
			m.lose(c, l.dev, lost)
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, lost)
		}
		return agenterr.New(agenterr.Unavailable, "volume %s: checking the fence of %s before publishing it: %v; retry the publish", c.Volume, l.dev.Path, err)
	}
	return nil
}

// publishedAlready accepts a target that already has the volume mounted
// on it (a retried publish) and refuses one with anything else.
func (m *Manager) publishedAlready(c *Claim, target string) error {
	if c.Block {
		return m.host.BlockTargetHolds(target, c)
	}
	if src, _ := m.mountSource(target); !sameDevice(src, c.MountDevice()) {
		return agenterr.New(agenterr.AlreadyExists, "volume %s: target %s already has %s mounted on it", c.Volume, target, src)
	}
	return nil
}

// blockTargetHolds checks that the mount on a raw block volume's target
// is this volume's publication: the bind mount of its device node. The
// mount table cannot say so (such a mount's source reads as the
// filesystem /dev is, devtmpfs), so the device numbers of the target
// itself, opened beneath the kubelet root without following a symlink,
// are compared with those of the staged device. Anything else on the
// target is AlreadyExists.
func blockTargetHolds(root, target string, c *Claim) error {
	f, err := openBeneath(root, target, unix.O_PATH)
	if err != nil {
		return err
	}
	defer f.Close()
	var got, want unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &got); err != nil {
		return fmt.Errorf("volume %s: stat of the target %s: %w", c.Volume, target, err)
	}
	if err := unix.Stat(c.MountDevice(), &want); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: its device %s: %v", c.Volume, c.MountDevice(), err)
	}
	if got.Mode&unix.S_IFMT != unix.S_IFBLK || got.Rdev != want.Rdev {
		what := "something that is not a block device"
		if got.Mode&unix.S_IFMT == unix.S_IFBLK {
			what = fmt.Sprintf("block device %d:%d", unix.Major(got.Rdev), unix.Minor(got.Rdev))
		}
		return agenterr.New(agenterr.AlreadyExists, "volume %s: target %s already has %s mounted on it, not the volume's device %s (%d:%d); unpublish what is there first",
			c.Volume, target, what, c.MountDevice(), unix.Major(want.Rdev), unix.Minor(want.Rdev))
	}
	return nil
}

func kindName(block bool) string {
	if block {
		return "raw block"
	}
	return "filesystem"
}

// bind makes the publication: a bind mount of the staging path's mount
// (or, for a raw block volume, of the device node onto a file) at target
// (host.Bind; bindBeneath on the node).
func (m *Manager) bind(r PublishRequest, c *Claim, staging, target string) error {
	var opts []string
	if r.ReadOnly {
		opts = append(opts, "ro")
	}
	source := staging
	if c.Block {
		source = c.MountDevice()
	} else {
		opts = append(opts, hardened(r.MountFlags)...)
	}
	if err := m.host.Bind(source, target, c.Block, opts); err != nil {
		return fmt.Errorf("volume %s: %w", r.Volume, err)
	}
	return nil
}

// Unpublish implements UnpublishVolume: unmount the target and remove it.
//
// Only a publication of this volume is unmounted: a target the claim
// records. A target it does not record (or any, for a volume this node
// does not know) is removed only when it is an empty directory or file
// of the form the kubelet gives a pod's CSI volume (pubTargetShape), with
// nothing mounted on it, which is what a publish that never completed
// leaves; anything else is refused, saying why, and left as it is. A
// target that does not exist is unpublished (CSI: NodeUnpublishVolume is
// idempotent). Every step acts beneath the kubelet root without
// following symlinks.
func (m *Manager) Unpublish(ctx context.Context, volume, targetPath string) (err error) {
	defer m.count("unpublish", &err)
	target, c, release, err := m.lockedClaim("unpublish", volume, "target path", targetPath)
	if err != nil {
		return err
	}
	defer release()
	root := m.o.Config.KubeletRoot
	if c == nil || !slices.Contains(c.Publications, target) {
		if err := m.removeStrayTarget(volume, c != nil, target); err != nil {
			return err
		}
		m.log.Info("volume unpublished", "volume", volume, "target", target, "recorded", false)
		return nil
	}
	if _, err := m.host.Unbind(target); err != nil {
		if agenterr.KindOf(err) != agenterr.Internal {
			return fmt.Errorf("volume %s: %w", volume, err)
		}
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v; is something still using it?", volume, err)
	}
	if f, err := openBeneath(root, target, unix.O_PATH); err == nil {
		mp, _ := m.host.MountRoot(f, target)
		f.Close()
		if mp {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: %s is still a mount point after unmounting it once: another mount is stacked on the publication; unmount it by hand", volume, target)
		}
	}
	if err := removeBeneath(root, target); err != nil {
		return fmt.Errorf("volume %s: %w", volume, err)
	}
	c.Publications = slices.DeleteFunc(c.Publications, func(p string) bool { return p == target })
	if err := m.store.Put(c); err != nil {
		return err
	}
	m.log.Info("volume unpublished", "volume", volume, "target", target)
	return nil
}

// emptyDirBeneath reports whether the directory at p (beneath root) is
// empty and still the directory st was taken of.
func emptyDirBeneath(root, p string, st *unix.Stat_t) (bool, error) {
	d, err := openBeneath(root, p, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return false, err
	}
	defer d.Close()
	var dst unix.Stat_t
	names, _ := d.Readdirnames(1)
	serr := unix.Fstat(int(d.Fd()), &dst)
	return len(names) == 0 && serr == nil && dst.Dev == st.Dev && dst.Ino == st.Ino, nil
}

// removeStrayTarget removes a target the volume's claim does not record
// (see Unpublish), or says why it will not.
func (m *Manager) removeStrayTarget(volume string, known bool, target string) error {
	root := m.o.Config.KubeletRoot
	whose := fmt.Sprintf("volume %s is not published at %s on this node", volume, target)
	if !known {
		whose = fmt.Sprintf("volume %s is not staged or published on this node", volume)
	}
	// O_PATH: a device node or FIFO planted there is looked at, not opened.
	f, err := openBeneath(root, target, unix.O_PATH)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("volume %s: %w", volume, err)
	}
	defer f.Close()
	_, rel, err := relBeneath(root, target)
	if err != nil {
		return err
	}
	block, shaped := pubTargetShape(rel)
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("volume %s: %s: %w", volume, target, err)
	}
	mp, err := m.host.MountRoot(f, target)
	if err != nil {
		return fmt.Errorf("volume %s: %w", volume, err)
	}
	isDir, isFile := st.Mode&unix.S_IFMT == unix.S_IFDIR, st.Mode&unix.S_IFMT == unix.S_IFREG
	empty := isFile && st.Size == 0
	if isDir && !mp {
		if empty, err = emptyDirBeneath(root, target, &st); err != nil {
			return fmt.Errorf("volume %s: %w", volume, err)
		}
	}
	switch {
	case mp:
		return agenterr.New(agenterr.FailedPrecondition, "%s, and something else is mounted there: refused, nothing unmounted. Unpublish it with the volume id it was published with", whose)
	case !shaped:
		return agenterr.New(agenterr.FailedPrecondition, "%s, and %s is not a pod volume path of the kubelet's form: refused, nothing removed", whose, target)
	case !empty || (block && !isFile) || (!block && !isDir):
		return agenterr.New(agenterr.FailedPrecondition, "%s, and %s is not an empty %s: refused, nothing removed", whose, target, map[bool]string{true: "file", false: "directory"}[block])
	}
	return removeBeneath(root, target)
}

// removeBeneath removes the file or empty directory p through its parent
// directory's descriptor: a symlink put in p's place is removed itself,
// never followed.
func removeBeneath(root, p string) error {
	dir, err := openBeneath(root, filepath.Dir(p), unix.O_PATH|unix.O_DIRECTORY)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer dir.Close()
	name := filepath.Base(p)
	err = unix.Unlinkat(int(dir.Fd()), name, 0)
	if errors.Is(err, unix.EISDIR) {
		err = unix.Unlinkat(int(dir.Fd()), name, unix.AT_REMOVEDIR)
	}
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EEXIST):
		return agenterr.New(agenterr.FailedPrecondition, "%s is not empty after its unmount; it is left as it is: look at what was written into it", p)
	case errors.Is(err, unix.EBUSY):
		return agenterr.New(agenterr.FailedPrecondition, "%s is still a mount point; it is left as it is", p)
	}
	return fmt.Errorf("removing %s: %w", p, err)
}

// volumePath checks that p is the staging path or a target of c.
func (m *Manager) volumePath(c *Claim, p string) (string, error) {
	if p == "" {
		return c.StagingPath, nil
	}
	rp, err := confine(m.o.Config.KubeletRoot, "volume path", p)
	if err != nil {
		return "", err
	}
	if rp != c.StagingPath && !slices.Contains(c.Publications, rp) {
		return "", agenterr.New(agenterr.NotFound, "volume %s is not staged or published at %s", c.Volume, p)
	}
	return rp, nil
}

// Expand implements ExpandVolume: once the disk has reached required bytes,
// grow the data mapping (lease disks), the dm-crypt mapping (encrypted
// volumes) and the filesystem, online. A raw block volume has no
// filesystem: growing its mappings is what makes the pod's device node
// see the new size, and with no mapping (an unfenced or PR-fenced disk,
// not encrypted) the call only reads the size. It returns the usable
// size: the disk less the metadata kept before the volume's data.
func (m *Manager) Expand(ctx context.Context, volume, path string, required int64) (n int64, err error) {
	defer m.count("expand", &err)
	if volume == "" {
		return 0, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if required < 0 {
		return 0, agenterr.New(agenterr.InvalidArgument, "volume %s: required size %d is negative", volume, required)
	}
	release, err := m.locks.try(volume, "expand")
	if err != nil {
		return 0, err
	}
	defer release()
	c, err := m.store.Get(volume)
	if err != nil {
		return 0, err
	}
	if c == nil || c.Phase != PhaseStaged {
		return 0, agenterr.New(agenterr.NotFound, "volume %s is not staged on this node", volume)
	}
	if _, err := m.volumePath(c, path); err != nil {
		return 0, err
	}
	if c.Abnormal() {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s", volume, c.Detail)
	}
	// Grown through the recorded device node: only while it is still the
	// volume's disk, under the volume's fence.
	if err := m.stillOurs(ctx, c); err != nil {
		return 0, err
	}
	return m.grow(ctx, c, required)
}

// grow grows the staged volume c once its disk holds required bytes, and
// returns the usable size.
func (m *Manager) grow(ctx context.Context, c *Claim, required int64) (int64, error) {
	// required_bytes is the capacity the controller granted: the disk's
	// size. The device the filesystem sits on is the disk less our
	// metadata (the lease area, the LUKS2 header), so the disk itself is
	// what must have reached that size before anything is grown.
	disk, err := m.host.Size(c.Device)
	if err != nil {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	if required > 0 && disk < required {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: disk %s holds %d bytes, less than the %d asked for; the grown disk has not reached this node yet, retry",
			c.Volume, c.Device, disk, required)
	}
	if err := m.growMappings(ctx, c, disk); err != nil {
		return 0, err
	}
	// The usable size, reported back, is what the mapping the filesystem
	// sits on now holds.
	dev := c.MountDevice()
	size, err := m.host.Size(dev)
	if err != nil {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	if !c.Block {
		if c.ReadOnly {
			return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s is staged read-only; its filesystem cannot be grown", c.Volume)
		}
		if _, err := mount.NewResizeFs(m.exec).Resize(dev, c.StagingPath); err != nil {
			return 0, agenterr.New(agenterr.Internal, "volume %s: growing the %s filesystem on %s: %v", c.Volume, c.FsType, dev, err)
		}
	}
	m.log.Info("volume expanded", "volume", c.Volume, "device", dev, "bytes", size)
	return size, nil
}

// growMappings makes the data mapping (lease disks) and then the dm-crypt
// mapping (encrypted volumes) see the grown disk of disk bytes.
func (m *Manager) growMappings(ctx context.Context, c *Claim, disk int64) error {
	if c.DataDevice != "" {
		if !m.host.MapsDisk(c.DataDevice, c.Device) {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: its recorded data mapping %s is not a loop device over its disk %s; unstage and stage the volume again to remap it",
				c.Volume, c.DataDevice, c.Device)
		}
		if err := growDataMapping(c.DataDevice); err != nil {
			return agenterr.New(agenterr.Internal, "volume %s: %v", c.Volume, err)
		}
		if n, err := m.host.Size(c.DataDevice); err != nil || n != disk-c.DataOffset {
			return agenterr.New(agenterr.Internal, "volume %s: the data mapping %s holds %d bytes after growing, not the disk's %d less the %d-byte lease area (%v); unstage and stage the volume again to remap it",
				c.Volume, c.DataDevice, n, disk, c.DataOffset, err)
		}
	}
	if c.Mapper == "" {
		return nil
	}
	if m.o.Crypt == nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is encrypted, but this agent has no LUKS2 support to grow its mapping", c.Volume)
	}
	if err := m.o.Crypt.Resize(ctx, m.mapperToClose(c)); err != nil {
		return agenterr.New(agenterr.Internal, "volume %s: growing the dm-crypt mapping: %v", c.Volume, err)
	}
	return nil
}

// Stats is GetVolumeStats's answer.
type Stats struct {
	TotalBytes, UsedBytes, AvailableBytes    int64
	TotalInodes, UsedInodes, AvailableInodes int64
	Block                                    bool
	Abnormal                                 bool
	Message                                  string
	// State is the claim's state (Claim.ListState): "lost" or "gone"
	// says why an abnormal volume is so.
	State string
}

// Stats implements GetVolumeStats. It takes no lock: it only reads.
func (m *Manager) Stats(ctx context.Context, volume, path string) (Stats, error) {
	var st Stats
	if volume == "" {
		return st, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	c, err := m.store.Get(volume)
	if err != nil {
		return st, err
	}
	if c == nil || c.Phase != PhaseStaged {
		return st, agenterr.New(agenterr.NotFound, "volume %s is not staged on this node", volume)
	}
	p, err := m.volumePath(c, path)
	if err != nil {
		return st, err
	}
	st.Block, st.State = c.Block, c.ListState()
	if c.Abnormal() {
		st.Abnormal, st.Message = true, c.Detail
	}
	if c.Block {
		n, err := m.host.Size(c.MountDevice())
		if err != nil && !st.Abnormal {
			return st, agenterr.New(agenterr.NotFound, "volume %s: %v", volume, err)
		}
		st.TotalBytes = n
		return st, nil
	}
	var s unix.Statfs_t
	if err := unix.Statfs(p, &s); err != nil {
		if st.Abnormal {
			return st, nil
		}
		return st, agenterr.New(agenterr.NotFound, "volume %s: statfs %s: %v", volume, p, err)
	}
	bs := int64(s.Bsize)
	st.TotalBytes = int64(s.Blocks) * bs
	st.AvailableBytes = int64(s.Bavail) * bs
	st.UsedBytes = (int64(s.Blocks) - int64(s.Bfree)) * bs
	st.TotalInodes = int64(s.Files)
	st.AvailableInodes = int64(s.Ffree)
	st.UsedInodes = int64(s.Files) - int64(s.Ffree)
	return st, nil
}
