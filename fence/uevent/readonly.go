package uevent

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// SetReadOnly sets or clears the block layer's read-only flag of the
// device node path (BLKROSET) and reads it back (BLKROGET). When major
// and minor are non-zero, the opened node must be that device: a /dev
// node can be stale after a hot-unplug and replug. With the flag set the
// kernel refuses every write and every read-write open of the device and
// of its partitions, whatever the filesystem or tool; a filesystem
// already mounted read-write stays mounted and gets write errors. It
// needs CAP_SYS_ADMIN.
func SetReadOnly(path string, major, minor uint32, ro bool) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("opening %s to set it read-only: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%s is not a block device", path)
	}
	if (major != 0 || minor != 0) && (unix.Major(st.Rdev) != major || unix.Minor(st.Rdev) != minor) {
		return fmt.Errorf("%s is device %d:%d, not %d:%d: the node is stale; not touching it", path, unix.Major(st.Rdev), unix.Minor(st.Rdev), major, minor)
	}
	v := 0
	if ro {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(fd, unix.BLKROSET, v); err != nil {
		return fmt.Errorf("%s: BLKROSET %d: %w", path, v, err)
	}
	got, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil {
		return fmt.Errorf("%s: BLKROGET: %w", path, err)
	}
	if (got != 0) != ro {
		return fmt.Errorf("%s: read-only flag reads back %d after setting %d", path, got, v)
	}
	return nil
}

// ReadOnly reports the block layer's read-only flag of path (BLKROGET).
func ReadOnly(path string) (bool, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	v, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil {
		return false, fmt.Errorf("%s: BLKROGET: %w", path, err)
	}
	return v != 0, nil
}
