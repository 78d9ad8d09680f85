package inuse

// Directed reproductions, twenty-first adversarial round, of the release
// guard's proof over the disk (Disk), on this host's loop devices (root,
// else skipped).

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// A loop device over the disk whose backing path, as sysfs shows it, no
// longer names the disk in the agent's mount namespace. The kubelet's
// loop device over a published raw block volume is attached over a file
// its plugin directory has the device node bind-mounted on; when that
// bind mount is taken down lazily (umount -l, MNT_DETACH) while the loop
// device stays, the kernel spells the backing file's path from the
// detached mount's root: sysfs shows "/" (a directory), with no
// "(deleted)". A bind mount made in another mount namespace (the
// kubelet's, with no propagation to the agent's) shows the path of that
// namespace, which in the agent's names the plain file beneath it; a
// device node hidden under another mount is the same. Disk takes the
// path as the truth: one that stats to no block device is "a regular
// file's" and skipped, so a loop device that still writes the whole
// disk is not seen, the proof says nothing of the volume is in use, and
// the release guard (and lease release/clear) gives the fence up under a
// writable mapping of this node (P1). The kernel says what a loop device
// maps whatever its path (LOOP_GET_STATUS64's lo_rdevice). Control: the
// same loop device with the bind mount in place is found.
func TestAdv21ReleaseGuardMissesALoopOverTheDiskWhoseBackingPathNamesSomethingElse(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	dir := t.TempDir()
	disk, img, _ := unusedLoopDisk(t)

	for _, c := range []struct {
		name string
		// hide makes the backing path (the file the disk is bound on)
		// name something else than the disk, leaving the loop device.
		hide func(t *testing.T, file string)
	}{
		{"bind mount detached lazily", func(t *testing.T, file string) {
			if err := unix.Unmount(file, unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
		}},
		{"a plain file mounted over it", func(t *testing.T, file string) {
			plain := filepath.Join(dir, "plain")
			if err := os.WriteFile(plain, []byte("not a device\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount(plain, file, "", unix.MS_BIND, ""); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_ = unix.Unmount(file, unix.MNT_DETACH)
				_ = unix.Unmount(file, unix.MNT_DETACH)
			})
		}},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "-"), func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "pod-uid")
			if err := os.WriteFile(file, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount(disk, file, "", unix.MS_BIND, ""); err != nil {
				t.Skipf("cannot bind-mount %s: %v", disk, err)
			}
			over, err := loopdev.Attach(file, 0, false)
			if err != nil {
				_ = unix.Unmount(file, unix.MNT_DETACH)
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = loopdev.Detach(over) })
			if err := Disk("/sys", disk); !errors.As(err, new(*Error)) {
				_ = unix.Unmount(file, unix.MNT_DETACH)
				t.Fatalf("control: %s over %s (the disk %s bound there): Disk = %v, want an in-use error", over, file, disk, err)
			}
			c.hide(t, file)
			back, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(over), "loop", "backing_file"))
			// Still the disk's: a write through it lands on the disk.
			mark := []byte("written through a loop device whose path names no disk")
			f, err := os.OpenFile(over, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			_, err = f.WriteAt(append(mark, make([]byte, 4096-len(mark))...), 2<<20)
			if err == nil {
				err = f.Sync()
			}
			f.Close()
			got := make([]byte, len(mark))
			if d, oerr := os.Open(img); oerr == nil {
				_, _ = d.ReadAt(got, 2<<20)
				d.Close()
			}
			if err != nil || string(got) != string(mark) {
				t.Fatalf("control: the write through %s did not reach the disk's image (%v)", over, err)
			}
			if err := Disk("/sys", disk); !errors.As(err, new(*Error)) {
				t.Fatalf("%s still maps the whole disk %s (the write above landed on it); sysfs names its backing file %q; Disk = %v: the proof says nothing uses the disk, and the release guard gives its fence up under a writable mapping of this node",
					over, disk, strings.TrimSpace(string(back)), err)
			}
		})
	}
}

// A process of this host holds the disk open for writing: an operator's
// dd or backup tool, a host daemon that opened the raw block volume's
// node, a container's process that outlived its pod's unpublish. Nothing
// of it shows in sysfs (no loop device, no holder) or in mountinfo, and
// an open without O_EXCL does not stop the kernel's exclusive open, so
// Disk says nothing of the volume is in use: on a disk with no mapping
// below (a volume fenced by a SCSI-3 reservation, whose pod is given the
// disk's own node) the release guard gives the reservation up, and
// `lease clear` the lease area, while that process can still write the
// disk (P1: shown below, its write lands after the proof). The kernel
// names every open file of every process (/proc/PID/fd). Control: the
// disk with no opener is proven unused; one open only for reading writes
// nothing, and is not the question here.
func TestAdv21ReleaseGuardMissesAProcessThatHoldsTheDiskOpenForWriting(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices", "sh")
	disk, _, _ := unusedLoopDisk(t)
	const mark = "written by a process that held the disk open"
	cmd := exec.Command("sh", "-c", `exec 3<>"$1"; echo held; read x; printf '%s' "$2" >&3; echo written`, "sh", disk, mark)
	in, out := startHelper(t, cmd)
	proof := proofBeforeWrite(t, disk, in, out, "held", mark)
	if !errors.As(proof, new(*Error)) {
		t.Fatalf("process %d held %s open for writing (its write landed after the proof), and Disk = %v: the proof says nothing uses the disk, and the release guard gives its fence up under a live writer of this node",
			cmd.Process.Pid, disk, proof)
	}
}

// adv21Mapper, set in the environment, makes this test binary the
// process of TestAdv21ReleaseGuardMissesAProcessThatMapsTheDiskShared:
// it maps the first page of the disk it names shared and writable,
// closes its descriptor, says so, and writes the page when told.
const adv21Mapper = "INUSE_ADV21_MAPPER"

func TestAdv21MapperProcess(t *testing.T) {
	disk := os.Getenv(adv21Mapper)
	if disk == "" {
		t.Skip("the helper process of TestAdv21ReleaseGuardMissesAProcessThatMapsTheDiskShared")
	}
	fd, err := unix.Open(disk, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	page, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Close(fd); err != nil {
		t.Fatal(err)
	}
	fmt.Println("mapped")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	copy(page, "written through a shared mapping of the disk")
	if err := unix.Msync(page, unix.MS_SYNC); err != nil {
		t.Fatal(err)
	}
	fmt.Println("written")
}

// A process of this host maps the disk shared and writable and closed
// its descriptor after (a database or a tool that maps a raw block
// device): no descriptor names the disk in /proc/PID/fd, nothing shows
// in sysfs or mountinfo, and the exclusive open succeeds, so Disk says
// nothing of the volume is in use while the process can still write the
// disk through its mapping (P1: shown below, its write lands after the
// proof). The kernel lists a process's mapped files (/proc/PID/maps,
// /proc/PID/map_files). Control: the disk with no mapper is proven
// unused.
func TestAdv21ReleaseGuardMissesAProcessThatMapsTheDiskShared(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	disk, _, _ := unusedLoopDisk(t)
	cmd := exec.Command(os.Args[0], "-test.run", "^TestAdv21MapperProcess$")
	cmd.Env = append(os.Environ(), adv21Mapper+"="+disk)
	in, out := startHelper(t, cmd)
	proof := proofBeforeWrite(t, disk, in, out, "mapped", "written through a shared mapping of the disk")
	if !errors.As(proof, new(*Error)) {
		t.Fatalf("process %d mapped %s shared and writable (its write landed after the proof), and Disk = %v: the proof says nothing uses the disk, and the release guard gives its fence up under a live writer of this node",
			cmd.Process.Pid, disk, proof)
	}
}
