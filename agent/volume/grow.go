package volume

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// A volume's filesystem can be smaller than the device it is staged on: a
// volume restored from a snapshot or cloned into a larger disk carries its
// source's filesystem, and a disk grown while no node had it staged (or an
// adopted disk of the earlier driver, grown to make room for the lease)
// has room past its filesystem. The stage grows the filesystem to fill its
// device, as ExpandVolume would, so that the pod sees the capacity its
// claim was given (docs/storage.md).
//
// ext4 grows online only for a caller with CAP_SYS_RESOURCE, which the
// packaged unit grants; an agent without it grows ext4 before the mount,
// offline, after the full check resize2fs asks for. xfs grows only while
// mounted and needs no such capability. What the growers cannot do (a
// bigalloc ext4 offline, a 32-bit ext4 past 2^32 blocks) is left as it is,
// and said in the log; a volume mounted read-only is never grown.

// fsExtent is what a filesystem's superblock says of its size: the bytes
// it spans, and the least shortfall against its device worth growing for
// (the growers leave a smaller tail unused, a last group or allocation
// group too small for its own metadata).
type fsExtent struct {
	size, slack int64
	blockSize   int64
	// offlineLimit, when not zero, is the most blocks resize2fs grows
	// this filesystem to unmounted; bigalloc says resize2fs refuses it.
	offlineLimit int64
	bigalloc     bool
}

// readExtent reads the superblock of the fsType filesystem on device.
func readExtent(device, fsType string) (fsExtent, error) {
	f, err := os.OpenFile(device, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fsExtent{}, err
	}
	defer f.Close()
	sb := make([]byte, 4096)
	if _, err := f.ReadAt(sb, 0); err != nil {
		return fsExtent{}, fmt.Errorf("reading the superblock on %s: %w", device, err)
	}
	switch fsType {
	case "ext4":
		return ext4Extent(sb[1024:2048])
	case "xfs":
		return xfsExtent(sb[:512])
	}
	return fsExtent{}, fmt.Errorf("the agent does not grow %s filesystems", fsType)
}

// ext4Extent reads an ext2/3/4 superblock (1024 bytes from its byte 1024).
// resize2fs leaves a last group unused that cannot hold the group's own
// metadata (inode table, bitmaps, a backup superblock and descriptors) and
// 50 blocks more; the slack is that bound.
func ext4Extent(sb []byte) (fsExtent, error) {
	le := binary.LittleEndian
	if le.Uint16(sb[0x38:]) != 0xef53 {
		return fsExtent{}, errors.New("no ext4 superblock")
	}
	logBlock := le.Uint32(sb[0x18:])
	perGroup := int64(le.Uint32(sb[0x20:]))
	if logBlock > 6 || perGroup == 0 { // blocks of 1 KiB to 64 KiB
		return fsExtent{}, fmt.Errorf("an ext4 superblock with a block size of 2^(10+%d) and %d blocks per group", logBlock, perGroup)
	}
	e := fsExtent{blockSize: int64(1024) << logBlock}
	blocks := int64(le.Uint32(sb[0x04:]))
	descSize := int64(32)
	if le.Uint32(sb[0x60:])&0x80 != 0 { // INCOMPAT_64BIT
		blocks |= int64(le.Uint32(sb[0x150:])) << 32
		descSize = max(int64(le.Uint16(sb[0xfe:])), 32)
	} else {
		e.offlineLimit = 1<<32 - 1
	}
	e.bigalloc = le.Uint32(sb[0x64:])&0x200 != 0 // RO_COMPAT_BIGALLOC
	inodeSize := int64(le.Uint16(sb[0x58:]))
	if le.Uint32(sb[0x4c:]) == 0 { // revision 0: fixed inode size
		inodeSize = 128
	}
	groups := (blocks + perGroup - 1) / perGroup
	descBlocks := (groups*descSize + e.blockSize - 1) / e.blockSize
	meta := int64(le.Uint32(sb[0x28:]))*inodeSize/e.blockSize + 2 + 1 + descBlocks + int64(le.Uint16(sb[0xce:]))
	e.size, e.slack = blocks*e.blockSize, (meta+50)*e.blockSize
	return e, nil
}

// xfsExtent reads an xfs superblock (its first sector). xfs_growfs leaves
// a tail unused that is too small for an allocation group of 64 blocks.
func xfsExtent(sb []byte) (fsExtent, error) {
	be := binary.BigEndian
	if string(sb[:4]) != "XFSB" {
		return fsExtent{}, errors.New("no xfs superblock")
	}
	bs := int64(be.Uint32(sb[4:]))
	if bs < 512 || bs > 65536 || bs&(bs-1) != 0 {
		return fsExtent{}, fmt.Errorf("an xfs superblock with a block size of %d", bs)
	}
	return fsExtent{size: int64(be.Uint64(sb[8:])) * bs, slack: 64 * bs, blockSize: bs}, nil
}

// errLargerThanDevice is a filesystem that spans more than its device.
var errLargerThanDevice = errors.New("the filesystem spans more than its device")

// shortOf says how much of device the fsType filesystem on it leaves
// unused, when that is worth growing for; 0 when it fills the device, or
// when device is no block device (a host test's image file).
func shortOf(device, fsType string) (short int64, e fsExtent, err error) {
	var st unix.Stat_t
	if err := unix.Stat(device, &st); err != nil {
		return 0, e, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, e, nil
	}
	size, err := deviceSize(device)
	if err != nil {
		return 0, e, err
	}
	if e, err = readExtent(device, fsType); err != nil {
		return 0, e, err
	}
	switch {
	case e.size > size:
		return 0, e, fmt.Errorf("%w: %d bytes on a device of %d", errLargerThanDevice, e.size, size)
	case size-e.size <= e.slack:
		return 0, e, nil
	}
	return size - e.size, e, nil
}

// growUnmounted grows the ext4 filesystem on the unmounted device when it
// is short of the device and this agent cannot grow it online. The check
// and the growth run to their end even when the caller gives up: a full
// check of a large filesystem can outlast the kubelet's call, and one cut
// short would start over on every retry.
func (m *Manager) growUnmounted(ctx context.Context, c *Claim, device string) error {
	if c.FsType != "ext4" || readOnlyMount(c) || growsExt4Online() {
		return nil
	}
	short, e, err := m.host.Short(device, c.FsType)
	if err != nil || short == 0 {
		return m.unknownSize(c, device, err)
	}
	switch {
	case e.bigalloc:
		m.log.Warn("the filesystem is smaller than its device and is not grown: resize2fs does not grow a bigalloc ext4 unmounted, and this agent lacks CAP_SYS_RESOURCE to grow it mounted",
			"volume", c.Volume, "device", device, "bytes", e.size, "unused", short)
		return nil
	case e.offlineLimit > 0 && (e.size+short)/e.blockSize > e.offlineLimit:
		m.log.Warn("the filesystem is smaller than its device and is not grown: a 32-bit ext4 cannot span more than 2^32 blocks",
			"volume", c.Volume, "device", device, "bytes", e.size, "unused", short)
		return nil
	}
	ctx = context.WithoutCancel(ctx)
	// resize2fs grows an unmounted ext4 only after a full check.
	out, err := exec.CommandContext(ctx, "e2fsck", "-f", "-p", device).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee) && ee.ExitCode() == 1:
		m.log.Info("e2fsck corrected errors on the filesystem before growing it", "volume", c.Volume, "device", device)
	case errors.As(err, &ee) && ee.ExitCode() >= 4:
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the ext4 filesystem on %s is smaller than its device, and the full check before growing it found errors it could not correct; repair the filesystem by hand (e2fsck -f %s): %s",
			c.Volume, device, device, strings.TrimSpace(string(out)))
	default:
		return m.notGrown(c, device, e, short, fmt.Errorf("e2fsck -f: %v: %s", err, strings.TrimSpace(string(out))))
	}
	if err := m.host.Resize(device, ""); err != nil {
		return m.notGrown(c, device, e, short, err)
	}
	m.log.Info("grew the filesystem to fill its device, unmounted (no CAP_SYS_RESOURCE to grow ext4 online)",
		"volume", c.Volume, "device", device, "fs", c.FsType, "from", e.size, "by", short)
	return nil
}

// growMounted grows the filesystem mounted at the staging path when it is
// short of its device.
func (m *Manager) growMounted(c *Claim, device string) error {
	if readOnlyMount(c) || c.FsType == "ext4" && !growsExt4Online() {
		return nil // ext4 without the capability grew unmounted
	}
	short, e, err := m.host.Short(device, c.FsType)
	if err != nil || short == 0 {
		return m.unknownSize(c, device, err)
	}
	var before, after unix.Statfs_t
	_ = unix.Statfs(c.StagingPath, &before)
	if err := m.host.Resize(device, c.StagingPath); err != nil {
		return m.notGrown(c, device, e, short, err)
	}
	if err := unix.Statfs(c.StagingPath, &after); err == nil && after.Blocks == before.Blocks {
		// What the superblock on the device said was stale (an xfs
		// whose log the mount replayed): it had nothing to grow.
		return nil
	}
	m.log.Info("grew the filesystem to fill its device", "volume", c.Volume, "device", device, "fs", c.FsType, "from", e.size, "by", short)
	return nil
}

// readOnlyMount reports whether the volume's filesystem is mounted
// read-only: a read-only stage, or ro among its mount flags.
func readOnlyMount(c *Claim) bool { return c.ReadOnly || slices.Contains(c.MountFlags, "ro") }

// unknownSize answers for a filesystem whose size could not be compared
// with its device's: one larger than its device is refused (the disk
// shrank, or is not this volume's); otherwise the volume is mounted as it
// is, and the log says why it was not grown.
func (m *Manager) unknownSize(c *Claim, device string, err error) error {
	if errors.Is(err, errLargerThanDevice) {
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: the %s filesystem on %s is larger than the device (%v): the disk shrank, or is not this volume's disk; check the disk attached as %s",
			c.Volume, c.FsType, device, err, device)
	}
	if err != nil {
		m.log.Warn("could not tell whether the filesystem fills its device; it is mounted as it is", "volume", c.Volume, "device", device, "err", err)
	}
	return nil
}

func (m *Manager) notGrown(c *Claim, device string, e fsExtent, short int64, err error) error {
	return agenterr.New(agenterr.Internal,
		"volume %s: the %s filesystem on %s spans %d bytes and leaves %d bytes of its device unused (a volume restored or cloned into a larger disk, or a disk grown while not staged); growing it failed: %v. The stage is retried; if it keeps failing, grow the filesystem by hand",
		c.Volume, c.FsType, device, e.size, short, err)
}

// growsExt4Online is CanGrowExt4Online; tests make it false to take the
// unmounted path.
var growsExt4Online = CanGrowExt4Online

// CanGrowExt4Online reports whether this process has CAP_SYS_RESOURCE,
// which the kernel asks of a caller growing a mounted ext4
// (EXT4_IOC_RESIZE_FS).
func CanGrowExt4Online() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if unix.Capget(&hdr, &data[0]) != nil {
		return false
	}
	return data[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) != 0
}
