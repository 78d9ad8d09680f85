package loopdev

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// sysfs reads an attribute of the loop device at path.
func sysfs(t *testing.T, path, attr string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(path), attr))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func needLoop(t *testing.T) {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices")
	if _, err := os.Stat(Control); err != nil {
		t.Skipf("no loop devices here: %v", err)
	}
}

// A mapping from an offset sees the backing file from there, with what
// was written through it landing at that offset; it grows with its file
// when resized, and is gone after Detach.
func TestAttachAtAnOffsetResizeDetach(t *testing.T) {
	needLoop(t)
	img := hosttest.SparseFile(t, 8<<20)
	const off = 1 << 20
	p, err := Attach(img, off, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(p) })
	if got := sysfs(t, p, "loop/backing_file"); got != img {
		t.Fatalf("%s backs %s; want %s", p, got, img)
	}
	if got := sysfs(t, p, "loop/offset"); got != strconv.Itoa(off) {
		t.Fatalf("%s starts at byte %s of its file; want %d", p, got, off)
	}
	if got := sysfs(t, p, "size"); got != strconv.Itoa((8<<20-off)/512) {
		t.Fatalf("%s has %s sectors; want %d", p, got, (8<<20-off)/512)
	}
	if got := sysfs(t, p, "ro"); got != "0" {
		t.Fatalf("%s is read-only (%s); want writable", p, got)
	}
	dev, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dev.WriteAt([]byte("through the mapping"), 0); err != nil {
		t.Fatal(err)
	}
	if err := dev.Sync(); err != nil {
		t.Fatal(err)
	}
	dev.Close()
	b := make([]byte, len("through the mapping"))
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.ReadAt(b, off); err != nil || string(b) != "through the mapping" {
		t.Fatalf("the file at byte %d holds %q (%v); want what was written through the mapping", off, b, err)
	}
	f.Close()

	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	if err := Resize(p); err != nil {
		t.Fatal(err)
	}
	if got := sysfs(t, p, "size"); got != strconv.Itoa((16<<20-off)/512) {
		t.Fatalf("after Resize %s has %s sectors; want %d", p, got, (16<<20-off)/512)
	}

	if err := Detach(p); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(p), "loop/backing_file")); err == nil {
		t.Fatalf("%s still has a backing file after Detach", p)
	}
	if err := Detach(p); err == nil {
		t.Fatalf("a second Detach of %s succeeded; want the kernel's ENXIO", p)
	}
}

// A read-only mapping refuses writes, and two mappings of one file are
// two loop devices.
func TestAttachReadOnlyAndTwice(t *testing.T) {
	needLoop(t)
	img := hosttest.SparseFile(t, 4<<20)
	ro, err := Attach(img, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(ro) })
	rw, err := Attach(img, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(rw) })
	if ro == rw {
		t.Fatalf("two attaches gave the same loop device %s", ro)
	}
	if got := sysfs(t, ro, "ro"); got != "1" {
		t.Fatalf("%s is not read-only (ro=%s)", ro, got)
	}
	if f, err := os.OpenFile(ro, os.O_WRONLY, 0); err == nil {
		_, werr := f.WriteAt(make([]byte, 512), 0)
		f.Close()
		if werr == nil {
			t.Fatalf("a write to the read-only mapping %s succeeded", ro)
		}
	}
}

// What cannot be mapped is an error naming it, and no loop device is left
// bound to it.
func TestAttachRefusals(t *testing.T) {
	needLoop(t)
	if _, err := Attach(filepath.Join(t.TempDir(), "missing"), 0, false); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("attach of a missing file: %v; want an error naming it", err)
	}
	img := hosttest.SparseFile(t, 1<<20)
	if _, err := Attach(img, -1, false); err == nil || !strings.Contains(err.Error(), "negative") {
		t.Fatalf("attach at offset -1: %v; want a refusal", err)
	}
	if err := Detach(img); err == nil || !strings.Contains(err.Error(), img) {
		t.Fatalf("Detach of a regular file: %v; want an error naming it", err)
	}
}

// A mapping over a block device with 512-byte logical blocks passes its
// I/O to it directly: what is written to the device under the mapping is
// what the mapping reads next, with no page cache in between to drop. One
// over a regular file, or over a block device with larger logical blocks
// (whose direct requests would have to be whole blocks), is cached as
// before, and works.
func TestAttachDirectIOOverABlockDevice(t *testing.T) {
	needLoop(t)
	const off = 1 << 20
	disk, err := Attach(hosttest.SparseFile(t, 8<<20), 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(disk) })
	if d, err := DirectIO(disk); err != nil || d {
		t.Fatalf("the mapping of a regular file: direct I/O %v (%v); want the cached mapping", d, err)
	}
	m, err := Attach(disk, off, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(m) })
	if d, err := DirectIO(m); err != nil || !d {
		t.Fatalf("the mapping of %s (512-byte blocks): direct I/O %v (%v); want it", disk, d, err)
	}
	for i, what := range []string{"first", "second"} {
		buf := make([]byte, 4096)
		copy(buf, what)
		writeDirect(t, disk, buf, off)
		got := readDirect(t, m, 4096, 0)
		if string(got[:len(what)]) != what {
			t.Fatalf("write %d: the mapping reads %q at 0; want %q, written to %s at %d", i+1, got[:len(what)], what, disk, off)
		}
	}

	big, err := Attach(hosttest.SparseFile(t, 8<<20), 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(big) })
	setBlockSize(t, big, 4096)
	m4k, err := Attach(big, off, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(m4k) })
	if d, err := DirectIO(m4k); err != nil || d {
		t.Fatalf("the mapping of %s (4096-byte blocks): direct I/O %v (%v); want the cached mapping", big, d, err)
	}
	f, err := os.OpenFile(m4k, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("a sector"), 512); err != nil {
		t.Fatalf("a 512-byte write to the cached mapping of a 4096-byte-block device: %v", err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

func setBlockSize(t *testing.T, p string, n int) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_BLOCK_SIZE, n); err != nil {
		t.Skipf("this kernel does not set a loop device's block size: %v", err)
	}
}

func writeDirect(t *testing.T, p string, b []byte, off int64) {
	t.Helper()
	fd, err := unix.Open(p, unix.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	buf := aligned(len(b))
	copy(buf, b)
	if _, err := unix.Pwrite(fd, buf, off); err != nil {
		t.Fatalf("writing %s at %d: %v", p, off, err)
	}
}

func readDirect(t *testing.T, p string, n int, off int64) []byte {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	buf := aligned(n)
	if _, err := unix.Pread(fd, buf, off); err != nil {
		t.Fatalf("reading %s at %d: %v", p, off, err)
	}
	return buf
}

// aligned is a buffer of n bytes (a multiple of 4096) at a 4096-byte
// aligned address, as O_DIRECT needs.
func aligned(n int) []byte {
	raw := make([]byte, n+4096)
	skip := 4096 - int(uintptr(unsafe.Pointer(&raw[0]))%4096)
	return raw[skip%4096 : skip%4096+n]
}
