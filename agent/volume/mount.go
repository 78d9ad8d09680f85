package volume

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// mounter is what the manager does with mounts: mount a filesystem at a
// staging path, unmount it, and read the mount table. beneathMounter
// (paths.go) is the manager's; the stage's rollback tests use a stand-in
// that runs without root (stage_test.go).
type mounter interface {
	// Mount mounts the filesystem on source at target.
	Mount(source, target, fstype string, options []string) error
	// Unmount unmounts the mount whose root is target; a target that is
	// not one is left alone.
	Unmount(target string) error
	IsMountPoint(file string) (bool, error)
	List() ([]mount.MountPoint, error)
}

// mountFS mounts the filesystem device carries, or makes one on a device
// proven blank and mounts that; a device with anything else on it is
// refused, never formatted. An ext4 smaller than its device that this
// agent can only grow unmounted is grown before the mount (grow.go). It
// reports whether it made the filesystem.
func (m *Manager) mountFS(ctx context.Context, c *Claim, device string) (bool, error) {
	if mp, err := m.host.IsMountPoint(c.StagingPath); err == nil && mp {
		return false, m.mountedAlready(c, device)
	}
	proof, err := m.formatProof(ctx, c, device)
	if err != nil {
		return false, err
	}
	d, err := mkdirBeneath(m.o.Config.KubeletRoot, c.StagingPath, 0o750)
	if err != nil {
		return false, fmt.Errorf("volume %s: creating the staging path: %w", c.Volume, err)
	}
	d.Close()
	formatted := proof.Valid()
	if formatted {
		if err := m.formatFS(ctx, c, proof, device); err != nil {
			return false, err
		}
	} else if !c.ReadOnly {
		if err := m.fsck(ctx, c.Volume, device); err != nil {
			return false, err
		}
		if err := m.growUnmounted(ctx, c, device); err != nil {
			return false, err
		}
	}
	if err := m.host.Mount(device, c.StagingPath, c.FsType, mountOptions(c)); err != nil {
		// The staging path was no mount point before: a mount there now
		// is this call's, landed though its answer was an error (a
		// timeout), and is taken down with the stage.
		if uerr := m.unmountIfMounted(c.StagingPath); uerr != nil {
			m.log.Error("could not unmount what a failed mount left", "volume", c.Volume, "staging", c.StagingPath, "err", uerr)
		}
		return formatted, agenterr.New(agenterr.Internal, "volume %s: mounting %s at %s: %v", c.Volume, device, c.StagingPath, err)
	}
	return formatted, nil
}

// formatFS makes the volume's filesystem on the device proof names. The
// mkfs is recorded before it runs (Formatting: where, on what, with which
// UUID), so that a retry after a crash knows what it left for its own
// (formatProof); the filesystem made is recorded (Formatted) with the
// stage's next record. A crash in between leaves a finished filesystem
// and a record saying Formatting, which the retry mounts as it is. An
// mkfs that fails having written nothing takes its record back.
func (m *Manager) formatFS(ctx context.Context, c *Claim, proof blank.Proof, device string) error {
	if err := m.host.MkfsInstalled(c.FsType, device); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	c.Formatting = &MkfsAttempt{Offset: c.DataOffset, Size: proof.Size(), UUID: uuid.NewString()}
	if err := m.store.Put(c); err != nil {
		return err
	}
	if err := m.host.MakeFS(ctx, proof, c.FsType, device == c.DataDevice, c.Formatting.UUID); err != nil {
		if _, perr := m.host.Prove(ctx, device); perr == nil {
			c.Formatting = nil
			if err := m.store.Put(c); err != nil {
				m.log.Error("could not record that an mkfs wrote nothing", "volume", c.Volume, "err", err)
			}
		}
		if agenterr.KindOf(err) == agenterr.FailedPrecondition {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
		}
		return agenterr.New(agenterr.Internal, "volume %s: %v", c.Volume, err)
	}
	c.Formatted, c.Formatting = true, nil
	m.log.Info("made a filesystem on a device proven blank", "volume", c.Volume, "device", device, "fs", c.FsType)
	return nil
}

// mountedAlready accepts a staging path that already has device mounted on
// it (a retried stage) and refuses one with anything else.
func (m *Manager) mountedAlready(c *Claim, device string) error {
	src, err := m.mountSource(c.StagingPath)
	if err != nil {
		return err
	}
	if !sameDevice(src, device) {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: the staging path %s already has %s mounted on it, not %s; unmount it first",
			c.Volume, c.StagingPath, src, device)
	}
	return nil
}

// formatProof reads what device carries (docs/architecture.md P5): the
// volume's filesystem (no proof: it is mounted as it is), nothing (the
// proof that it is blank, which the format takes), or anything else
// (refused).
//
// One blank proof answers both (blank.NotBlankError names what blkid
// found): a second `blkid -p` costs a first stage a process start.
func (m *Manager) formatProof(ctx context.Context, c *Claim, device string) (blank.Proof, error) {
	if c.Formatting != nil && !c.Formatted {
		return m.cutShortFormatProof(ctx, c, device)
	}
	proof, err := m.host.Prove(ctx, device)
	var nb *blank.NotBlankError
	existing := ""
	switch {
	case errors.As(err, &nb):
		existing = filesystemIn(nb)
	case errors.Is(err, blank.ErrProbe):
		return blank.Proof{}, agenterr.New(agenterr.Internal, "volume %s: blkid could not tell what %s holds, so it is neither formatted nor mounted: %v", c.Volume, device, err)
	case err != nil:
		return blank.Proof{}, agenterr.New(agenterr.Unavailable, "volume %s: what %s holds could not be read, so it is neither formatted nor mounted: %v", c.Volume, device, err)
	}
	switch {
	case existing == "" && c.Formatted:
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: this agent made a %s filesystem on the volume earlier, but %s now shows no signature; it will not format it again: check that the right disk is attached",
			c.Volume, c.FsType, device)
	case existing == "" && c.ReadOnly:
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s is blank and the volume is read-only; there is nothing to mount", c.Volume, device)
	case existing == "" && c.Encrypted && c.LUKSFormatted:
		// The plaintext of a LUKS2 volume this agent formatted over a
		// device it proved blank reads as noise, not zeros.
		return m.proveEncrypted(ctx, c.Volume, device)
	case existing == "" && nb != nil:
		return blank.Proof{}, notBlank(c.Volume, device, "filesystem", nb)
	case existing == "":
		return proof, nil
	case existing != c.FsType:
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: %s carries %q, not the requested %s filesystem; the agent neither formats over existing data nor mounts it as another type",
			c.Volume, device, existing, c.FsType)
	}
	return blank.Proof{}, nil
}

// cutShortFormatProof is formatProof for a device on which this agent's
// mkfs was cut short (the claim names it in Formatting). A finished
// filesystem of the volume's type is that mkfs's, finished before the
// crash (mkfs.ext4 writes its primary superblock last, mkfs.xfs clears its
// in-progress mark last): it is recorded as made and mounted as it is,
// never made again, as it may have been mounted since, here or, had the
// disk been moved, on another node. What nothing can have mounted,
// leftovers without a signature or an xfs still marked in progress with
// the mkfs's UUID, is that mkfs's own and is made again, on the device
// the mkfs ran on only (the same offset into the disk, the same size).
// Anything else is refused (blank.ProveFormatLeftovers).
func (m *Manager) cutShortFormatProof(ctx context.Context, c *Claim, device string) (blank.Proof, error) {
	a := c.Formatting
	if a.Offset != c.DataOffset {
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the %s filesystem this agent began to make from byte %d of the disk was cut short, but the volume now lies from byte %d (%s); it is not formatted: check that the right disk is attached",
			c.Volume, c.FsType, a.Offset, c.DataOffset, device)
	}
	proof, err := m.host.ProveFormatLeftovers(ctx, device, c.FsType, a.UUID)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb) && nb.Type == c.FsType && nb.PTType == "":
		m.log.Info("the filesystem this agent was making on the volume was finished before the agent stopped; mounting it", "volume", c.Volume, "device", device, "fs", c.FsType)
		c.Formatted, c.Formatting = true, nil
		return blank.Proof{}, m.store.Put(c)
	case errors.As(err, &nb):
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the %s filesystem this agent began to make on %s was cut short, but the device now holds %s, which that mkfs does not leave; it is not formatted again: check that the right disk is attached",
			c.Volume, c.FsType, device, nb.Found)
	case errors.Is(err, blank.ErrProbe):
		return blank.Proof{}, agenterr.New(agenterr.Internal, "volume %s: blkid could not tell what %s holds, so it is neither formatted nor mounted: %v", c.Volume, device, err)
	case err != nil:
		return blank.Proof{}, agenterr.New(agenterr.Unavailable, "volume %s: what %s holds could not be read, so it is neither formatted nor mounted: %v", c.Volume, device, err)
	case proof.Size() != a.Size:
		return blank.Proof{}, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the %s filesystem this agent began to make on %s was cut short, but the device is %d bytes now, %d then; it is not formatted again: check that the right disk is attached",
			c.Volume, c.FsType, device, proof.Size(), a.Size)
	}
	m.log.Warn("the filesystem this agent began to make on the volume was cut short; making it again", "volume", c.Volume, "device", device, "fs", c.FsType)
	return proof, nil
}

// mountOptions are the staging mount's options: nosuid and nodev unless
// the request's flags ask otherwise (hardened), the request's flags, ro
// for a read-only volume, nouuid for xfs.
func mountOptions(c *Claim) []string {
	opts := hardened(c.MountFlags)
	if c.ReadOnly {
		opts = append(opts, "ro")
	}
	if c.FsType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A volume cloned from a snapshot carries its source's xfs UUID;
		// without nouuid the second of the two would not mount here.
		opts = append(opts, "nouuid")
	}
	return append(opts, "defaults")
}

// hardened puts nosuid and nodev before a filesystem volume's mount
// flags, each unless the flags ask for the opposite (suid, dev): a
// volume's content is its user's, and a set-uid binary or a device node
// on it is not to be honoured on the host or in a pod that did not ask
// for it. The staging mount and every publication's bind mount take them.
func hardened(flags []string) []string {
	var opts []string
	if !slices.Contains(flags, "suid") {
		opts = append(opts, "nosuid")
	}
	if !slices.Contains(flags, "dev") {
		opts = append(opts, "nodev")
	}
	return append(opts, flags...)
}

func (m *Manager) mountSource(p string) (string, error) {
	mp, err := m.mountAt(p)
	return mp.Device, err
}

// mountAt is the mount on top at p, as the mount table lists it (a zero
// one when nothing is mounted there).
func (m *Manager) mountAt(p string) (mount.MountPoint, error) {
	mps, err := m.host.List()
	if err != nil {
		return mount.MountPoint{}, fmt.Errorf("reading the mount table: %w", err)
	}
	var top mount.MountPoint
	for _, mp := range mps {
		if mp.Path == p {
			top = mp // the last one is on top
		}
	}
	return top, nil
}

func sameDevice(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return a == b
	}
	return sa.Rdev == sb.Rdev
}

// unmountIfMounted unmounts the mount at p, reached beneath the kubelet
// root without following a symlink (beneathMounter).
func (m *Manager) unmountIfMounted(p string) error {
	if err := m.host.Unmount(p); err != nil {
		if agenterr.KindOf(err) != agenterr.Internal {
			return err
		}
		return agenterr.New(agenterr.FailedPrecondition, "%v; is something still using it?", err)
	}
	return nil
}
