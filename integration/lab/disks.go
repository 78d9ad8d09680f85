package lab

import (
	"context"
	"fmt"
	"strings"
)

// GuestDisk is a block device as a guest sees it.
type GuestDisk struct {
	Name   string // sda, vda
	SG     string // sg0, for SCSI disks
	Serial string // VPD 0x80 unit serial number (SCSI) or virtio-blk serial
	WWID   string // SCSI only: the kernel's /sys/block/X/device/wwid
}

// listDisksScript prints one line per block device:
// name|sg|serial|wwid. The guest runs no udev, so it reads sysfs directly.
const listDisksScript = `for b in /sys/block/sd* /sys/block/vd*; do
	[ -e "$b" ] || continue
	n=${b##*/}; sg=; ser=; wwid=
	if [ -d "$b/device/scsi_generic" ]; then sg=$(ls "$b/device/scsi_generic" | head -n1); fi
	if [ -r "$b/serial" ]; then ser=$(cat "$b/serial"); fi
	if [ -z "$ser" ] && [ -r "$b/device/vpd_pg80" ]; then ser=$(tail -c +5 "$b/device/vpd_pg80" | tr -d '\000'); fi
	if [ -r "$b/device/wwid" ]; then wwid=$(cat "$b/device/wwid"); fi
	echo "$n|$sg|$ser|$wwid"
done`

// Disks lists the guest's SCSI and virtio-blk disks.
func (g *Guest) Disks(ctx context.Context) ([]GuestDisk, error) {
	out, err := g.MustSh(ctx, listDisksScript)
	if err != nil {
		return nil, err
	}
	var ds []GuestDisk
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Split(line, "|")
		if len(f) != 4 {
			continue
		}
		ds = append(ds, GuestDisk{Name: f[0], SG: f[1], Serial: strings.TrimSpace(f[2]), WWID: strings.TrimSpace(f[3])})
	}
	return ds, nil
}

// DiskBySerial finds the guest's disk with the given serial.
func (g *Guest) DiskBySerial(ctx context.Context, serial string) (*GuestDisk, error) {
	ds, err := g.Disks(ctx)
	if err != nil {
		return nil, err
	}
	var seen []string
	for _, d := range ds {
		if d.Serial == serial {
			return &d, nil
		}
		seen = append(seen, fmt.Sprintf("%s (serial %q)", d.Name, d.Serial))
	}
	return nil, fmt.Errorf("guest %s has no disk with serial %q; it has %v", g.Name, serial, seen)
}

// WaitDiskBySerial polls until the disk appears (after a hot-plug, the
// guest's SCSI scan or PCI probe takes a moment).
func (g *Guest) WaitDiskBySerial(ctx context.Context, serial string) (*GuestDisk, error) {
	var last error
	for {
		d, err := g.DiskBySerial(ctx, serial)
		if err == nil {
			return d, nil
		}
		last = err
		if _, err := g.Sh(ctx, "sleep 0.5"); err != nil || ctx.Err() != nil {
			return nil, fmt.Errorf("%w (last: %v)", ctx.Err(), last)
		}
	}
}
