// Package inuse proves that nothing of this host uses a disk or a
// partition of it: no loop device over it, nothing stacked on it
// (dm-crypt, md, another mapping), no mount of it and no other process
// holding it open for writing, mapping it shared and writable or having
// it registered with an io_uring. The agent's release guard (agent/volume) and
// `vco-agent lease clear` give a disk's fence up only after this proof
// (docs/architecture.md, "The release guard"). It reads sysfs,
// /proc/self/mountinfo and the open and mapped files of this host's
// processes (/proc/PID/task/TID/fd and fdinfo, /proc/PID/maps, smaps);
// nothing here writes. Written here, as no library reads these.
package inuse

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// Error names what uses a disk.
type Error struct {
	Device string
	// What is in use, as a sentence's object: "mounted at /x",
	// "its data area is mapped at /dev/loop3", ...
	What string
}

func (e *Error) Error() string { return fmt.Sprintf("%s is in use: %s", e.Device, e.What) }

// Disk proves that nothing of this host uses the block device at path
// or any partition of it: no loop device maps it (at any offset: the
// lease's data mapping, the kubelet's loop over a raw block volume's
// device, an operator's; also one whose backing path names nothing or
// another thing in this mount namespace, which is asked what it maps:
// boundLoops), nothing is stacked on it (its sysfs holders, and
// each partition's: a holder of a partition is not listed under the
// disk), it is mounted nowhere in this mount namespace, no other process
// of this host holds it open for writing or maps it shared and writable
// (writer), and the kernel
// lets it be opened exclusively (which it refuses while the disk or a
// partition of it is mounted in any mount namespace or claimed by a
// driver). A proof that cannot be made (sysfs or the mount table
// unreadable) is an error too: the caller keeps the fence.
func Disk(sysfsRoot, path string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%s is not a block device", path)
	}
	dn := devnum(st.Rdev)
	devs, err := withPartitions(sysfsRoot, sysfsName(sysfsRoot, path, dn), dn)
	if err != nil {
		return err
	}
	loops, err := boundLoops(sysfsRoot)
	if err != nil {
		return err
	}
	for _, d := range devs {
		if what, err := d.used(sysfsRoot, loops); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		} else if what != "" {
			return &Error{Device: path, What: what}
		}
	}
	generic, err := genericNodes(sysfsRoot, devs[0].name)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if what, err := writer(append(devs, generic...)); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	} else if what != "" {
		return &Error{Device: path, What: what}
	}
	return exclusive(path)
}

// sysfsName is the kernel's name of the block device devnum (sysfs
// dev/block/MAJ:MIN), which is not always its node's base name (a
// DEVNAME with a directory, such as etherd/e0.0, is etherd!e0.0 there),
// found by its link there or by the dev file of class/block's entries;
// the node's name where sysfs does not say.
func sysfsName(sysfsRoot, path, devnum string) string {
	if real, err := filepath.EvalSymlinks(filepath.Join(sysfsRoot, "dev", "block", devnum)); err == nil {
		return filepath.Base(real)
	}
	ents, _ := os.ReadDir(filepath.Join(sysfsRoot, "class", "block"))
	for _, e := range ents {
		if b, err := os.ReadFile(filepath.Join(sysfsRoot, "class", "block", e.Name(), "dev")); err == nil && strings.TrimSpace(string(b)) == devnum {
			return e.Name()
		}
	}
	if real, err := filepath.EvalSymlinks(path); err == nil {
		return filepath.Base(real)
	}
	return filepath.Base(path)
}

// exclusive proves that nothing holds the disk at path as its own: the
// kernel refuses an exclusive open (EBUSY) while the disk or a partition
// of it is mounted in any mount namespace (a pod's or a service's copy of
// a mount the agent took down in its own) or claimed by a driver. A
// device that is gone (ENXIO, ENODEV) holds nothing.
func exclusive(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	switch {
	case err == nil:
		return unix.Close(fd)
	case errors.Is(err, unix.EBUSY):
		return &Error{Device: path, What: "the kernel refuses to open it exclusively: it or a partition of it is mounted in another mount namespace, or claimed by a driver"}
	case errors.Is(err, unix.ENXIO), errors.Is(err, unix.ENODEV):
		return nil
	}
	return fmt.Errorf("opening %s exclusively: %w", path, err)
}

// blockDev is a disk or one of its partitions, by its sysfs name and its
// device number (major:minor); or, char set, a character device that
// reaches the disk (its SCSI generic node: genericNodes).
type blockDev struct {
	name, devnum string
	partition    bool
	char         bool
}

// used says what of this host uses d, or "".
func (d blockDev) used(sysfsRoot string, loops []loop) (string, error) {
	of := ""
	if d.partition {
		of = " its partition " + d.name + ":"
	}
	for _, l := range loops {
		if l.over(d.devnum) {
			if !d.partition && l.offset == strconv.Itoa(lease.DataOffset) {
				return "its data area is mapped at /dev/" + l.name, nil
			}
			return strings.TrimSpace(fmt.Sprintf("%s /dev/%s maps it at offset %s", of, l.name, l.offset)), nil
		}
	}
	if h, err := Holders(sysfsRoot, d.name); err != nil {
		return "", err
	} else if len(h) > 0 {
		return strings.TrimSpace(of + " " + h[0] + " is stacked on it"), nil
	}
	at, err := Mounted(d.devnum)
	if err != nil {
		return "", err
	}
	if at != "" {
		return strings.TrimSpace(of + " it is mounted at " + at), nil
	}
	return "", nil
}

// withPartitions is the disk name (device number devnum) and each of its
// partitions, as sysfs lists them: a subdirectory of the disk's that has
// a "partition" file, its device number in "dev".
func withPartitions(sysfsRoot, name, devnum string) ([]blockDev, error) {
	devs := []blockDev{{name: name, devnum: devnum}}
	ents, err := os.ReadDir(filepath.Join(sysfsRoot, "class", "block", name))
	if errors.Is(err, os.ErrNotExist) {
		return devs, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the partitions of %s: %w", name, err)
	}
	for _, e := range ents {
		dir := filepath.Join(sysfsRoot, "class", "block", name, e.Name())
		if _, err := os.Stat(filepath.Join(dir, "partition")); err != nil {
			continue
		}
		dev, err := os.ReadFile(filepath.Join(dir, "dev"))
		if err != nil {
			return nil, fmt.Errorf("reading the device number of %s, a partition of %s: %w", e.Name(), name, err)
		}
		devs = append(devs, blockDev{name: e.Name(), devnum: strings.TrimSpace(string(dev)), partition: true})
	}
	return devs, nil
}

// loop is a bound loop device: its name, the device numbers of what it
// may map (its backing file's, as its path and as the kernel tell it),
// and its offset.
type loop struct {
	name, offset string
	backing      []string
}

// over reports whether l may map the device devnum.
func (l loop) over(devnum string) bool {
	for _, b := range l.backing {
		if b == devnum {
			return true
		}
	}
	return false
}

// boundLoops lists the bound loop devices over a block device. sysfs
// shows a loop device's backing file by its path, which is no proof of
// what it maps: the path of a node removed since ("(deleted)"), of a bind
// mount detached lazily ("/", the detached mount's root), of a mount in
// another mount namespace, or of a node another mount hides, names no
// device or another one in this mount namespace. So each loop device is
// also asked what it maps (loopDevice, the kernel's word): it counts for
// the device its path names, and for the device the kernel names unless
// it no longer reaches one (loopLive), as one over a disk that left does
// not (its device number may be a new disk's now).
func boundLoops(sysfsRoot string) ([]loop, error) {
	dirs, err := filepath.Glob(filepath.Join(sysfsRoot, "block", "loop*"))
	if err != nil {
		return nil, err
	}
	var out []loop
	for _, dir := range dirs {
		name := filepath.Base(dir)
		back, err := os.ReadFile(filepath.Join(dir, "loop", "backing_file"))
		if errors.Is(err, os.ErrNotExist) {
			continue // not bound
		}
		if err != nil {
			return nil, fmt.Errorf("reading the backing file of %s: %w", name, err)
		}
		l := loop{name: name}
		path := strings.TrimSpace(string(back))
		if l.backing, err = loopBackings(name, path); err != nil {
			return nil, err
		}
		if len(l.backing) == 0 {
			continue // a regular file's, or detached since
		}
		off, err := os.ReadFile(filepath.Join(dir, "loop", "offset"))
		if err != nil {
			return nil, fmt.Errorf("reading the offset of %s: %w", name, err)
		}
		l.offset = strings.TrimSpace(string(off))
		out = append(out, l)
	}
	return out, nil
}

// loopBackings is the device numbers the loop device name, whose backing
// file sysfs names path, may map: the block device path names, and the
// one the kernel names while the loop device still reaches it. A kernel
// that cannot be asked leaves the path's word, or, when the path names no
// block device, the proof unmade (unless the loop device was detached
// since: ENXIO).
func loopBackings(name, path string) ([]string, error) {
	var out []string
	var pdev uint64
	var st unix.Stat_t
	if unix.Stat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
		pdev = st.Rdev
		out = append(out, devnum(pdev))
	}
	rdev, err := loopDevice(name)
	switch {
	case err != nil && (pdev != 0 || errors.Is(err, unix.ENXIO)):
		return out, nil
	case err != nil:
		return nil, fmt.Errorf("%s maps %s, which names no block device here, and what it maps cannot be told: %w", name, path, err)
	case rdev == 0 || rdev == pdev:
		// A regular file's (the kernel's rdev of one is 0), or the
		// device the path names.
		return out, nil
	}
	if loopLive(name) {
		out = append(out, devnum(rdev))
	}
	return out, nil
}

func devnum(rdev uint64) string {
	return fmt.Sprintf("%d:%d", unix.Major(rdev), unix.Minor(rdev))
}

// loopDevice asks the loop device name (under /dev) the device number
// of its backing file (LOOP_GET_STATUS64's lo_rdevice: 0 for a regular
// file). loopLive reports whether it still reaches a device: a read of
// its first block fails once the device it maps has left. Variables so
// that tests over a fake sysfs answer for devices this host does not
// have.
var (
	loopDevice = func(name string) (uint64, error) {
		f, err := os.Open(filepath.Join("/dev", name))
		if err != nil {
			return 0, err
		}
		defer f.Close()
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		if err != nil {
			return 0, err
		}
		return info.Rdevice, nil
	}
	loopLive = func(name string) bool {
		f, err := os.Open(filepath.Join("/dev", name))
		if err != nil {
			return false
		}
		defer f.Close()
		_, err = f.ReadAt(make([]byte, 512), 0)
		return err == nil
	}
)

// Holders lists what is stacked on the block device name (sysfs
// class/block/NAME/holders); a device sysfs does not know has none.
func Holders(sysfsRoot, name string) ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(sysfsRoot, "class", "block", name, "holders"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the holders of %s: %w", name, err)
	}
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}

// Mounted returns a mount point of the device devnum (major:minor) in
// this mount namespace, or "".
func Mounted(devnum string) (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && fields[2] == devnum {
			return fields[4], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("reading /proc/self/mountinfo: %w", err)
	}
	return "", nil
}
