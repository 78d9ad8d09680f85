package uevent

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"golang.org/x/sys/unix"
)

func needRoot(t testing.TB) {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices and BLKROSET")
}

// loopControl creates and removes loop devices by index, which makes the
// kernel emit real block add and remove uevents.
type loopControl struct{ fd int }

func openLoopControl(t testing.TB) *loopControl {
	t.Helper()
	needRoot(t)
	fd, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no loop-control: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &loopControl{fd: fd}
}

// add creates a loop device with an unused index in a high range, so as
// not to meet the loop devices other tests attach.
func (l *loopControl) add(t testing.TB) int {
	t.Helper()
	for i := 400 + os.Getpid()%200; i < 1000; i++ {
		// LOOP_CTL_ADD takes the index itself as its argument.
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(l.fd), unix.LOOP_CTL_ADD, uintptr(i)); e == 0 {
			return i
		} else if e != unix.EEXIST {
			t.Fatalf("LOOP_CTL_ADD %d: %v", i, e)
		}
	}
	t.Fatal("no free loop index")
	return 0
}

func (l *loopControl) remove(i int) error {
	// The kernel may still hold the device briefly after detaching.
	var e unix.Errno
	for range 50 {
		_, _, e = unix.Syscall(unix.SYS_IOCTL, uintptr(l.fd), unix.LOOP_CTL_REMOVE, uintptr(i))
		if e != unix.EBUSY {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if e != 0 {
		return e
	}
	return nil
}

func image(t testing.TB, size int64) string {
	t.Helper()
	dir := t.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if dir, err = os.MkdirTemp("/dev/shm", "uevent-test-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	img := filepath.Join(dir, "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return img
}

// next reads events until one for the named device with the action
// arrives, or the deadline passes.
func next(t *testing.T, c *Conn, devname, action string) Event {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if err := c.SetReadDeadline(deadline); err != nil {
			t.Fatal(err)
		}
		ev, _, err := c.Read()
		if err != nil {
			t.Fatalf("waiting for %s of %s: %v", action, devname, err)
		}
		if ev.DevName == devname && ev.Action == action && ev.Source == Kernel {
			return ev
		}
	}
}

// The kernel's own events for a loop device's life: add when it is
// created, change when a file is attached, remove when it is deleted.
func TestKernelEventsForLoopDevice(t *testing.T) {
	lc := openLoopControl(t)
	c, err := Dial(GroupKernel | GroupUdev)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	idx := lc.add(t)
	name := fmt.Sprintf("loop%d", idx)
	removed := false
	t.Cleanup(func() {
		if !removed {
			exec.Command("losetup", "-d", "/dev/"+name).Run()
			lc.remove(idx)
		}
	})
	ev := next(t, c, name, "add")
	if !ev.Disk() || ev.Major != 7 || !ev.HasDevnum || ev.DevPath != "/devices/virtual/block/"+name || ev.Seqnum == 0 {
		t.Fatalf("add event %+v", ev)
	}
	minor := ev.Minor
	var st unix.Stat_t
	if err := unix.Stat("/dev/"+name, &st); err != nil || unix.Minor(st.Rdev) != minor {
		t.Fatalf("device node after the add event: %v, minor %d vs %d", err, unix.Minor(st.Rdev), minor)
	}
	if out, err := exec.Command("losetup", "/dev/"+name, image(t, 4<<20)).CombinedOutput(); err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	ev = next(t, c, name, "change")
	if ev.Minor != minor {
		t.Fatalf("change event %+v", ev)
	}
	if out, err := exec.Command("losetup", "-d", "/dev/"+name).CombinedOutput(); err != nil {
		t.Fatalf("losetup -d: %v: %s", err, out)
	}
	if err := lc.remove(idx); err != nil {
		t.Fatalf("LOOP_CTL_REMOVE: %v", err)
	}
	removed = true
	ev = next(t, c, name, "remove")
	if ev.Minor != minor || ev.Subsystem != "block" {
		t.Fatalf("remove event %+v", ev)
	}
}

func TestReadDeadline(t *testing.T) {
	c, err := Dial(GroupKernel)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	// Some event may arrive on a busy host; read until the deadline.
	for {
		_, _, err := c.Read()
		if err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("read after the deadline: %v", err)
			}
			return
		}
	}
}

func TestSetReadOnly(t *testing.T) {
	needRoot(t)
	out, err := exec.Command("losetup", "--find", "--show", image(t, 4<<20)).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	if err := SetReadOnly(dev, unix.Major(st.Rdev), unix.Minor(st.Rdev)+1, true); err == nil || !strings.Contains(err.Error(), "stale") {
		t.Fatalf("wrong device number accepted: %v", err)
	}
	if ro, _ := ReadOnly(dev); ro {
		t.Fatal("read-only after a refused call")
	}
	if err := SetReadOnly(dev, unix.Major(st.Rdev), unix.Minor(st.Rdev), true); err != nil {
		t.Fatal(err)
	}
	if ro, err := ReadOnly(dev); err != nil || !ro {
		t.Fatalf("BLKROGET after BLKROSET: %v %v", ro, err)
	}
	// The kernel now refuses writes, whoever asks (this kernel lets the
	// open succeed and fails the write with EPERM).
	if f, err := os.OpenFile(dev, os.O_WRONLY, 0); err == nil {
		_, werr := f.WriteAt([]byte("x"), 0)
		f.Close()
		if !errors.Is(werr, unix.EPERM) {
			t.Fatalf("write to a read-only device: %v, want EPERM", werr)
		}
	}
	if out, err := exec.Command("dd", "if=/dev/zero", "of="+dev, "bs=4096", "count=1", "oflag=direct").CombinedOutput(); err == nil {
		t.Fatalf("dd wrote to a read-only device: %s", out)
	}
	if err := SetReadOnly(dev, 0, 0, false); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("dd", "if=/dev/zero", "of="+dev, "bs=4096", "count=1", "oflag=direct").CombinedOutput(); err != nil {
		t.Fatalf("dd after clearing read-only: %v %s", err, out)
	}
	if err := SetReadOnly("/dev/null", 0, 0, true); err == nil {
		t.Fatal("character device accepted")
	}
}
