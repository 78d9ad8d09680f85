// Package inuse proves that nothing of this host uses a disk: no data
// mapping over it, nothing stacked on it (dm-crypt, md, another mapping)
// and no mount of it. The agent's release guard (agent/volume) and
// `vco-agent lease clear` give a disk's fence up only after this proof
// (docs/architecture.md, "The release guard"). It reads sysfs and
// /proc/self/mountinfo; nothing here writes.
package inuse

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

// Disk proves that nothing of this host uses the block device at path:
// no loop device maps its data area, nothing is stacked on it (its sysfs
// holders), and it is mounted nowhere in this mount namespace. A proof
// that cannot be made (sysfs or the mount table unreadable) is an error
// too: the caller keeps the fence.
func Disk(sysfsRoot, path string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%s is not a block device", path)
	}
	name := filepath.Base(path)
	if real, err := filepath.EvalSymlinks(path); err == nil {
		name = filepath.Base(real)
	}
	if data, err := lease.FindData(sysfsRoot, path); err != nil {
		return fmt.Errorf("%s: looking for a mapping of its data area: %w", path, err)
	} else if data != "" {
		return &Error{Device: path, What: "its data area is mapped at " + data}
	}
	if h, err := Holders(sysfsRoot, name); err != nil {
		return err
	} else if len(h) > 0 {
		return &Error{Device: path, What: h[0] + " is stacked on it"}
	}
	devnum := fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	at, err := Mounted(devnum)
	if err != nil {
		return err
	}
	if at != "" {
		return &Error{Device: path, What: "it is mounted at " + at}
	}
	return nil
}

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
