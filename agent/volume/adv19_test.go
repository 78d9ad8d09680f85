package volume

// Directed reproductions, nineteenth adversarial round. The one here works
// on the host: it needs root and losetup (loop devices) and skips cleanly
// without them; it detaches every loop device it attaches.

import (
	"bytes"
	"errors"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
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

// A raw block volume on a lease-fenced disk is published to its pod as
// the data mapping: a loop device over the disk from the lease's data
// offset (docs/architecture.md: a pod never gets the disk itself of a
// lease-fenced volume, whose first MiB is the lease). The kernel lets
// anyone who has a loop device open for writing change its offset
// (LOOP_SET_STATUS64 asks for a writable open or CAP_SYS_ADMIN), and the
// pod has its device open for writing: without any capability it sets
// the offset to 0 and reads and writes the lease area through its own
// device, hostile lease input for every node (its slots, the preemption a
// takeover writes into this node's slot, which the renewer must see to
// stop this node's writes: P1), and the mapping is then at an offset
// neither findDataMapping nor the release guard's proof (inuse.Disk)
// looks at. Control: the mapping reads the data area before.
func TestAdv19RawBlockPodRemapsItsDataMappingOverTheLeaseArea(t *testing.T) {
	hosttest.NeedRoot(t, "loop devices need root", "losetup")
	_, disk := loop(t, 8)
	// The lease area's magic at byte 0 of the disk, the volume's data at
	// the data offset.
	leaseHead := []byte("VCOLEASE lease area of the disk")
	dataHead := []byte("the volume's own data, where the pod's device begins")
	df, err := os.OpenFile(disk, os.O_RDWR|unix.O_SYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := df.WriteAt(leaseHead, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := df.WriteAt(dataHead, lease.DataOffset); err != nil {
		t.Fatal(err)
	}
	df.Close()

	m := &Manager{}
	mapping, err := m.dataMapping(disk, lease.DataOffset, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := loopdev.Detach(mapping); err != nil {
			t.Logf("detaching %s: %v", mapping, err)
		}
	})
	head := func() []byte {
		t.Helper()
		f, err := os.OpenFile(mapping, os.O_RDONLY|unix.O_DIRECT, 0)
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
		return bytes.Clone(b[:64])
	}
	if got := head(); !bytes.HasPrefix(got, dataHead) {
		t.Fatalf("control: the data mapping %s begins with %q, not the volume's data", mapping, got)
	}

	// The pod: its device opened for writing, as the kubelet gives it, and
	// no CAP_SYS_ADMIN.
	err = withoutSysAdmin(t, func() error {
		f, err := os.OpenFile(mapping, os.O_RDWR, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		// The capability is gone: the block layer's read-only flag,
		// which asks for it, is refused.
		if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0); !errors.Is(err, unix.EACCES) && !errors.Is(err, unix.EPERM) {
			t.Errorf("control: BLKROSET without CAP_SYS_ADMIN answered %v, want EACCES: the capability was not dropped", err)
		}
		st, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		if err != nil {
			return err
		}
		st.Offset = 0
		return unix.IoctlLoopSetStatus64(int(f.Fd()), st)
	})
	if err != nil && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EACCES) {
		t.Fatalf("the pod's remap failed for another reason than a refusal: %v", err)
	}
	if got := head(); !bytes.HasPrefix(got, dataHead) {
		t.Fatalf("a pod without CAP_SYS_ADMIN remapped its raw block device %s (the volume's data mapping) to byte 0 of the disk (remap err %v): its device now begins with %q, the lease area, which it can read and write", mapping, err, got)
	}
}
