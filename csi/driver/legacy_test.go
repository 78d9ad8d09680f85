package driver_test

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// TestBareDiskIDOfTheEarlierDriver: a PV of the driver this one replaces
// names its volume by the bare disk id. The controller finds the disk's
// location by listing the locations' disks, once, and serves the volume
// under that id: publish (with the holders note, as for any disk), get,
// expand, unpublish, delete. The node service takes the id too.
func TestBareDiskIDOfTheEarlierDriver(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	// In the location that is not the default, so that finding it takes
	// a look at more than one.
	n, err := e.api.CreateDisk(ctx, "nl-ams-1", cloud.DiskSpec{Name: "pvc-3f2a", Description: "", SizeGiB: 10})
	if err != nil {
		t.Fatal(err)
	}
	id := strconv.FormatInt(n, 10)
	var ref string
	for _, vm := range vmsOf(t, e, "nl-ams-1") {
		if vm.ReferenceID != "" {
			ref = vm.ReferenceID
			break
		}
	}
	if ref == "" {
		t.Fatal("the simulator has no VM with a reference_id in nl-ams-1")
	}
	before := e.sim.Calls()
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: ref, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	if r.PublishContext["cloud.whitesky/disk-id"] != id {
		t.Fatalf("publish context %v does not name disk %s", r.PublishContext, id)
	}
	notes, err := e.api.ListDiskNotes(ctx, "nl-ams-1", n)
	if err != nil || len(notes) == 0 {
		t.Fatalf("the publish of a bare-id volume recorded no holder: %v %v", notes, err)
	}
	g, err := e.ctrl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
	if err != nil {
		t.Fatal(err)
	}
	if g.Volume.VolumeId != id || g.Volume.VolumeContext["cloud.whitesky/location"] != "nl-ams-1" || len(g.Status.PublishedNodeIds) != 1 {
		t.Fatalf("ControllerGetVolume(%s) = %v", id, g)
	}
	if _, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 11 << 30}}); err != nil {
		t.Fatal(err)
	}
	if d, _ := e.api.GetDisk(ctx, "nl-ams-1", n); d.SizeGiB != 11 {
		t.Fatalf("disk %d is %d GiB after the expand to 11", n, d.SizeGiB)
	}
	after := e.sim.Calls()
	locs, _ := e.api.ListLocations(ctx)
	if l := after["listDisks"] - before["listDisks"]; l > len(locs) {
		t.Errorf("finding the bare id's location took %d disk listings for three calls, more than the %d locations: it is found once", l, len(locs))
	}
	unpublishFrom(t, e, id, ref)
	if d, _ := e.api.GetDisk(ctx, "nl-ams-1", n); d.VMID != 0 {
		t.Fatalf("disk %d still attached to VM %d after the unpublish", n, d.VMID)
	}
	// The node service takes the id (the agent here answers for its
	// identity only, so the stage gets as far as asking it).
	_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, PublishContext: r.PublishContext,
		StagingTargetPath: filepath.Join(e.kubelet, "plugins", "staging", "legacy"), VolumeCapability: rwo[0]})
	wantCode(t, err, codes.Unimplemented)
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.api.GetDisk(ctx, "nl-ams-1", n); err == nil {
		t.Fatalf("disk %d is still there after DeleteVolume(%s)", n, id)
	}
	// A bare id no location has: not found, and nothing to delete.
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "987654", NodeId: ref, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.NotFound, "987654")
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "987654"}); err != nil {
		t.Fatal(err)
	}
}
