package inuse

// Directed reproductions, twenty-second adversarial round, of the release
// guard's proof over the disk (Disk), on this host's loop devices (root,
// else skipped): writers the proof's look at /proc/PID misses.

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// adv22Helper, set in the environment to "KIND DISK", makes this test
// binary one of the writers of TestAdv22ReleaseGuardMissesAWriter: it
// gets hold of the disk as KIND says, says "ready", and writes the mark
// at byte 0 when told, then says "written".
const adv22Helper = "INUSE_ADV22_HELPER"

const adv22Mark = "written by a writer the proof did not see"

func TestAdv22WriterProcess(t *testing.T) {
	var kind, disk string
	if _, err := fmt.Sscan(os.Getenv(adv22Helper), &kind, &disk); err != nil {
		t.Skip("the helper process of TestAdv22ReleaseGuardMissesAWriter")
	}
	in := bufio.NewReader(os.Stdin)
	switch kind {
	case "thread":
		// A thread with a descriptor table of its own (unshare
		// CLONE_FILES): its descriptors are not the thread group's, so
		// /proc/PID/fd (the leader's table) does not list them.
		if err := <-onOtherThread(func() error {
			if err := unix.Unshare(unix.CLONE_FILES); err != nil {
				return err
			}
			fd, err := unix.Open(disk, unix.O_RDWR|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			fmt.Println("ready")
			if _, err := in.ReadString('\n'); err != nil {
				return err
			}
			if _, err := unix.Pwrite(fd, []byte(adv22Mark), 0); err != nil {
				return err
			}
			return unix.Fsync(fd)
		}); err != nil {
			t.Fatal(err)
		}
	case "mprotect":
		// A shared mapping of a descriptor opened for writing, mapped
		// read-only and closed: /proc/PID/maps says "r--s", yet the
		// kernel lets the process make it writable (mprotect) at any
		// time, as its descriptor was.
		fd, err := unix.Open(disk, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		page, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Close(fd); err != nil {
			t.Fatal(err)
		}
		fmt.Println("ready")
		if _, err := in.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mprotect(page, unix.PROT_READ|unix.PROT_WRITE); err != nil {
			t.Fatal(err)
		}
		copy(page, adv22Mark)
		if err := unix.Msync(page, unix.MS_SYNC); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("unknown helper kind %q", kind)
	}
	fmt.Println("written")
}

// A process of this host can write the disk, and Disk says nothing of
// the volume is in use: the release guard (and `lease release`/`clear`)
// gives the fence up under a live writer of this node (P1: shown below,
// its write lands after the proof).
//
//   - thread: a thread with a descriptor table of its own (unshare
//     CLONE_FILES, as a sandboxing helper thread does) holds the disk open
//     for writing. /proc/PID/fd is the thread group leader's table; the
//     thread's is /proc/PID/task/TID/fd. A process whose leader thread
//     exited while others run (pthread_exit in main) is the same: its
//     /proc/PID/fd and /proc/PID/maps are empty.
//   - mprotect: a process mapped the disk shared from a descriptor open
//     for writing, read-only for now, and closed the descriptor.
//     /proc/PID/maps says "r--s"; the mapping may be made writable at any
//     time (the "mw" of its VmFlags in /proc/PID/smaps).
//
// Control: the disk with no such process is proven unused.
func TestAdv22ReleaseGuardMissesAWriter(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	for _, kind := range []string{"thread", "mprotect"} {
		t.Run(kind, func(t *testing.T) {
			disk, _, _ := unusedLoopDisk(t)
			cmd := exec.Command(os.Args[0], "-test.run", "^TestAdv22WriterProcess$")
			cmd.Env = append(os.Environ(), adv22Helper+"="+kind+" "+disk)
			cmd.Stderr = os.Stderr
			in, out := startHelper(t, cmd)
			proof := proofBeforeWrite(t, disk, in, out, "ready", adv22Mark)
			if !errors.As(proof, new(*Error)) {
				t.Fatalf("process %d (%s) could write %s (its write landed after the proof), and Disk = %v: the proof says nothing uses the disk, and the release guard gives its fence up under a live writer of this node",
					cmd.Process.Pid, kind, disk, proof)
			}
			t.Logf("found: %v", proof)
		})
	}
}

// onOtherThread runs f on a thread of its own that is not the thread
// group's leader, locked to it (the thread ends with f), and sends what
// f returned.
func onOtherThread(f func() error) <-chan error {
	done := make(chan error, 1)
	var try func()
	try = func() {
		runtime.LockOSThread() // never unlocked: the thread ends with f
		if unix.Gettid() == unix.Getpid() {
			// The leader stays taken by this goroutine, which ends
			// with the process; the next one gets another thread.
			go try()
			select {}
		}
		done <- f()
	}
	go try()
	return done
}
