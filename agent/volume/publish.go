package volume

// NodePublish and NodeUnpublish: a staged volume bound into a pod's
// target, only while its disk is verified and its fence held, and taken
// out again.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

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
	if err := m.stillOurs(ctx, c, "publish"); err != nil {
		return err
	}
	if err := m.sourceIntact(c); err != nil {
		return err
	}
	mp, _ := m.host.IsMountPoint(target)
	if mp {
		if err := m.publishedAlready(c, target, r.ReadOnly); err != nil {
			return err
		}
	}
	if other := m.publishedAt(target, r.Volume); other != "" {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: the target %s is recorded as volume %s's publication; refused, nothing touched: unpublish volume %s from it first", r.Volume, target, other, other)
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

// sourceIntact refuses to publish a staged volume from what is not its
// device as its claim names it now: a raw block volume whose dm-crypt
// mapping, data mapping or pod device is gone (bound as it is, the pod
// would get the ciphertext disk, the disk with its lease area, or a data
// mapping it could move over the lease area), or a staging mount left on a
// device that is gone (stagingHolds).
func (m *Manager) sourceIntact(c *Claim) error {
	if !c.Block {
		return m.stagingHolds(c)
	}
	if !m.blockIntact(c) {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is staged, but its device is not whole (its dm-crypt mapping, data mapping or pod device is gone): stage it again first", c.Volume)
	}
	return nil
}

// publishedAt names another volume whose claim records target as one of
// its publications: that volume's unpublish unmounts what is there, so a
// publication of this volume there would be taken down by it.
func (m *Manager) publishedAt(target, volume string) string {
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume != volume && slices.Contains(o.Publications, target) {
			return o.Volume
		}
	}
	return ""
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
func (m *Manager) stillOurs(ctx context.Context, c *Claim, retry string) error {
	l := m.getLive(c.Volume)
	if l == nil || (c.State == StateHeld && l.fencer == nil) {
		return agenterr.New(agenterr.Unavailable, "volume %s is staged, but the agent has not taken its disk and fence back yet; the claim check retries every %s: retry the %s after that", c.Volume, m.o.Config.CheckInterval, retry)
	}
	return m.holdsStill(ctx, c, l, retry)
}

// holdsStill proves that the live entry l of claim c still is the disk it
// was staged on and, when fenced, still holds its fence (a loss found
// here is acted on as the claim check would); retry names what the
// caller retries.
func (m *Manager) holdsStill(ctx context.Context, c *Claim, l *live, retry string) error {
	if err := l.dev.Verify(ctx); err != nil {
		// A node that is not the disk's (or is two disks') is a state to
		// fix, said as the first stage's lookup says it; anything else
		// may pass.
		kind := agenterr.Unavailable
		if errors.Is(err, discovery.ErrIdentity) {
			kind = agenterr.FailedPrecondition
		}
		return agenterr.New(kind, "volume %s is staged, but its disk %s could not be verified as the disk it was staged on: %v; the claim check looks again, retry the %s", c.Volume, c.Device, err, retry)
	}
	if l.fencer == nil {
		return nil
	}
	if err := l.fencer.Check(ctx); err != nil {
		var lost *fence.LostError
		if errors.As(err, &lost) {
			m.lose(c, l.dev, lost)
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, lost)
		}
		return agenterr.New(agenterr.Unavailable, "volume %s: checking the fence of %s: %v; retry the %s", c.Volume, l.dev.Path, err, retry)
	}
	return nil
}

// publishedAlready accepts a target that already has the volume mounted
// on it as the publish asks, read-only or not (a retried publish), and
// refuses one with anything else: a pod that asked for the volume
// read-only is never handed a writable publication.
func (m *Manager) publishedAlready(c *Claim, target string, readOnly bool) error {
	if c.Block {
		if err := m.host.BlockTargetHolds(target, c); err != nil {
			return err
		}
	}
	mp, err := m.mountAt(target)
	if err != nil {
		return agenterr.New(agenterr.Unavailable, "volume %s: target %s is a mount point, but %v; retry the publish", c.Volume, target, err)
	}
	if !c.Block && !sameDevice(mp.Device, c.MountDevice()) {
		return agenterr.New(agenterr.AlreadyExists, "volume %s: target %s already has %s mounted on it", c.Volume, target, mp.Device)
	}
	if ro := slices.Contains(mp.Opts, "ro"); ro != readOnly {
		return agenterr.New(agenterr.AlreadyExists, "volume %s is already published at %s %s; the publish asks for it %s: unpublish it first",
			c.Volume, target, rwName(ro), rwName(readOnly))
	}
	return nil
}

func rwName(ro bool) string {
	if ro {
		return "read-only"
	}
	return "read-write"
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
	if err := unix.Stat(c.PublishDevice(), &want); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: its device %s: %v", c.Volume, c.PublishDevice(), err)
	}
	if got.Mode&unix.S_IFMT != unix.S_IFBLK || got.Rdev != want.Rdev {
		what := "something that is not a block device"
		if got.Mode&unix.S_IFMT == unix.S_IFBLK {
			what = fmt.Sprintf("block device %d:%d", unix.Major(got.Rdev), unix.Minor(got.Rdev))
		}
		return agenterr.New(agenterr.AlreadyExists, "volume %s: target %s already has %s mounted on it, not the volume's device %s (%d:%d); unpublish what is there first",
			c.Volume, target, what, c.PublishDevice(), unix.Major(want.Rdev), unix.Minor(want.Rdev))
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
		source = c.PublishDevice()
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
