// Package fencecaps tells which fencing methods this host can use, from
// what sysfs shows: SCSI-3 persistent reservations need SCSI disks that
// accept SG_IO. The agent reports this in GetIdentity so that an operator
// sees, before any volume is staged, whether disks here can be fenced by
// the storage target. The on-disk lease (fence/lease) needs nothing but
// the disk and loop devices, which every Linux host has.
package fencecaps

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Capability is one method and whether this host has what it needs.
type Capability struct {
	Method    fence.Method
	Available bool
	Detail    string
}

// Detect looks at the block devices under sysfsRoot.
func Detect(sysfsRoot string) []Capability {
	return []Capability{detectPR(sysfsRoot), {
		Method: fence.MethodLease, Available: true,
		Detail: "disks without reservations are fenced by an on-disk lease on volumes the agent formats; " +
			"it is kept by this node's agent and watchdog, not enforced by the storage",
	}}
}

// detectPR lists whole disks driven by the SCSI disk layer: those have a
// scsi_device under their device link and answer SG_IO on their block
// node. virtio-blk disks do not.
func detectPR(sysfsRoot string) Capability {
	c := Capability{Method: fence.MethodPR}
	dir := filepath.Join(sysfsRoot, "class", "block")
	ents, err := os.ReadDir(dir)
	if err != nil {
		c.Detail = fmt.Sprintf("cannot list block devices in %s: %v", dir, err)
		return c
	}
	var scsi []string
	for _, e := range ents {
		if _, err := os.Stat(filepath.Join(dir, e.Name(), "partition")); err == nil {
			continue
		}
		if st, err := os.Stat(filepath.Join(dir, e.Name(), "device", "scsi_device")); err == nil && st.IsDir() {
			scsi = append(scsi, e.Name())
		}
	}
	sort.Strings(scsi)
	if len(scsi) == 0 {
		c.Detail = "no SCSI disks (SG_IO targets) found under " + dir
		return c
	}
	c.Available = true
	c.Detail = "SG_IO-capable SCSI disks: " + strings.Join(scsi, ", ")
	return c
}
