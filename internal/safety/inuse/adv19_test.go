package inuse

// Directed reproductions, nineteenth adversarial round, of the release
// guard's proof over the disk (Disk). They need root to make a block
// device node (mknod) in a temporary directory, and skip cleanly without
// it; the sysfs they read is a fake tree laid out as the kernel's, and the
// device numbers they use are in the experimental range (240-254), which
// no mount of this host has.

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// blockNode makes a block device node dir/name of major:minor, or skips
// the test when it cannot (not root).
func blockNode(t *testing.T, dir, name string, major, minor uint32) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(major, minor))); err != nil {
		t.Skipf("cannot make a block device node (needs root): %v", err)
	}
	return p
}

// unmounted skips the test when the host happens to mount devnum.
func unmounted(t *testing.T, devnum string) {
	t.Helper()
	at, err := Mounted(devnum)
	if err != nil {
		t.Fatal(err)
	}
	if at != "" {
		t.Skipf("device %s is mounted on this host at %s", devnum, at)
	}
}

// fakeDisk lays out sysfs for the whole disk name: class/block/NAME a
// link to devices/virtual/block/NAME, with an empty holders directory,
// as the kernel has it.
func fakeDisk(t *testing.T, sys, name string) string {
	t.Helper()
	d := filepath.Join(sys, "devices", "virtual", "block", name)
	if err := os.MkdirAll(filepath.Join(d, "holders"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(sys, "class", "block"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "..", "devices", "virtual", "block", name), filepath.Join(sys, "class", "block", name)); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(sys, "block"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "devices", "virtual", "block", name), filepath.Join(sys, "block", name)); err != nil {
		t.Fatal(err)
	}
	return d
}

// The volume's disk carries a partition table (a raw block volume the
// pod partitioned, or a disk attached with one: the kernel scans it at
// attach), and the host stacked a device on its partition: lvm2's udev
// autoactivation of a PV found there, a dm-crypt or md of an operator. The
// kernel lists that holder under the partition
// (/sys/class/block/vdb1/holders), not under the disk, and Disk reads only
// the disk's holders: the proof says nothing of the volume is in use, and
// the release guard (and lease release/clear) gives the fence up while a
// mapping of this node can still write the disk (P1). A partition mounted
// on the host (its device number, not the disk's, in mountinfo) is missed
// the same way. Control: the same holder on the disk itself is found.
func TestAdv19ReleaseGuardMissesAHolderStackedOnAPartitionOfTheDisk(t *testing.T) {
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")
	disk := blockNode(t, dir, "vdb", 240, 16)
	unmounted(t, "240:16")
	unmounted(t, "240:17")
	d := fakeDisk(t, sys, "vdb")
	// The partition: a subdirectory of the disk's, with its own holders,
	// and its class link, as the kernel lays them out.
	part := filepath.Join(d, "vdb1")
	if err := os.MkdirAll(filepath.Join(part, "holders"), 0o755); err != nil {
		t.Fatal(err)
	}
	for f, v := range map[string]string{"partition": "1\n", "dev": "240:17\n", "start": "2048\n"} {
		if err := os.WriteFile(filepath.Join(part, f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Join("..", "..", "devices", "virtual", "block", "vdb", "vdb1"), filepath.Join(sys, "class", "block", "vdb1")); err != nil {
		t.Fatal(err)
	}
	// Control: a holder of the disk itself is found.
	if err := os.Mkdir(filepath.Join(d, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := Disk(sys, disk); !errors.As(err, new(*Error)) {
		t.Fatalf("control: dm-3 stacked on the disk: Disk = %v, want an in-use error", err)
	}
	if err := os.Remove(filepath.Join(d, "holders", "dm-3")); err != nil {
		t.Fatal(err)
	}
	if err := Disk(sys, disk); err != nil {
		t.Fatalf("control: nothing stacked: Disk = %v, want nil", err)
	}

	// dm-3 stacked on the disk's partition vdb1.
	if err := os.Mkdir(filepath.Join(part, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := Disk(sys, disk)
	var ie *Error
	if !errors.As(err, &ie) {
		t.Fatalf("dm-3 is stacked on vdb1, a partition of the volume's disk, and Disk proved the disk unused (err %v): the release guard gives its fence up under a live mapping", err)
	}
	if !strings.Contains(ie.What, "dm-3") {
		t.Errorf("the refusal does not name what holds the partition: %v", err)
	}
}

// A loop device maps the volume's disk at another offset than the lease's
// data area: the kubelet's own loop device over a published raw block
// volume's device (it attaches one, offset 0, to keep the device from
// going while a pod has it, and one it failed to detach stays), or one an
// operator attached over the disk. The kernel lists no holder for a loop
// device, and Disk looks for loop devices only at lease.DataOffset: the
// proof says the disk is unused and the fence is given up while a
// writable mapping of the whole disk is left on this node (P1). Control:
// the same loop device at the data area's offset is found.
func TestAdv19ReleaseGuardMissesALoopDeviceOverTheDiskAtAnotherOffset(t *testing.T) {
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")
	disk := blockNode(t, dir, "vdc", 241, 32)
	unmounted(t, "241:32")
	fakeDisk(t, sys, "vdc")
	loop := filepath.Join(sys, "devices", "virtual", "block", "loop9")
	if err := os.MkdirAll(filepath.Join(loop, "loop"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "devices", "virtual", "block", "loop9"), filepath.Join(sys, "block", "loop9")); err != nil {
		t.Fatal(err)
	}
	write := func(f, v string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(loop, "loop", f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("backing_file", disk+"\n")
	write("offset", "1048576\n")
	if lease.DataOffset != 1048576 {
		t.Fatalf("the lease's data offset is %d; this test lays out 1048576", lease.DataOffset)
	}
	if err := Disk(sys, disk); !errors.As(err, new(*Error)) {
		t.Fatalf("control: loop9 over the data area: Disk = %v, want an in-use error", err)
	}

	write("offset", "0\n")
	if err := Disk(sys, disk); !errors.As(err, new(*Error)) {
		t.Fatalf("loop9 maps the whole volume's disk (offset 0) and Disk proved the disk unused (err %v): the release guard gives its fence up under a writable mapping of this node", err)
	}
}

// unusedLoopDisk attaches an 8 MiB loop device over a file (detached when
// the test ends) that nothing mounts, and proves it unused first (the
// adversarial tests' control); it returns the device, its backing file
// and the device's stat.
func unusedLoopDisk(t *testing.T) (string, string, unix.Stat_t) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, make([]byte, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	disk, err := loopdev.Attach(img, 0, false)
	if err != nil {
		t.Skipf("cannot attach a loop device: %v", err)
	}
	t.Cleanup(func() { _ = loopdev.Detach(disk) })
	var st unix.Stat_t
	if err := unix.Stat(disk, &st); err != nil {
		t.Fatal(err)
	}
	unmounted(t, fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	if err := Disk("/sys", disk); err != nil {
		t.Fatalf("control: nothing uses %s: %v", disk, err)
	}
	return disk, img, st
}

// startHelper starts cmd with its stdin and stdout piped to the test, and
// kills it when the test ends.
func startHelper(t *testing.T, cmd *exec.Cmd) (io.WriteCloser, io.ReadCloser) {
	t.Helper()
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return in, out
}

// diskHead is the first n bytes of disk, zeros where it cannot be read.
func diskHead(disk string, n int) []byte {
	got := make([]byte, n)
	if d, err := os.Open(disk); err == nil {
		_, _ = d.ReadAt(got, 0)
		d.Close()
	}
	return got
}

// proofBeforeWrite waits for a helper process to say ready (its line
// "ready"), makes the proof for disk, then lets the helper write mark at
// the disk's byte 0 (it says "written") and checks, as the tests'
// control, that the write landed: what the proof said of a writer whose
// write came after it. It returns the proof.
func proofBeforeWrite(t *testing.T, disk string, in io.Writer, out io.Reader, ready, mark string) error {
	t.Helper()
	lines := bufio.NewReader(out)
	if l, err := lines.ReadString('\n'); err != nil || l != ready+"\n" {
		t.Fatalf("the helper did not say %q: %q %v", ready, l, err)
	}
	proof := Disk("/sys", disk)
	if _, err := io.WriteString(in, "go\n"); err != nil {
		t.Fatal(err)
	}
	if l, err := lines.ReadString('\n'); err != nil || l != "written\n" {
		t.Fatalf("the helper did not write: %q %v", l, err)
	}
	if got := diskHead(disk, len(mark)); string(got) != mark {
		t.Fatalf("control: the helper's write did not reach the disk: %q", got)
	}
	return proof
}
