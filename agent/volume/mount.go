package volume

import (
	"context"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/internal/blank"
)

// mountFS mounts the filesystem device carries, or makes one on a device
// proven blank and mounts that; a device with anything else on it is
// refused, never formatted.
func (m *Manager) mountFS(ctx context.Context, c *Claim, device string) (bool, error) {
	if mp, err := m.mounter.IsMountPoint(c.StagingPath); err == nil && mp {
		src, err := m.mountSource(c.StagingPath)
		if err != nil {
			return false, err
		}
		if !sameDevice(src, device) {
			return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: the staging path %s already has %s mounted on it, not %s; unmount it first",
				c.Volume, c.StagingPath, src, device)
		}
		return false, nil
	}
	existing, err := filesystemOn(ctx, device)
	if err != nil {
		return false, fmt.Errorf("volume %s: reading the signatures on %s (blkid): %w", c.Volume, device, err)
	}
	var proof blank.Proof
	switch {
	case existing == "" && c.Formatted:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: this agent made a %s filesystem on the volume earlier, but %s now shows no signature; it will not format it again: check that the right disk is attached",
			c.Volume, c.FsType, device)
	case existing == "" && c.ReadOnly:
		return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s is blank and the volume is read-only; there is nothing to mount", c.Volume, device)
	case existing == "" && c.Encrypted && c.LUKSFormatted:
		// The plaintext of a LUKS2 volume this agent formatted over a
		// device it proved blank reads as noise, not zeros.
		if proof, err = proveEncrypted(ctx, c.Volume, device); err != nil {
			return false, err
		}
	case existing == "":
		if proof, err = proveBlank(ctx, c.Volume, device, "filesystem"); err != nil {
			return false, err
		}
	case existing != c.FsType:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: %s carries %q, not the requested %s filesystem; the agent neither formats over existing data nor mounts it as another type",
			c.Volume, device, existing, c.FsType)
	}
	d, err := mkdirBeneath(m.o.Config.KubeletRoot, c.StagingPath, 0o750)
	if err != nil {
		return false, fmt.Errorf("volume %s: creating the staging path: %w", c.Volume, err)
	}
	d.Close()
	opts := slices.Clone(c.MountFlags)
	if c.ReadOnly {
		opts = append(opts, "ro")
	}
	if c.FsType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A volume cloned from a snapshot carries its source's xfs UUID;
		// without nouuid the second of the two would not mount here.
		opts = append(opts, "nouuid")
	}
	opts = append(opts, "defaults")
	formatted := proof.Valid()
	if formatted {
		if err := makeFS(ctx, proof, c.FsType); err != nil {
			return false, agenterr.New(agenterr.Internal, "volume %s: %v", c.Volume, err)
		}
		c.Formatted = true
		m.log.Info("made a filesystem on a device proven blank", "volume", c.Volume, "device", device, "fs", c.FsType)
	} else if !c.ReadOnly {
		if err := m.fsck(ctx, c.Volume, device); err != nil {
			return false, err
		}
	}
	if err := m.mounter.Mount(device, c.StagingPath, c.FsType, opts); err != nil {
		return formatted, agenterr.New(agenterr.Internal, "volume %s: mounting %s at %s: %v", c.Volume, device, c.StagingPath, err)
	}
	return formatted, nil
}

func (m *Manager) mountSource(p string) (string, error) {
	mps, err := m.mounter.List()
	if err != nil {
		return "", fmt.Errorf("reading the mount table: %w", err)
	}
	src := ""
	for _, mp := range mps {
		if mp.Path == p {
			src = mp.Device // the last one is on top
		}
	}
	return src, nil
}

func sameDevice(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return a == b
	}
	return sa.Rdev == sb.Rdev
}

// unmountIfMounted unmounts the mount at p, reached beneath the kubelet
// root without following a symlink (unmountBeneath).
func (m *Manager) unmountIfMounted(p string) error {
	if _, err := unmountBeneath(m.o.Config.KubeletRoot, p, 0); err != nil {
		if agenterr.KindOf(err) != agenterr.Internal {
			return err
		}
		return agenterr.New(agenterr.FailedPrecondition, "%v; is something still using it?", err)
	}
	return nil
}
