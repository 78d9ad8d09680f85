package lease

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// Device is a disk opened for lease I/O: O_DIRECT, so that every read
// reaches the disk instead of this host's page cache (another host's
// renewal would otherwise never be seen), and O_DSYNC, so that a write
// has reached stable storage when it returns.
type Device struct {
	name string
	f    blockFile
	// sem serialises I/O, so at most one request per disk is in flight
	// in this process; a request that timed out keeps its buffer and the
	// disk until it completes. Every Device of one disk in a process
	// shares it (ioLock): a new engine of a volume staged again must not
	// read or claim while its predecessor's release write is still in
	// flight, which would land over the new claim. It is a channel rather
	// than a mutex so that waiting for it is a blocking receive the
	// simulator's fake clock can see through (testing/synctest).
	sem  chan struct{}
	size int64
	// id is what name named when it was opened (a blank proof of name
	// is taken only if it is of the same device).
	id blank.FileID
	// gate, when set by the simulator, runs where this host's process
	// enters and leaves a lease I/O: a paused host blocks there. Nil in
	// production.
	gate func()
}

// ioLocks are the I/O locks of the disks this process opened for lease
// I/O, by disk: a block device by its device number (whichever node
// names it), a file by its inode. They are kept for the process's life:
// a disk is one small entry.
var ioLocks = struct {
	sync.Mutex
	m map[[3]uint64]chan struct{}
}{m: map[[3]uint64]chan struct{}{}}

// ioLock is the I/O lock of the disk st describes, shared by every Device
// of it in this process.
func ioLock(st *unix.Stat_t) chan struct{} {
	k := [3]uint64{0, st.Dev, st.Ino}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		k = [3]uint64{1, st.Rdev, 0}
	}
	ioLocks.Lock()
	defer ioLocks.Unlock()
	l, ok := ioLocks.m[k]
	if !ok {
		l = make(chan struct{}, 1)
		ioLocks.m[k] = l
	}
	return l
}

// blockFile is what a Device does its I/O on: the opened disk, or the
// simulator's disk in the lease's schedule tests (sim_test.go).
type blockFile interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	Close() error
}

// OpenDevice opens path for lease I/O. It rejects devices whose logical
// block size is above BlockSize (no lease I/O could be aligned).
func OpenDevice(path string) (*Device, error) {
	return openDevice(path, unix.O_RDWR|unix.O_DSYNC)
}

// OpenDeviceReadOnly opens path for reading the lease only: it works on a
// device that was set read-only (a refused disk), and cannot write.
func OpenDeviceReadOnly(path string) (*Device, error) {
	return openDevice(path, unix.O_RDONLY)
}

func openDevice(path string, mode int) (*Device, error) {
	fd, err := unix.Open(path, mode|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening %s for lease I/O (O_DIRECT): %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	d := &Device{name: path, f: f}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	d.id = blank.FileIDOf(&st)
	d.sem = ioLock(&st)
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		ssz, err := unix.IoctlGetInt(fd, unix.BLKSSZGET)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("%s: reading the logical block size: %w", path, err)
		}
		if ssz > BlockSize || BlockSize%ssz != 0 {
			f.Close()
			return nil, fmt.Errorf("%s: logical block size %d does not divide the lease block size %d", path, ssz, BlockSize)
		}
		var sz uint64
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&sz))); e != 0 {
			f.Close()
			return nil, fmt.Errorf("%s: reading the device size: %w", path, e)
		}
		d.size = int64(sz)
	} else {
		d.size = st.Size
	}
	return d, nil
}

// Name is the path the device was opened as.
func (d *Device) Name() string { return d.name }

// Size is the device size in bytes at open time.
func (d *Device) Size() int64 { return d.size }

// Fd is the open descriptor (for ioctls such as BLKROSET).
func (d *Device) Fd() uintptr { return d.f.(*os.File).Fd() }

// Close closes the device.
func (d *Device) Close() error { return d.f.Close() }

// alignedBuf returns n bytes starting on a BlockSize boundary, as O_DIRECT
// requires.
func alignedBuf(n int) []byte {
	b := make([]byte, n+BlockSize)
	off := 0
	if r := int(uintptr(unsafe.Pointer(&b[0])) % BlockSize); r != 0 {
		off = BlockSize - r
	}
	return b[off : off+n : off+n]
}

// errIOTimeout is wrapped when a lease I/O did not complete within the
// I/O timeout.
var errIOTimeout = errors.New("lease I/O did not complete within the I/O timeout")

// read reads n bytes at off into a buffer of its own (transfer).
func (d *Device) read(ctx context.Context, off int64, n int, timeout time.Duration) ([]byte, error) {
	return d.transfer(ctx, off, n, nil, timeout)
}

// write writes data at off (transfer).
func (d *Device) write(ctx context.Context, off int64, data []byte, timeout time.Duration) error {
	_, err := d.transfer(ctx, off, len(data), data, timeout)
	return err
}

// transfer runs one aligned pwrite of data when it is not nil, else a
// pread of n bytes, giving up on it after timeout. The kernel request
// itself cannot be cancelled; it finishes in the background with its own
// buffer, and the device stays locked until it does, so a late write can
// never overtake a newer one.
func (d *Device) transfer(ctx context.Context, off int64, n int, data []byte, timeout time.Duration) ([]byte, error) {
	write := data != nil
	if off%BlockSize != 0 || n%BlockSize != 0 || n == 0 {
		return nil, fmt.Errorf("lease I/O at %d of %d bytes is not block aligned", off, n)
	}
	buf := alignedBuf(n)
	if write {
		copy(buf, data)
	}
	if d.gate != nil {
		d.gate()
		defer d.gate()
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case d.sem <- struct{}{}:
	case <-t.C:
		return nil, fmt.Errorf("%s: %w (%s): an earlier request is still in flight", d.name, errIOTimeout, timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer func() { <-d.sem }()
		var r result
		if write {
			r.n, r.err = d.f.WriteAt(buf, off)
		} else {
			r.n, r.err = d.f.ReadAt(buf, off)
		}
		done <- r
	}()
	op := "reading"
	if write {
		op = "writing"
	}
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("%s: %s the lease area at offset %d: %w", d.name, op, off, r.err)
		}
		if r.n != n {
			return nil, fmt.Errorf("%s: %s the lease area at offset %d: short transfer (%d of %d bytes)", d.name, op, off, r.n, n)
		}
		return buf, nil
	case <-t.C:
		return nil, fmt.Errorf("%s: %s the lease area at offset %d: %w (%s)", d.name, op, off, errIOTimeout, timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// ReadArea reads the header and every slot in one request.
func (d *Device) ReadArea(ctx context.Context, timeout time.Duration) ([]byte, error) {
	return d.read(ctx, 0, ReadSize, timeout)
}

// writeSlot writes slot i.
func (d *Device) writeSlot(ctx context.Context, i int, blk []byte, timeout time.Duration) error {
	return d.write(ctx, int64(BlockSize*(1+i)), blk, timeout)
}

// writeSlotPastReadOnly is writeSlot on a device that may have been set
// read-only (BLKROSET) to stop this host's I/O: the flag is cleared for
// the one write and set again, whatever the write's outcome. A device
// that is read-only for a reason BLKROSET does not control (the
// hypervisor's) still refuses the write.
func (d *Device) writeSlotPastReadOnly(ctx context.Context, i int, blk []byte, timeout time.Duration) error {
	of, ok := d.f.(*os.File)
	if !ok {
		return d.writeSlot(ctx, i, blk, timeout)
	}
	fd := int(of.Fd())
	ro, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil || ro == 0 {
		// Not a block device (a test image) or writable: a plain write.
		return d.writeSlot(ctx, i, blk, timeout)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.BLKROSET, 0); err != nil {
		return fmt.Errorf("%s: clearing the read-only flag for the fenced mark: %w", d.name, err)
	}
	werr := d.writeSlot(ctx, i, blk, timeout)
	if err := unix.IoctlSetPointerInt(fd, unix.BLKROSET, 1); err != nil {
		return errors.Join(werr, fmt.Errorf("%s: setting the disk read-only again after the fenced mark: %w", d.name, err))
	}
	return werr
}
