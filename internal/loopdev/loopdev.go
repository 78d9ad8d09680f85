// Package loopdev attaches, resizes and detaches loop devices with the
// kernel's loop ioctls, as losetup(8) does: the agent maps a lease disk's
// data area through one on every stage, and a process start per mapping
// is its slowest part on a small machine. The ioctls and their types come
// from golang.org/x/sys/unix; the few lines around them are written here,
// as no maintained Go library offers them.
package loopdev

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Control is the loop control device that hands out free loop devices.
const Control = "/dev/loop-control"

// attachTries bounds the retries of Attach when another program takes the
// free loop device between the kernel's answer and the configuration.
const attachTries = 16

// Attach binds a free loop device to backing from byte offset on (to its
// end) and returns the device's path. readOnly makes the loop device
// read-only. The mapping stays until Detach; nothing clears it when the
// caller exits.
func Attach(backing string, offset int64, readOnly bool) (string, error) {
	return AttachWith(backing, offset, Options{ReadOnly: readOnly})
}

// Options are what AttachWith does beyond Attach's binding.
type Options struct {
	// ReadOnly makes the loop device read-only: a flag its openers cannot
	// clear (LOOP_SET_STATUS64 leaves it as it is).
	ReadOnly bool
	// DirectIO asks the kernel to read and write the backing file with
	// direct I/O, past its page cache; a kernel that cannot for this
	// backing file binds it buffered (DirectIO reports which).
	DirectIO bool
	// Naming, when set, is told the path of the free loop device before
	// it is bound, so that the caller records it first; an error stops the
	// attach with nothing bound. It is told again of another device when
	// another program takes the first.
	Naming func(path string) error
}

// AttachWith is Attach with the options o.
func AttachWith(backing string, offset int64, o Options) (string, error) {
	if offset < 0 {
		return "", fmt.Errorf("loop device over %s: offset %d is negative", backing, offset)
	}
	mode := os.O_RDWR
	if o.ReadOnly {
		mode = os.O_RDONLY
	}
	b, err := os.OpenFile(backing, mode|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("loop device over %s: %w", backing, err)
	}
	defer b.Close()
	ctl, err := os.OpenFile(Control, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("loop device over %s: %w", backing, err)
	}
	defer ctl.Close()
	cfg := unix.LoopConfig{Fd: uint32(b.Fd())}
	cfg.Info.Offset = uint64(offset)
	if o.ReadOnly {
		cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
	}
	if o.DirectIO {
		cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
	}
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], backing)
	for try := 0; ; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", fmt.Errorf("loop device over %s: no free loop device: %w", backing, err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		if o.Naming != nil {
			if err := o.Naming(path); err != nil {
				return "", fmt.Errorf("loop device over %s: %w", backing, err)
			}
		}
		err = configure(path, &cfg)
		if err == nil {
			return path, nil
		}
		if !errors.Is(err, unix.EBUSY) || try+1 == attachTries {
			return "", fmt.Errorf("loop device over %s: binding %s: %w", backing, path, err)
		}
		// Taken by another program since the kernel named it free.
	}
}

// DirectIO reports whether the loop device at path reads and writes its
// backing file with direct I/O.
func DirectIO(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	st, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return false, fmt.Errorf("the status of the loop device %s: %w", path, err)
	}
	return st.Flags&unix.LO_FLAGS_DIRECT_IO != 0, nil
}

// configure binds the loop device at path as cfg says. A writable one is
// made writable: the block layer's read-only flag (BLKROSET) of a loop
// device outlives its detach, so a free one may come with its last
// user's.
func configure(path string, cfg *unix.LoopConfig) error {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlLoopConfigure(int(f.Fd()), cfg); err != nil {
		return err
	}
	if cfg.Info.Flags&unix.LO_FLAGS_READ_ONLY != 0 {
		return nil
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0); err != nil {
		_ = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
		return fmt.Errorf("clearing the read-only flag its last user left: %w", err)
	}
	return nil
}

// Detach unbinds the loop device at path from its backing file. The
// kernel finishes it when its last opener closes it (a mounted loop
// device is unbound at the unmount).
func Detach(path string) error { return request(path, unix.LOOP_CLR_FD, "detaching") }

// Resize makes the loop device at path see its backing file's size now
// (a grown disk).
func Resize(path string) error { return request(path, unix.LOOP_SET_CAPACITY, "resizing") }

// request makes the loop ioctl req, which takes no argument, on the loop
// device at path; doing names it in the error.
func request(path string, req uint, doing string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), req, 0); err != nil {
		return fmt.Errorf("%s the loop device %s: %w", doing, path, err)
	}
	return nil
}
