package inuse

// Directed reproductions, twentieth adversarial round, of the release
// guard's proof over the disk (Disk). Same harness as adv19_test.go: a
// block device node made with mknod (root, else skipped) and a fake sysfs
// laid out as the kernel's, device numbers in the experimental range.

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// A disk whose device node is not named as its sysfs directory: the
// kernel names some disks with a '/' (AoE's "etherd/e0.0", sx8's "sx8/0",
// cciss's "cciss/c0d0"), which sysfs spells with a '!' ("etherd!e0.0")
// and whose node is /dev/etherd/e0.0; the agent's discovery names such a
// disk by its uevent DEVNAME (fence/discovery devName), so dev.Path, the
// claim's Device, and the path an operator gives `vco-agent lease clear`
// are /dev/etherd/e0.0. Disk takes the node's base name ("e0.0") for the
// sysfs name: class/block/e0.0 does not exist, which it reads as "no
// partitions" and "no holders", so a dm-crypt, md or lvm device stacked
// on the disk (or anything on its partitions) is not seen, and the proof
// says nothing of the volume is in use (P1: the fence is given up, or the
// lease area cleared, under a live mapping of this node). Control: the
// same disk, its node named as sysfs names it, is found in use.
func TestAdv20ReleaseGuardMissesAHolderOfADiskWhoseNodeIsNotItsSysfsName(t *testing.T) {
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")
	const kname = "etherd!e0.0"
	unmounted(t, "242:48")
	d := fakeDisk(t, sys, kname)
	if err := os.WriteFile(filepath.Join(d, "dev"), []byte("242:48\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "uevent"), []byte("MAJOR=242\nMINOR=48\nDEVNAME=etherd/e0.0\nDEVTYPE=disk\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(d, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Control: the node named as sysfs names the disk.
	same := blockNode(t, dir, kname, 242, 48)
	if err := Disk(sys, same); !errors.As(err, new(*Error)) {
		t.Fatalf("control: dm-3 stacked on %s: Disk = %v, want an in-use error", same, err)
	}
	// The node as the kernel's DEVNAME (and so discovery) names it.
	if err := os.Mkdir(filepath.Join(dir, "etherd"), 0o755); err != nil {
		t.Fatal(err)
	}
	node := blockNode(t, filepath.Join(dir, "etherd"), "e0.0", 242, 48)
	if err := Disk(sys, node); !errors.As(err, new(*Error)) {
		t.Fatalf("dm-3 is stacked on the disk 242:48, and Disk(%s) proved it unused (err %v): it looked for class/block/%s, not the disk's sysfs directory %s; the release guard gives the fence up under a live mapping",
			node, err, filepath.Base(node), kname)
	}
}

// A loop device that maps the disk through a device node that was
// removed since: the kubelet's loop device over a raw block volume is
// attached over a file in its plugin directory that the device node is
// bind-mounted on (not /dev/NAME), and when its detach fails at the
// unpublish while the file goes, it stays bound; an operator's loop over
// a node made with mknod, removed after, is the same. sysfs shows its
// backing file as "PATH (deleted)", and Disk skips every loop device whose
// backing path no longer stats to a block device, taking it for a loop
// over a disk that left. Only a devtmpfs node goes with its disk: this
// loop device still holds the disk open and still writes it (shown
// below), yet the proof says nothing of the volume is in use and the
// release guard (and lease release/clear) gives the fence up under a
// writable mapping of this node (P1). The kernel says which device a loop
// device is over (LOOP_GET_STATUS64's lo_rdevice), whatever its path.
// Control: with the node still there, the same loop device is found.
func TestAdv20ReleaseGuardMissesALoopOverTheDiskWhoseBackingNodeWasRemoved(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	dir := t.TempDir()
	disk, img, st := unusedLoopDisk(t)
	// Another name of the disk, as the kubelet's plugin directory has it.
	node := filepath.Join(dir, "pod-uid")
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		t.Skipf("mknod: %v", err)
	}
	over, err := loopdev.Attach(node, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = loopdev.Detach(over) })
	if err := Disk("/sys", disk); !errors.As(err, new(*Error)) {
		t.Fatalf("control: %s over %s (the disk %s): Disk = %v, want an in-use error", over, node, disk, err)
	}
	if err := os.Remove(node); err != nil {
		t.Fatal(err)
	}
	// Still the disk's: a write through it lands on the disk.
	mark := []byte("written through the loop device after its node went")
	f, err := os.OpenFile(over, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(append(mark, make([]byte, 4096-len(mark))...), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	got := make([]byte, len(mark))
	d, err := os.OpenFile(img, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.ReadAt(got, 1<<20)
	d.Close()
	if err != nil || !bytes.Equal(got, mark) {
		t.Fatalf("control: the write through %s did not reach the disk's image (%v)", over, err)
	}
	if err := Disk("/sys", disk); !errors.As(err, new(*Error)) {
		t.Fatalf("%s still maps the disk %s (the write above landed on it), its backing node %s removed; Disk = %v: the proof says nothing uses the disk, and the release guard gives its fence up under a writable mapping of this node",
			over, disk, node, err)
	}
}

// The volume's filesystem is still mounted in another mount namespace of
// this host: a pod or node daemon whose hostPath of the kubelet directory
// has no mount propagation (Kubernetes' default, None) took a copy of the
// staging mount when it started, and the agent's unmount in its own
// namespace does not reach that copy; systemd services with a private
// mount namespace started while the volume was staged are the same. The
// filesystem stays live over the disk (its superblock holds the disk
// exclusively; its dirty pages are written back to it, its journal
// committed), yet Disk reads only /proc/self/mountinfo: on a disk with no
// mapping below the filesystem (a volume fenced by a SCSI-3 reservation,
// not encrypted) the proof says nothing of the volume is in use and the
// release guard gives the reservation up, so the node that takes the disk
// next mounts it while this node still writes it (P1). The kernel tells
// it: the disk cannot be opened O_EXCL while anything, in any
// namespace, has it mounted. Control: the same mount in Disk's own
// namespace is found, and the disk cannot be opened O_EXCL.
func TestAdv20ReleaseGuardMissesAMountOfTheDiskInAnotherMountNamespace(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices, mkfs and mounts", "unshare", "mount", "mkfs.ext4")
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, make([]byte, 32<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	disk, err := loopdev.Attach(img, 0, false)
	if err != nil {
		t.Skipf("cannot attach a loop device: %v", err)
	}
	t.Cleanup(func() { _ = loopdev.Detach(disk) })
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", disk).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	// Control: mounted in this namespace, it is found.
	if err := unix.Mount(disk, mnt, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	cerr := Disk("/sys", disk)
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	if !errors.As(cerr, new(*Error)) {
		t.Fatalf("control: %s mounted at %s: Disk = %v, want an in-use error", disk, mnt, cerr)
	}
	if err := Disk("/sys", disk); err != nil {
		t.Fatalf("control: nothing uses %s: %v", disk, err)
	}

	// Mounted in another mount namespace, held by a process there.
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount -t ext4 "$1" "$2" && echo mounted && exec sleep 120`, "sh", disk, mnt)
	_, out := startHelper(t, cmd)
	line := make([]byte, 8)
	if n, err := out.Read(line); err != nil || string(line[:n]) != "mounted\n" {
		t.Skipf("could not mount %s in another mount namespace: %q %v", disk, line[:n], err)
	}
	// The filesystem holds the disk: no O_EXCL open of it succeeds.
	if fd, err := unix.Open(disk, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0); err == nil {
		unix.Close(fd)
		t.Fatalf("control: %s opened O_EXCL while its filesystem is mounted in another namespace", disk)
	}
	if err := Disk("/sys", disk); !errors.As(err, new(*Error)) {
		t.Fatalf("%s has its ext4 filesystem mounted in another mount namespace of this host (the disk cannot be opened O_EXCL), and Disk = %v: the proof says nothing uses it, and the release guard gives its reservation up under a live filesystem of this node",
			disk, err)
	}
}
