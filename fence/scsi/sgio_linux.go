//go:build linux

package scsi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Linux SG_IO ABI (include/scsi/sg.h).
const (
	sgIO             = 0x2285
	sgInterfaceID    = 'S'
	sgDxferNone      = -1
	sgDxferToDev     = -2
	sgDxferFromDev   = -3
	senseBufferBytes = 252 // SPC-4 maximum sense length
)

// sgIOHdr mirrors struct sg_io_hdr for 64-bit Linux. The pointers refer to
// Go heap memory that stays referenced (and so in place) for the duration of
// the ioctl.
type sgIOHdr struct {
	interfaceID    int32
	dxferDirection int32
	cmdLen         uint8
	mxSbLen        uint8
	iovecCount     uint16
	dxferLen       uint32
	dxferp         unsafe.Pointer
	cmdp           unsafe.Pointer
	sbp            unsafe.Pointer
	timeout        uint32
	flags          uint32
	packID         int32
	usrPtr         unsafe.Pointer
	status         uint8
	maskedStatus   uint8
	msgStatus      uint8
	sbLenWr        uint8
	hostStatus     uint16
	driverStatus   uint16
	resid          int32
	duration       uint32
	info           uint32
}

// SGIO is a Transport issuing commands with the SG_IO ioctl on an open block
// (or sg) device.
type SGIO struct {
	f *os.File
}

// OpenSGIO opens a device for SG_IO. It opens read-only: PR OUT needs
// CAP_SYS_RAWIO rather than a writable descriptor, and a device that has
// been set read-only (BLKROSET) after a refusal must still be inspectable.
// O_NONBLOCK keeps the open from waiting on a unit that is not ready.
func OpenSGIO(path string) (*SGIO, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return &SGIO{f: f}, nil
}

// NewSGIO uses an already open device file (which the caller verified).
func NewSGIO(f *os.File) *SGIO { return &SGIO{f: f} }

// File returns the open device.
func (s *SGIO) File() *os.File { return s.f }

// Close closes the device.
func (s *SGIO) Close() error { return s.f.Close() }

// Execute implements Transport. The context cannot interrupt an ioctl in
// flight; the timeout (which Device derives from the context's deadline) is
// what bounds it, enforced by the kernel's command timeout.
func (s *SGIO) Execute(ctx context.Context, cdb []byte, dir Direction, data []byte, timeout time.Duration) (Response, error) {
	if len(cdb) == 0 || len(cdb) > 16 {
		return Response{}, fmt.Errorf("CDB length %d not supported", len(cdb))
	}
	cmd := append([]byte(nil), cdb...)
	sense := make([]byte, senseBufferBytes)
	h := sgIOHdr{
		interfaceID: sgInterfaceID,
		cmdLen:      uint8(len(cmd)),
		mxSbLen:     uint8(len(sense)),
		cmdp:        unsafe.Pointer(&cmd[0]),
		sbp:         unsafe.Pointer(&sense[0]),
		timeout:     uint32(max(timeout.Milliseconds(), 1)),
	}
	switch dir {
	case DirNone:
		h.dxferDirection = sgDxferNone
	case DirFromDevice:
		h.dxferDirection = sgDxferFromDev
	case DirToDevice:
		h.dxferDirection = sgDxferToDev
	}
	if len(data) > 0 && dir != DirNone {
		h.dxferLen = uint32(len(data))
		h.dxferp = unsafe.Pointer(&data[0])
	}
	conn, err := s.f.SyscallConn()
	if err != nil {
		return Response{}, err
	}
	var errno unix.Errno
	cerr := conn.Control(func(fd uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, sgIO, uintptr(unsafe.Pointer(&h)))
	})
	runtime.KeepAlive(cmd)
	runtime.KeepAlive(sense)
	runtime.KeepAlive(data)
	if cerr != nil {
		return Response{}, cerr
	}
	if errno != 0 {
		// ENOTTY: the driver has no SG_IO (virtio-blk, loop, nvme, a
		// partition on some kernels). EINVAL from a partition; both mean
		// "not a SCSI device" to us.
		if errors.Is(errno, unix.ENOTTY) || errors.Is(errno, unix.EINVAL) {
			return Response{}, fmt.Errorf("%w: SG_IO: %v", ErrNotSCSI, errno)
		}
		return Response{}, fmt.Errorf("SG_IO: %w", errno)
	}
	return Response{
		Status:       Status(h.status),
		Sense:        sense[:min(int(h.sbLenWr), len(sense))],
		Resid:        int(h.resid),
		HostStatus:   h.hostStatus,
		DriverStatus: h.driverStatus,
	}, nil
}
