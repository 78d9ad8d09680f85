package volume

// Directed reproductions, nineteenth adversarial round. The one here works
// on the host, through the agent's own stage and publish (volume_test.go's
// env): it needs root, losetup, blkid and mkfs (needRoot) and skips cleanly
// without them; it unstages what it staged and detaches every loop device
// it attaches.

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// withoutSysAdmin runs f on an OS thread whose effective capabilities lack
// CAP_SYS_ADMIN, as a pod's container process has them; the thread is
// discarded after (it is never unlocked), so no other goroutine runs
// without the capability.
func withoutSysAdmin(t *testing.T, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			done <- errors.Join(errors.New("capget"), err)
			return
		}
		data[unix.CAP_SYS_ADMIN/32].Effective &^= 1 << (unix.CAP_SYS_ADMIN % 32)
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			done <- errors.Join(errors.New("capset"), err)
			return
		}
		done <- f()
	}()
	return <-done
}

// deviceHead reads the first 32 bytes of the block device at p, past the
// page cache.
func deviceHead(t *testing.T, p string) []byte {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	if _, err := unix.Pread(int(f.Fd()), b, 0); err != nil {
		t.Fatal(err)
	}
	return bytes.Clone(b[:32])
}

// remapToByteZero is what a pod can do with the raw block device at p it
// was given: open it for writing and set its loop offset to 0. It first
// shows that the caller lacks CAP_SYS_ADMIN (BLKROSET, which asks for it,
// is refused).
func remapToByteZero(t *testing.T, p string) error {
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0); !errors.Is(err, unix.EACCES) && !errors.Is(err, unix.EPERM) {
		t.Errorf("control: BLKROSET without CAP_SYS_ADMIN answered %v, want EACCES: the capability was not dropped", err)
	}
	st, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return err
	}
	st.Offset = 0
	return unix.IoctlLoopSetStatus64(int(f.Fd()), st)
}

// A raw block volume on a lease-fenced disk is published to its pod as
// the data mapping: a loop device over the disk from the lease's data
// offset (docs/architecture.md: a pod never gets the disk itself of a
// lease-fenced volume, whose first MiB is the lease). The kernel lets
// anyone who has a loop device open for writing change its offset
// (LOOP_SET_STATUS64 asks for a writable open or CAP_SYS_ADMIN), and the
// pod has its device open for writing: without any capability it sets
// the offset to 0 and reads and writes the lease area through its own
// device. That is hostile lease input for every node (its slots, and the
// preemption a takeover writes into this node's slot, which this node's
// renewer must read to stop its writes: P1), and the mapping is then at
// an offset that neither findDataMapping nor the release guard's proof
// (inuse.Disk) looks at. The stage and publish are the agent's own, on a
// loop device standing for the disk; the pod is this process with
// CAP_SYS_ADMIN dropped, working on the target path the kubelet hands it.
// Control: the pod's device shows the data area before.
func TestAdv19RawBlockPodRemapsItsDeviceOverTheLeaseArea(t *testing.T) {
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 64)
	req, target := e.stageAndPublishRawBlock(ctx, rawBlockCase{name: "lease", lease: true}, img, dev)
	c, err := e.m.store.Get("vol-rb")
	if err != nil || c == nil || c.DataDevice == "" {
		t.Fatalf("the staged lease volume's claim: %+v %v", c, err)
	}
	mapping := c.DataDevice
	t.Cleanup(func() {
		if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
			t.Logf("unpublish: %v", err)
		}
		if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
			t.Logf("unstage: %v", err)
		}
		// A mapping the unstage left (its offset changed under it) is
		// detached, only while it is still a loop device over this
		// test's disk.
		b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(mapping), "loop", "backing_file"))
		if err == nil && strings.TrimSpace(string(b)) == dev {
			_ = loopdev.Detach(mapping)
		}
	})
	if got := deviceHead(t, target); bytes.HasPrefix(got, []byte(blank.LeaseMagic)) {
		t.Fatalf("control: the pod's device %s begins with the lease area already: %q", target, got)
	}

	// The pod: its device opened for writing, as the kubelet gives it, and
	// no CAP_SYS_ADMIN.
	err = withoutSysAdmin(t, func() error { return remapToByteZero(t, target) })
	if err != nil && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EACCES) && !errors.Is(err, unix.EINVAL) {
		t.Fatalf("the pod's remap failed for another reason than a refusal: %v", err)
	}
	if got := deviceHead(t, target); bytes.HasPrefix(got, []byte(blank.LeaseMagic)) {
		t.Fatalf("a pod without CAP_SYS_ADMIN remapped its raw block device %s (the data mapping %s) to byte 0 of the disk (remap err %v): it now begins with %q, the lease area, which the pod can read and write", target, mapping, err, got)
	}
}
