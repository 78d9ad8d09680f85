package volume

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// Formatting (P5, docs/architecture.md). The agent formats a device only
// when package blank proves it blank; every format here takes the
// blank.Proof, and the manager has no other way to run mkfs (its mounter,
// mount.go, only mounts). A device that is not proven blank is mounted as
// the filesystem it carries, or refused.

// proveBlank proves device blank before a format of volume's, turning
// what was found into the refusal's sentence.
func (m *Manager) proveBlank(ctx context.Context, volume, device, what string) (blank.Proof, error) {
	p, err := m.host.Prove(ctx, device)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb):
		return p, notBlank(volume, device, what, nb)
	case err != nil:
		return p, agenterr.New(agenterr.Unavailable, "volume %s: %s was not formatted, its blankness could not be proven: %v", volume, device, err)
	}
	return p, nil
}

// notBlank refuses to format a device that holds something other than
// what was to be made on it.
func notBlank(volume, device, what string, nb *blank.NotBlankError) error {
	return agenterr.New(agenterr.FailedPrecondition,
		"volume %s: %s has no %s but is not blank: it holds %s; the agent formats only a device it proves blank: check that the right disk is attached, or wipe it by hand if its data is not wanted",
		volume, device, what, nb.Found)
}

// proveEncrypted is proveBlank for the opened mapping of a LUKS2 volume
// whose header this agent wrote (blank.ProveEncrypted).
func (m *Manager) proveEncrypted(ctx context.Context, volume, mapping string) (blank.Proof, error) {
	p, err := m.host.ProveEncrypted(ctx, mapping)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb):
		return p, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the encrypted volume this agent formatted shows no filesystem, yet %s holds %s; it is not formatted: check that the right disk is attached",
			volume, mapping, nb.Found)
	case err != nil:
		return p, agenterr.New(agenterr.Unavailable, "volume %s: %s was not formatted, what it holds could not be read: %v", volume, mapping, err)
	}
	return p, nil
}

// fsPackages name the Debian and RPM packages of the filesystems' tools.
var fsPackages = map[string]string{"ext4": "e2fsprogs", "xfs": "xfsprogs"}

// makeFS makes a filesystem of type fsType with the UUID uuid on the
// device p proved blank, with the options of mount-utils' FormatAndMount
// (ext4 with no blocks reserved for root). The UUID is the caller's, so
// that what a cut-short mkfs leaves can be told apart (mount.go).
//
// On a data mapping (a loop device over the disk past the lease area),
// mkfs does not discard the device first: the loop driver carries a
// discard to the disk as a write of zeroes over the whole range, which
// made a 1 GiB volume's first stage take 14-16 s in the lab's guests
// against under a second for mkfs on the disk itself (docs/benchmarks.md).
// The discard adds nothing there: the device is proven blank, and mkfs
// initialises what it relies on either way.
func makeFS(ctx context.Context, p blank.Proof, fsType string, onMapping bool, uuid string) error {
	if !p.Valid() || p.Simulated() || p.From() != 0 {
		return errors.New("no proof that the device is blank; no filesystem is made")
	}
	var args []string
	switch fsType {
	case "ext4":
		args = []string{"-F", "-m0", "-U", uuid}
		if onMapping {
			args = append(args, "-E", "nodiscard")
		}
	case "xfs":
		args = []string{"-f", "-m", "uuid=" + uuid}
		if onMapping {
			args = append(args, "-K")
		}
	default:
		return fmt.Errorf("filesystem type %q is not one the agent makes", fsType)
	}
	args = append(args, p.Device())
	if err := mkfsInstalled(fsType, p.Device()); err != nil {
		return err
	}
	if err := p.StillNames(); err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "mkfs."+fsType, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.%s %s: %v: %s", fsType, p.Device(), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// mkfsInstalled refuses a format of device when this node has no mkfs for
// fsType, naming the package to install.
func mkfsInstalled(fsType, device string) error {
	if _, err := exec.LookPath("mkfs." + fsType); err != nil {
		return agenterr.New(agenterr.FailedPrecondition, "mkfs.%s is not installed on this node, so no %s filesystem is made on %s: install %s (the vco-agent package recommends it), or use a class with another filesystem",
			fsType, fsType, device, fsPackages[fsType])
	}
	return nil
}

// filesystemIn is the filesystem a device holds, by what blkid named
// on it: its TYPE, "unknown data, probably partitions" for a partition
// table alone, "" for nothing blkid names.
func filesystemIn(nb *blank.NotBlankError) string {
	if nb.Type == "" && nb.PTType != "" {
		return "unknown data, probably partitions"
	}
	return nb.Type
}

// fsck checks and repairs the filesystem on device before a writable
// mount, as mount-utils' FormatAndMount did: errors fsck corrected are
// logged, errors it could not correct refuse the mount.
func (m *Manager) fsck(ctx context.Context, volume, device string) error {
	out, err := m.host.Fsck(ctx, device)
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.Is(err, exec.ErrNotFound):
		m.log.Warn("fsck is not installed; mounting without checking the filesystem", "volume", volume, "device", device)
	case errors.As(err, &ee) && ee.ExitCode() == 1:
		m.log.Info("fsck corrected errors on the filesystem", "volume", volume, "device", device)
	case errors.As(err, &ee) && ee.ExitCode() == 4:
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: fsck found errors on %s it could not correct; repair the filesystem by hand: %s",
			volume, device, strings.TrimSpace(string(out)))
	default:
		m.log.Warn("fsck failed; mounting anyway", "volume", volume, "device", device, "err", err, "output", strings.TrimSpace(string(out)))
	}
	return nil
}
