package inuse

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// node is a device by its type (block or character) and number.
type node struct {
	char bool
	dev  uint64
}

// nodes is every device that reaches a disk, by type and number: the
// disk, its partitions, its SCSI generic nodes.
type nodes map[node]blockDev

// add puts d among n; a device number that does not parse is left out.
func (n nodes) add(d blockDev) {
	var maj, min uint32
	if _, err := fmt.Sscanf(d.devnum, "%d:%d", &maj, &min); err == nil {
		n[node{char: d.char, dev: unix.Mkdev(maj, min)}] = d
	}
}

// of is the device among n that stx (a file's attributes) is a node of.
func (n nodes) of(stx *unix.Statx_t) (blockDev, bool) {
	var k node
	switch uint32(stx.Mode) & unix.S_IFMT {
	case unix.S_IFBLK:
	case unix.S_IFCHR:
		k.char = true
	default:
		return blockDev{}, false
	}
	k.dev = unix.Mkdev(stx.Rdev_major, stx.Rdev_minor)
	d, ok := n[k]
	return d, ok
}

// genericNodes are the character devices through which SCSI commands
// reach the disk name, a write among them: its sg node
// (device/scsi_generic/sgN) and its bsg node (device/bsg/H:C:T:L), as
// sysfs lists them under the disk. A disk that is not SCSI (virtio-blk,
// loop) has none.
func genericNodes(sysfsRoot, name string) ([]blockDev, error) {
	var devs []blockDev
	for _, class := range []string{"scsi_generic", "bsg"} {
		dir := filepath.Join(sysfsRoot, "class", "block", name, "device", class)
		ents, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing the SCSI generic nodes of %s: %w", name, err)
		}
		for _, e := range ents {
			dev, err := os.ReadFile(filepath.Join(dir, e.Name(), "dev"))
			if err != nil {
				return nil, fmt.Errorf("reading the device number of %s, a SCSI generic node of %s: %w", e.Name(), name, err)
			}
			devs = append(devs, blockDev{name: e.Name(), devnum: strings.TrimSpace(string(dev)), char: true})
		}
	}
	return devs, nil
}
