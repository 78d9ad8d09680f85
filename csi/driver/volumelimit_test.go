package driver_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// withBootDisk shows every VM with a boot disk (id bootDiskID, type BOOT),
// which the simulator does not model: the platform's VM listing names a
// VM's boot disk among its disks.
type withBootDisk struct{ driver.Cloud }

const bootDiskID = 990001

func (c withBootDisk) ListVMs(ctx context.Context, cs string) ([]cloud.VM, error) {
	vms, err := c.Cloud.ListVMs(ctx, cs)
	for i := range vms {
		vms[i].Disks = append(vms[i].Disks, bootDiskID)
	}
	return vms, err
}

func (c withBootDisk) ListDisks(ctx context.Context, loc string) ([]cloud.Disk, error) {
	ds, err := c.Cloud.ListDisks(ctx, loc)
	return append(ds, cloud.Disk{ID: bootDiskID, Name: "boot", Type: cloud.DiskTypeBoot, SizeGiB: 20}), err
}

// TestVolumeLimitLeavesOutOtherDisks: a node's volume limit is the data
// disks the platform attaches to a VM (24) less the VM's data disks that
// are not volumes of this driver (here an etcd disk); its boot disk and
// the driver's own volumes take none of it. The controller publishes the
// limit with the location, and NodeGetInfo reports it.
func TestVolumeLimitLeavesOutOtherDisks(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	// The node's etcd disk, attached by its cluster's provisioner.
	etcd, err := e.api.CreateDisk(ctx, hostLoc, cloud.DiskSpec{Name: "etcd", Description: "etcd of node 0", SizeGiB: 8})
	if err != nil {
		t.Fatal(err)
	}
	var host cloud.VM
	for _, vm := range vmsOf(t, e, hostLoc) {
		if vm.ReferenceID == hostUUID {
			host = vm
		}
	}
	if err := e.api.AttachDisk(ctx, "cs-"+hostLoc, host.ID, etcd); err != nil {
		t.Fatal(err)
	}
	// A volume of ours on the same node.
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "ours"})
	publishTo(t, e, id, hostUUID)

	ctrl, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeController, Cloud: withBootDisk{e.api}})
	if err != nil {
		t.Fatal(err)
	}
	m, err := ctrl.NodeLocationMap(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := m[hostUUID+driver.MaxVolumesSuffix]; got != "23" {
		t.Fatalf("the controller's map gives this node %q volumes; want 23 (24 less the etcd disk; the boot disk and our volume take none)", got)
	}
	for ref := range m {
		if filepath.Ext(ref) == "" && m[ref+driver.MaxVolumesSuffix] == "" {
			t.Errorf("VM %s has a location but no volume limit in the map", ref)
		}
	}
	dir := filepath.Join(t.TempDir(), "map")
	if err := driver.WriteNodeLocationDir(dir, m); err != nil {
		t.Fatal(err)
	}
	r, err := nodeInfo(t, "", dir)
	if err != nil {
		t.Fatal(err)
	}
	if r.MaxVolumesPerNode != 23 {
		t.Fatalf("NodeGetInfo reports %d volumes, want the map's 23", r.MaxVolumesPerNode)
	}
	// Without the map: the configured number.
	if r, err := nodeInfo(t, hostLoc, ""); err != nil || r.MaxVolumesPerNode != driver.DefaultMaxVolumesPerNode {
		t.Fatalf("NodeGetInfo without the map: %v, %v; want %d", r.GetMaxVolumesPerNode(), err, driver.DefaultMaxVolumesPerNode)
	}
}
