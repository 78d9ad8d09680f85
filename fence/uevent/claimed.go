package uevent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ClaimedDir is where the agent marks the disks it has claimed. The udev
// rules (packaging/udev/60-vco-agent.rules) hide a data disk from systemd
// and udisks until a file named after its kernel name exists here; /run
// is empty after a reboot, so every disk starts hidden again.
const ClaimedDir = "/run/vco-agent/claimed"

func markerPath(dir, kernelName string) (string, error) {
	if kernelName == "" || strings.ContainsAny(kernelName, "/\x00") || kernelName == "." || kernelName == ".." {
		return "", fmt.Errorf("%q is not a kernel device name", kernelName)
	}
	return filepath.Join(dir, kernelName), nil
}

// MarkClaimed records that the disk kernelName ("vdb") is claimed by this
// node. Follow it with Trigger(..., "change") so udev applies it.
func MarkClaimed(dir, kernelName string) error {
	p, err := markerPath(dir, kernelName)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("marking %s claimed: %w", kernelName, err)
	}
	// The mark is created without following a symlink planted in its
	// place (O_NOFOLLOW: ELOOP) nor blocking on a FIFO (O_NONBLOCK); the
	// agent runs as root, and a followed link would create or open a
	// file anywhere on the host.
	fd, err := unix.Open(p, unix.O_CREAT|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0o644)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return fmt.Errorf("marking %s claimed: %s is a symlink, which the agent does not follow; remove it", kernelName, p)
		}
		return fmt.Errorf("marking %s claimed: %s: %w", kernelName, p, err)
	}
	return unix.Close(fd)
}

// ClearClaimed removes the mark (on release, refusal, loss or removal).
func ClearClaimed(dir, kernelName string) error {
	p, err := markerPath(dir, kernelName)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("clearing the claim mark of %s: %w", kernelName, err)
	}
	return nil
}

// Trigger makes the kernel send the uevent action ("change") for the
// device at devpath (an Event's DevPath, under sysfsRoot), the way
// `udevadm trigger` does: udev runs its rules again, and the Watcher sees
// it too.
func Trigger(sysfsRoot, devpath, action string) error {
	switch action {
	case "add", "change", "remove", "online", "offline", "move", "bind", "unbind":
	default:
		return fmt.Errorf("uevent action %q is not one the kernel accepts", action)
	}
	clean := filepath.Clean("/" + devpath)
	if clean != devpath || !strings.HasPrefix(clean, "/devices/") {
		return fmt.Errorf("device path %q is not under /devices", devpath)
	}
	p := filepath.Join(sysfsRoot, clean, "uevent")
	if err := os.WriteFile(p, []byte(action), 0); err != nil {
		return fmt.Errorf("triggering %s on %s: %w", action, devpath, err)
	}
	return nil
}
