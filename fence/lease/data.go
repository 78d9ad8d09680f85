package lease

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Data is the volume's data area of a lease disk, seen through a loop
// device that starts at DataOffset: what the agent formats, mounts, opens
// LUKS2 on, or hands out as a raw block volume. A loop device exists on
// every Linux host, unlike device-mapper; where the agent has
// device-mapper it may map the same range with dm-linear instead.
//
// The loop device uses direct I/O where the disk allows it (no second page
// cache) and autoclear: it goes away when the last user (the mount, the
// dm-crypt mapping) closes it, so an unmounted volume leaves nothing behind.
type Data struct {
	// Path is the loop device, e.g. /dev/loop3.
	Path string
	// Disk is the lease disk it maps.
	Disk string
	f    *os.File
}

// MapData maps the data area of disk (a device carrying our lease area)
// to a new loop device. It is returned open; Close drops the agent's
// reference, after which the mapping lives as long as something uses it.
func MapData(disk string) (*Data, error) {
	hdr, err := readHeader(disk)
	if err != nil {
		return nil, err
	}
	if hdr.DataOffset != DataOffset {
		return nil, fmt.Errorf("%s: data offset %d is not %d", disk, hdr.DataOffset, DataOffset)
	}
	back, err := os.OpenFile(disk, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening %s to map its data area: %w", disk, err)
	}
	defer back.Close()
	ssz := 512
	if v, err := unix.IoctlGetInt(int(back.Fd()), unix.BLKSSZGET); err == nil {
		ssz = v
	}
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("mapping the data area of %s: %w", disk, err)
	}
	defer ctl.Close()
	// Another process may take the free device between asking and
	// configuring it; LOOP_CONFIGURE then fails with EBUSY and we ask again.
	for range 10 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("mapping the data area of %s: no free loop device: %w", disk, err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		f, err := openLoop(path)
		if err != nil {
			return nil, err
		}
		cfg := unix.LoopConfig{Fd: uint32(back.Fd()), Size: uint32(ssz)}
		cfg.Info.Offset = DataOffset
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
		copy(cfg.Info.File_name[:], disk)
		err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		if errors.Is(err, unix.EINVAL) {
			// Direct I/O is refused when the backing device cannot do it
			// at this alignment; buffered is still correct.
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO
			err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		}
		if errors.Is(err, unix.EBUSY) {
			f.Close()
			continue
		}
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("mapping the data area of %s to %s: LOOP_CONFIGURE: %w", disk, path, err)
		}
		return &Data{Path: path, Disk: disk, f: f}, nil
	}
	return nil, fmt.Errorf("mapping the data area of %s: every free loop device was taken by others; try again", disk)
}

func openLoop(path string) (*os.File, error) {
	var f *os.File
	var err error
	// udev may not have made the node yet for a device just created.
	for range 50 {
		f, err = os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
		if !errors.Is(err, os.ErrNotExist) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	return f, nil
}

func readHeader(disk string) (Header, error) {
	d, err := OpenDevice(disk)
	if err != nil {
		return Header{}, err
	}
	defer d.Close()
	b, err := d.read(context.Background(), 0, BlockSize, DefaultTiming().IOTimeout)
	if err != nil {
		return Header{}, err
	}
	h, err := DecodeHeader(b)
	if err != nil {
		return Header{}, fmt.Errorf("%s: %w", disk, err)
	}
	return h, nil
}

// Resize makes the mapping follow the disk after it grew (online
// expansion): LOOP_SET_CAPACITY re-reads the backing size. The filesystem
// or dm-crypt mapping on top is grown after it, as on any disk.
func (d *Data) Resize() error {
	if err := unix.IoctlSetInt(int(d.f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("%s (data area of %s): LOOP_SET_CAPACITY: %w", d.Path, d.Disk, err)
	}
	return nil
}

// Close drops the agent's descriptor; with autoclear the mapping goes
// away once nothing else holds it.
func (d *Data) Close() error { return d.f.Close() }

// FindData finds the loop device that maps disk's data area, after an
// agent restart. It compares the backing device number and the offset
// in sysfs; "" means none.
func FindData(sysfsRoot, disk string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(disk, &st); err != nil {
		return "", err
	}
	want := fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	loops, _ := filepath.Glob(filepath.Join(sysfsRoot, "block", "loop*"))
	for _, l := range loops {
		off, err := os.ReadFile(filepath.Join(l, "loop", "offset"))
		if err != nil || strings.TrimSpace(string(off)) != strconv.Itoa(DataOffset) {
			continue
		}
		// The backing device number is in the loop's status; sysfs gives
		// the backing file's path, which for a block device is its node.
		back, err := os.ReadFile(filepath.Join(l, "loop", "backing_file"))
		if err != nil {
			continue
		}
		var bst unix.Stat_t
		if unix.Stat(strings.TrimSpace(string(back)), &bst) != nil {
			continue
		}
		if fmt.Sprintf("%d:%d", unix.Major(bst.Rdev), unix.Minor(bst.Rdev)) == want {
			return "/dev/" + filepath.Base(l), nil
		}
	}
	return "", nil
}
