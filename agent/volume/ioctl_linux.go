package volume

import (
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctlGetUint64 reads the uint64 an ioctl such as BLKGETSIZE64 answers.
func ioctlGetUint64(f *os.File, req uint, out *uint64) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(out)))
	if errno != 0 {
		return errno
	}
	return nil
}
