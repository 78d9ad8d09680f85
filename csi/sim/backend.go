package sim

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/whitesky-cloud/vco-storage/csi/loopdisk"
)

// Backend is what a simulated disk is on this machine. The simulator calls
// it with its state lock held, after validating the request, so a backend
// sees only well-formed, serialized operations.
type Backend interface {
	CreateDisk(id, sizeGiB int64) error
	DeleteDisk(id int64) error
	ResizeDisk(id, sizeGiB int64) error
	Snapshot(diskID int64, snapID string) error
	DeleteSnapshot(snapID string) error
	// CloneSnapshot makes disk newID from a snapshot.
	CloneSnapshot(snapID string, newID int64) error
	// Attach makes disk id visible in vm at PCI bus/slot, the address the
	// API reports and the controller hands the node. A backend that shows
	// disks to real guests gives the device the serial "<disk id>" (the
	// publish context's cloud.whitesky/serial). It returns the host device
	// it made, or "" when there is none.
	Attach(vm *VMState, id int64, bus, slot int) (device string, err error)
	Detach(vm *VMState, id int64, device string) error
}

// ByteSizer is a Backend that makes a disk of any byte size, which a disk
// created in GB needs; a backend without it gets the size rounded up to
// whole GiB.
type ByteSizer interface {
	CreateDiskBytes(id, size int64) error
}

// HostBackend keeps each disk as a sparse file in Dir. Attaching a disk to
// the local VM (the one standing for this machine) makes a loop device of
// its file; attachments to other VMs are bookkeeping only.
type HostBackend struct {
	Dir string
}

// DiskFile is where the host backend keeps disk id (package loopdisk).
func (h *HostBackend) DiskFile(id int64) string { return loopdisk.File(h.Dir, id) }

func (h *HostBackend) snapFile(id string) string {
	return filepath.Join(h.Dir, "snap-"+id+".img")
}

// CreateDisk makes a sparse file of the disk's size.
func (h *HostBackend) CreateDisk(id, sizeGiB int64) error { return h.CreateDiskBytes(id, sizeGiB<<30) }

// CreateDiskBytes makes a sparse file of size bytes.
func (h *HostBackend) CreateDiskBytes(id, size int64) error {
	if err := os.MkdirAll(h.Dir, 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(h.DiskFile(id), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Truncate(size)
}

// DeleteDisk removes the disk's file.
func (h *HostBackend) DeleteDisk(id int64) error {
	if err := os.Remove(h.DiskFile(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// ResizeDisk grows the file and tells a loop device on it to pick up the
// new size.
func (h *HostBackend) ResizeDisk(id, sizeGiB int64) error {
	if err := os.Truncate(h.DiskFile(id), sizeGiB<<30); err != nil {
		return err
	}
	out, err := exec.Command("losetup", "-j", h.DiskFile(id), "-O", "NAME", "-n").Output()
	if err != nil {
		return nil // no loop device (or no losetup): nothing to refresh
	}
	for _, dev := range strings.Fields(string(out)) {
		if b, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
			return fmt.Errorf("refreshing size of %s: %s", dev, strings.TrimSpace(string(b)))
		}
	}
	return nil
}

// copySparse copies a file keeping its holes, so a snapshot of an empty
// 10 GiB disk costs nothing.
func copySparse(src, dst string) error {
	b, err := exec.Command("cp", "--sparse=always", "--reflink=auto", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("copying %s to %s: %s", src, dst, strings.TrimSpace(string(b)))
	}
	return nil
}

// Snapshot copies the disk's file.
func (h *HostBackend) Snapshot(diskID int64, snapID string) error {
	return copySparse(h.DiskFile(diskID), h.snapFile(snapID))
}

// DeleteSnapshot removes the snapshot's file.
func (h *HostBackend) DeleteSnapshot(snapID string) error {
	if err := os.Remove(h.snapFile(snapID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// CloneSnapshot copies a snapshot's file into a new disk.
func (h *HostBackend) CloneSnapshot(snapID string, newID int64) error {
	return copySparse(h.snapFile(snapID), h.DiskFile(newID))
}

// Attach makes a loop device when the VM is this machine.
func (h *HostBackend) Attach(vm *VMState, id int64, _, _ int) (string, error) {
	if !vm.Local {
		return "", nil
	}
	out, err := exec.Command("losetup", "--find", "--show", "--direct-io=off", h.DiskFile(id)).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("making a loop device for disk %d: %s", id, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out)), nil
}

// Detach removes the loop device made by Attach.
func (h *HostBackend) Detach(vm *VMState, id int64, device string) error {
	if device == "" {
		return nil
	}
	out, err := exec.Command("losetup", "-d", device).CombinedOutput()
	if err != nil {
		// Already gone (a reboot, an operator) is what we wanted.
		if _, serr := os.Stat(device); serr != nil {
			return nil
		}
		return fmt.Errorf("removing loop device %s of disk %d: %s", device, id, strings.TrimSpace(string(out)))
	}
	return nil
}

// BookkeepingBackend stores nothing: disks exist only in the simulator's
// state. It is for measuring the API path without disk I/O.
type BookkeepingBackend struct{}

func (BookkeepingBackend) CreateDisk(int64, int64) error                    { return nil }
func (BookkeepingBackend) DeleteDisk(int64) error                           { return nil }
func (BookkeepingBackend) ResizeDisk(int64, int64) error                    { return nil }
func (BookkeepingBackend) Snapshot(int64, string) error                     { return nil }
func (BookkeepingBackend) DeleteSnapshot(string) error                      { return nil }
func (BookkeepingBackend) CloneSnapshot(string, int64) error                { return nil }
func (BookkeepingBackend) Attach(*VMState, int64, int, int) (string, error) { return "", nil }
func (BookkeepingBackend) Detach(*VMState, int64, string) error             { return nil }
