package dmcrypt

import (
	"bytes"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The ioctls github.com/anatol/devmapper.go does not offer in the form
// needed here: its Load keeps only the read-only flag (so no
// DM_SECURE_DATA_FLAG, which makes the kernel wipe the buffer that carried
// the key), its Resume takes no flags (an online resize must resume with
// NOFLUSH|SKIP_LOCKFS), and it cannot read a table back.

const controlPath = "/dev/mapper/control"

// Available reports whether the kernel offers device-mapper, with an error
// that tells the operator what to load when it does not.
func Available() error {
	f, err := os.OpenFile(controlPath, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("device-mapper is not available (%w); load the dm_mod and dm_crypt kernel modules", err)
	}
	return f.Close()
}

func dmIoctl(cmd uintptr, data []byte) error {
	f, err := os.OpenFile(controlPath, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("device-mapper is not available (%w); load the dm_mod and dm_crypt kernel modules", err)
	}
	defer f.Close()
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), cmd, uintptr(unsafe.Pointer(&data[0]))); errno != 0 {
		return errno
	}
	return nil
}

func header(data []byte, name string, flags uint32) *unix.DmIoctl {
	h := (*unix.DmIoctl)(unsafe.Pointer(&data[0]))
	h.Version = [3]uint32{4, 0, 0}
	h.Data_size = uint32(len(data))
	h.Data_start = unix.SizeofDmIoctl
	h.Flags = flags
	copy(h.Name[:], name)
	return h
}

// loadTableFlags loads one target as the inactive table of device name,
// with the secure-data flag so the kernel wipes its copy of the parameters;
// extra may add DM_READONLY_FLAG.
func loadTableFlags(name, target string, startSector, lengthSectors uint64, params []byte, extra uint32) error {
	const align = 8
	plen := (len(params) + 1 + align - 1) / align * align
	data := make([]byte, unix.SizeofDmIoctl+unix.SizeofDmTargetSpec+plen)
	defer clear(data)
	h := header(data, name, unix.DM_SECURE_DATA_FLAG|extra)
	h.Target_count = 1
	spec := (*unix.DmTargetSpec)(unsafe.Pointer(&data[unix.SizeofDmIoctl]))
	spec.Sector_start = startSector
	spec.Length = lengthSectors
	spec.Next = uint32(unix.SizeofDmTargetSpec + plen)
	copy(spec.Target_type[:], target)
	copy(data[unix.SizeofDmIoctl+unix.SizeofDmTargetSpec:], params)
	return dmIoctl(unix.DM_TABLE_LOAD, data)
}

// resume activates the loaded table. With an inactive table present the
// kernel suspends, swaps and resumes in one call; flags may carry
// DM_NOFLUSH_FLAG|DM_SKIP_LOCKFS_FLAG for a live device.
func resume(name string, flags uint32) error {
	data := make([]byte, unix.SizeofDmIoctl)
	h := header(data, name, flags)
	// Ask udev (when it runs) to treat this as the event that makes the
	// device usable, as libdevmapper does for resume.
	h.Event_nr = 0x0040 << 16
	return dmIoctl(unix.DM_DEV_SUSPEND, data)
}

// clearInactive drops a loaded but not yet resumed table.
func clearInactive(name string) error {
	data := make([]byte, unix.SizeofDmIoctl)
	header(data, name, 0)
	return dmIoctl(unix.DM_TABLE_CLEAR, data)
}

// tableTarget is one line of a live table.
type tableTarget struct {
	Start, Length uint64 // sectors
	Type          string
	// Params holds the target's parameters; for crypt they include the
	// key, so callers clear it when done.
	Params []byte
}

// readTable returns the active table of device name. table asks for the
// parameters as loaded (dm-crypt then reports its key); the buffer is
// requested with the secure-data flag and wiped.
func readTable(name string, table bool) ([]tableTarget, error) {
	size := 16 << 10
	for {
		data := make([]byte, size)
		flags := uint32(unix.DM_SECURE_DATA_FLAG)
		if table {
			flags |= unix.DM_STATUS_TABLE_FLAG
		}
		h := header(data, name, flags)
		if err := dmIoctl(unix.DM_TABLE_STATUS, data); err != nil {
			clear(data)
			return nil, err
		}
		if h.Flags&unix.DM_BUFFER_FULL_FLAG != 0 {
			clear(data)
			size *= 4
			if size > 4<<20 {
				return nil, fmt.Errorf("table of %s does not fit in 4 MiB", name)
			}
			continue
		}
		var out []tableTarget
		base := int(h.Data_start)
		off := base
		for i := 0; i < int(h.Target_count); i++ {
			if off+unix.SizeofDmTargetSpec > len(data) {
				break
			}
			spec := (*unix.DmTargetSpec)(unsafe.Pointer(&data[off]))
			p := data[off+unix.SizeofDmTargetSpec:]
			if j := bytes.IndexByte(p, 0); j >= 0 {
				p = p[:j]
			}
			tt := spec.Target_type[:]
			if j := bytes.IndexByte(tt, 0); j >= 0 {
				tt = tt[:j]
			}
			out = append(out, tableTarget{Start: spec.Sector_start, Length: spec.Length, Type: string(tt), Params: bytes.Clone(p)})
			off = base + int(spec.Next)
		}
		clear(data)
		return out, nil
	}
}
