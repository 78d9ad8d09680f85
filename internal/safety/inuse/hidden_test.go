package inuse

// Writers that hold the disk without a descriptor of it or a mapping
// /proc/PID/maps shows: a file registered with an io_uring, a process
// whose thread group leader exited, a SCSI generic node of the disk. On
// this host's loop devices (root, else skipped).

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// hiddenHelper, set in the environment to "KIND DISK", makes this test
// binary a writer of TestProofSeesAHiddenWriter: it gets hold of the disk
// as KIND says, says "ready", writes hiddenMark at byte 0 when told and
// says "written".
const hiddenHelper = "INUSE_HIDDEN_HELPER"

const hiddenMark = "written by a hidden writer"

func init() {
	// The leader's exit (kind "leader") must run on the thread group's
	// leader, which only the main goroutine's init is on.
	var kind, disk string
	if _, err := fmt.Sscan(os.Getenv(hiddenHelper), &kind, &disk); err != nil || kind != "leader" {
		return
	}
	runtime.LockOSThread()
	go func() {
		if err := leaderGone(disk); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}()
	// The leader thread alone ends (exit, not exit_group): the process
	// runs on in its other threads, and its /proc/PID/maps and
	// map_files are empty.
	_, _, _ = unix.Syscall(unix.SYS_EXIT, 0, 0, 0)
}

// leaderGone maps disk shared and writable, closes its descriptor, waits
// for the leader thread to end, then writes when told through the
// mapping.
func leaderGone(disk string) error {
	fd, err := unix.Open(disk, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	page, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	if err := unix.Close(fd); err != nil {
		return err
	}
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/stat", os.Getpid()))
		if err != nil || strings.Contains(string(b), ") Z ") {
			break // the leader is a zombie, or reaped from the list
		}
		runtime.Gosched()
	}
	return afterReady(func() error {
		copy(page, hiddenMark)
		return unix.Msync(page, unix.MS_SYNC)
	})
}

// afterReady says "ready", runs write when told, and says "written".
func afterReady(write func() error) error {
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return err
	}
	if err := write(); err != nil {
		return err
	}
	fmt.Println("written")
	return nil
}

func TestHiddenWriterProcess(t *testing.T) {
	var kind, disk string
	if _, err := fmt.Sscan(os.Getenv(hiddenHelper), &kind, &disk); err != nil {
		t.Skip("the helper process of TestProofSeesAHiddenWriter")
	}
	switch kind {
	case "io_uring":
		if err := ringWriter(disk); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("unknown helper kind %q", kind)
	}
}

// ringWriter registers disk with an io_uring, closes its own descriptor
// of it, and writes through the ring when told.
func ringWriter(disk string) error {
	fd, err := unix.Open(disk, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	r, err := newTestRing(fd)
	if err != nil {
		return err
	}
	if err := unix.Close(fd); err != nil {
		return err
	}
	return afterReady(r.write)
}

// testRing is a ring of one entry with fd registered as its file 0, the
// submission ring and entries mapped.
type testRing struct {
	fd       uintptr
	params   ringParams
	sq, sqes []byte
}

// newTestRing sets the ring up.
func newTestRing(fd int) (*testRing, error) {
	r := &testRing{}
	ring, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&r.params)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r.fd = ring
	files := []int32{int32(fd)}
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, ring, 2 /* IORING_REGISTER_FILES */, uintptr(unsafe.Pointer(&files[0])), 1, 0, 0); errno != 0 {
		return nil, fmt.Errorf("io_uring_register files: %w", errno)
	}
	var err error
	if r.sq, err = unix.Mmap(int(ring), 0, int(r.params.sqOff[6]+r.params.sqEntries*4), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return nil, err
	}
	if r.sqes, err = unix.Mmap(int(ring), 0x10000000 /* IORING_OFF_SQES */, int(r.params.sqEntries*64), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return nil, err
	}
	return r, nil
}

// write writes hiddenMark at byte 0 of the ring's file 0
// (IORING_OP_WRITE on the fixed file).
func (r *testRing) write() error {
	buf := []byte(hiddenMark)
	sqe := r.sqes[:64]
	clear(sqe)
	sqe[0] = 23 // IORING_OP_WRITE
	sqe[1] = 1  // IOSQE_FIXED_FILE
	*(*uint64)(unsafe.Pointer(&sqe[16])) = uint64(uintptr(unsafe.Pointer(&buf[0])))
	*(*uint32)(unsafe.Pointer(&sqe[24])) = uint32(len(buf))
	*(*uint32)(unsafe.Pointer(&r.sq[r.params.sqOff[6]])) = 0
	tail := (*uint32)(unsafe.Pointer(&r.sq[r.params.sqOff[1]]))
	*tail++
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, r.fd, 1, 1, 1 /* IORING_ENTER_GETEVENTS */, 0, 0)
	runtime.KeepAlive(buf)
	if errno != 0 {
		return fmt.Errorf("io_uring_enter: %w", errno)
	}
	return nil
}

// ringParams is the kernel's struct io_uring_params: sqOff holds struct
// io_sqring_offsets (head, tail, ring_mask, ring_entries, flags,
// dropped, array, ...).
type ringParams struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  [10]uint32
	cqOff                                                                  [10]uint32
}

// A writer that holds the disk through neither a descriptor nor a mapping
// /proc/PID/maps lists, whose write lands after the proof:
//
//   - io_uring: the disk registered with an io_uring (IORING_REGISTER_FILES)
//     and its own descriptor closed: the ring holds the file and its
//     requests write it (a database on a raw block volume does so);
//   - leader: a process mapped the disk shared and writable, closed its
//     descriptor, and its thread group leader exited while another
//     thread runs (pthread_exit in main): /proc/PID/maps and map_files,
//     the leader's, are empty.
//
// The proof must name each.
func TestProofSeesAHiddenWriter(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	for _, kind := range []string{"io_uring", "leader"} {
		t.Run(kind, func(t *testing.T) {
			disk, _, _ := unusedLoopDisk(t)
			cmd := exec.Command(os.Args[0], "-test.run", "^TestHiddenWriterProcess$")
			cmd.Env = append(os.Environ(), hiddenHelper+"="+kind+" "+disk)
			cmd.Stderr = os.Stderr
			in, out := startHelper(t, cmd)
			proof := proofBeforeWrite(t, disk, in, out, "ready", hiddenMark)
			var e *Error
			if !errors.As(proof, &e) || !strings.Contains(e.What, fmt.Sprintf("process %d", cmd.Process.Pid)) {
				t.Fatalf("process %d (%s) wrote %s after the proof, and Disk = %v: the proof must name it", cmd.Process.Pid, kind, disk, proof)
			}
			t.Logf("found: %v", proof)
		})
	}
}

// The disk's SCSI generic nodes (sg, bsg) reach it as well as its block
// device: a process that holds one open for writing is a writer (here
// /dev/full stands for the sg node a fake sysfs names; this host has no
// SCSI), one that holds it read-only is not.
func TestProofSeesASCSIGenericNodeOpenForWriting(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	disk, _, _ := unusedLoopDisk(t)
	sys := t.TempDir()
	d := fakeDisk(t, sys, filepath.Base(disk))
	var full unix.Stat_t
	if err := unix.Stat("/dev/full", &full); err != nil {
		t.Skip(err)
	}
	sg := filepath.Join(d, "device", "scsi_generic", "sg9")
	if err := os.MkdirAll(sg, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sg, "dev"), fmt.Appendf(nil, "%d:%d\n", unix.Major(full.Rdev), unix.Minor(full.Rdev)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Disk(sys, disk); err != nil {
		t.Skipf("control: something of this host holds /dev/full open for writing: %v", err)
	}
	for _, mode := range []string{"read-only", "writing"} {
		cmd := exec.Command("sh", "-c", "echo ready; read x")
		f, err := os.OpenFile("/dev/full", map[string]int{"read-only": os.O_RDONLY, "writing": os.O_WRONLY}[mode], 0)
		if err != nil {
			t.Fatal(err)
		}
		cmd.ExtraFiles = []*os.File{f}
		in, out := startHelper(t, cmd)
		f.Close()
		if l, err := bufio.NewReader(out).ReadString('\n'); err != nil || l != "ready\n" {
			t.Fatalf("the helper did not start: %q %v", l, err)
		}
		err = Disk(sys, disk)
		in.Close()
		var e *Error
		switch {
		case mode == "read-only" && err != nil:
			t.Fatalf("a process holding the disk's sg node read-only: Disk = %v, want nil", err)
		case mode == "writing" && (!errors.As(err, &e) || !strings.Contains(e.What, "its SCSI generic node sg9: process")):
			t.Fatalf("a process holding the disk's sg node open for writing: Disk = %v, want it named", err)
		}
		t.Logf("%s: %v", mode, err)
	}
}

// The kernel's lists of a ring's registered files, as fdinfo has them.
func TestRegisteredReadsARingsFiles(t *testing.T) {
	for _, c := range []struct {
		name, fdinfo string
		paths        []string
		listed       bool
	}{
		{"none", "SqMask:\t0x3\nUserFiles:\t0\nUserBufs:\t0\n", nil, true},
		{"two", "UserFiles:\t3\n    0: /dev/vdb\n    2: /var/lib/a\\040b (deleted)\nUserBufs:\t0\n", []string{"/dev/vdb", "/var/lib/a b (deleted)"}, true},
		{"busy, the whole list left out", "pos:\t0\nflags:\t02000002\n", nil, false},
		{"busy, the entries left out", "UserFiles:\t4\nUserBufs:\t0\n", nil, false},
		{"garbled count", "UserFiles:\tx\n    0: /dev/vdb\n", nil, false},
	} {
		paths, listed := registered(c.fdinfo)
		if listed != c.listed || fmt.Sprint(paths) != fmt.Sprint(c.paths) {
			t.Errorf("%s: registered = %q, %v; want %q, %v", c.name, paths, listed, c.paths, c.listed)
		}
	}
}

// A maps line's path: after five columns, spaces of its own kept.
func TestAfterFieldsIsAMapsLinesPath(t *testing.T) {
	for line, want := range map[string]string{
		"7f00-7f01 rw-s 00000000 00:05 12345                      /dev/loop3": "/dev/loop3",
		"7f00-7f01 rw-s 00012345 00:05 12345   /run/a dir/x (deleted)":        "/run/a dir/x (deleted)",
		"7f00-7f01 rw-s 00000000 00:00 0 ":                                    "",
		"7f00-7f01 rw-s 00000000 00:05 12345                      /a\\012b":   "/a\\012b",
	} {
		if got := afterFields(line, 5); got != want {
			t.Errorf("afterFields(%q) = %q, want %q", line, got, want)
		}
	}
}
