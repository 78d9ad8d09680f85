package loopdev

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

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

// A free loop device whose last user left it read-only (BLKROSET outlives
// the detach) is attached writable when asked for writable.
func TestAttachClearsAReadOnlyFlagItsLastUserLeft(t *testing.T) {
	needLoop(t)
	img := hosttest.SparseFile(t, 8<<20)
	p, err := Attach(img, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := Detach(p); err != nil {
		t.Fatal(err)
	}
	// Bound again, the same device: as Attach binds the free one it is
	// handed.
	b, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := configure(p, &unix.LoopConfig{Fd: uint32(b.Fd())}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(p) })
	if got := sysfs(t, p, "ro"); got != "0" {
		t.Fatalf("%s, read-only when its last user detached it, is read-only (%s) when bound writable", p, got)
	}
}

// A loop device over another one from its byte 0, with direct I/O, is
// named to the caller before it is bound (the name it returns), reads and
// writes through the one below, and a Naming that fails leaves nothing
// bound.
func TestAttachWithOverALoopDeviceNamedFirst(t *testing.T) {
	needLoop(t)
	img := hosttest.SparseFile(t, 8<<20)
	const off = 1 << 20
	base, err := Attach(img, off, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(base) })
	var named []string
	top, err := AttachWith(base, 0, Options{DirectIO: true, Naming: func(p string) error {
		if _, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(p), "loop/backing_file")); err == nil {
			t.Errorf("Naming was told of %s while it is bound already", p)
		}
		named = append(named, p)
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(top) })
	if len(named) == 0 || named[len(named)-1] != top {
		t.Fatalf("Naming was told %q; the attach bound %s", named, top)
	}
	if got := sysfs(t, top, "loop/backing_file"); got != base {
		t.Fatalf("%s backs %s; want %s", top, got, base)
	}
	dio, err := DirectIO(top)
	if err != nil {
		t.Fatal(err)
	}
	if got := sysfs(t, top, "loop/dio"); got != map[bool]string{true: "1", false: "0"}[dio] {
		t.Fatalf("DirectIO(%s) = %v, sysfs says dio=%s", top, dio, got)
	}
	t.Logf("direct I/O over a loop device: %v", dio)
	f, err := os.OpenFile(top, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	copy(buf, "through two loop devices")
	if _, err := unix.Pwrite(int(f.Fd()), buf, 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	got := make([]byte, len("through two loop devices"))
	im, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	if _, err := im.ReadAt(got, off); err != nil || string(got) != "through two loop devices" {
		t.Fatalf("the file at byte %d holds %q (%v); want what was written at byte 0 of %s", off, got, err, top)
	}

	refused := errors.New("refused")
	var told string
	if p, err := AttachWith(base, 0, Options{Naming: func(p string) error { told = p; return refused }}); !errors.Is(err, refused) {
		t.Fatalf("an attach whose Naming failed: %s, %v; want the Naming's error", p, err)
	}
	if _, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(told), "loop/backing_file")); err == nil {
		t.Fatalf("%s is bound after its Naming failed", told)
	}
}
