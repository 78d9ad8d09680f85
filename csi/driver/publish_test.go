package driver_test

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
)

// publishTo publishes volume id to the node with reference ref and returns
// whether its publish context says the disk was never published before.
func publishTo(t *testing.T, e *testEnv, id, ref string) bool {
	t.Helper()
	r, err := e.ctrl.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: ref, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	v, ok := r.PublishContext[driver.PubNeverPublished]
	if ok && v != "true" {
		t.Fatalf("publish context's %s = %q", driver.PubNeverPublished, v)
	}
	return driver.NeverPublished(r.PublishContext)
}

func unpublishFrom(t *testing.T, e *testEnv, id, ref string) {
	t.Helper()
	if _, err := e.ctrl.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: ref}); err != nil {
		t.Fatal(err)
	}
}

func createVolume(t *testing.T, e *testEnv, req *csi.CreateVolumeRequest) string {
	t.Helper()
	req.VolumeCapabilities = rwo
	v, err := e.ctrl.CreateVolume(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return v.Volume.VolumeId
}

func TestOnlyTheFirstPublishSaysNeverPublished(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "first"})
	vms := vmsOf(t, e, hostLoc)
	a, b := vms[0].ReferenceID, vms[1].ReferenceID

	if !publishTo(t, e, id, a) {
		t.Fatal("the first publish of a new volume does not say it was never published")
	}
	// The same attachment published again: node a has the disk now.
	if publishTo(t, e, id, a) {
		t.Fatal("a repeated publish to the same node says never published")
	}
	unpublishFrom(t, e, id, a)
	if publishTo(t, e, id, b) {
		t.Fatal("the publish after an unpublish says never published")
	}
	unpublishFrom(t, e, id, b)
	if publishTo(t, e, id, a) {
		t.Fatal("the publish back to the first node says never published")
	}
}

func TestCopiesAreNeverPublishedAtFirst(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	src := createVolume(t, e, &csi.CreateVolumeRequest{Name: "source"})
	if !publishTo(t, e, src, hostUUID) {
		t.Fatal("the source's first publish does not say never published")
	}
	snap, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: src})
	if err != nil {
		t.Fatal(err)
	}
	unpublishFrom(t, e, src, hostUUID)
	restored := createVolume(t, e, &csi.CreateVolumeRequest{Name: "restored", VolumeContentSource: &csi.VolumeContentSource{
		Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.Snapshot.SnapshotId}}}})
	clone := createVolume(t, e, &csi.CreateVolumeRequest{Name: "clone", VolumeContentSource: &csi.VolumeContentSource{
		Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src}}}})
	for _, id := range []string{restored, clone} {
		if !publishTo(t, e, id, hostUUID) {
			t.Fatalf("the first publish of copy %s does not say never published", id)
		}
		unpublishFrom(t, e, id, hostUUID)
	}
	if publishTo(t, e, src, hostUUID) {
		t.Fatal("the source's publish after it was copied says never published")
	}
}

func TestPublishRetriedAfterATimeoutStillSaysNeverPublished(t *testing.T) {
	// Every API call takes 100ms, longer than the 50ms attach wait: the
	// first publish records the node and attaches, then gives up.
	e := newTestEnv(t, envOpts{attach: 50 * time.Millisecond})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "slow"})
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(100 * time.Millisecond)})
	_, err := e.ctrl.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.DeadlineExceeded, id)
	e.sim.SetFaults(sim.Faults{})
	// No context was returned, so no node can have claimed the disk.
	if !publishTo(t, e, id, hostUUID) {
		t.Fatal("the retry of a first publish that returned nothing does not say never published")
	}
	if publishTo(t, e, id, hostUUID) {
		t.Fatal("a publish after the retry returned says never published")
	}
}

func TestDiskWithAnEarlierDriversHolderNoteCountsAsPublished(t *testing.T) {
	// A disk a driver without the published note gave to node a: only the
	// holder note says so.
	e := newTestEnv(t, envOpts{})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "older"})
	a := vmsOf(t, e, hostLoc)[0].ReferenceID
	if err := e.api.SetDiskNote(context.Background(), hostLoc, mustDisk(t, id), "vco-csi/holder", a); err != nil {
		t.Fatal(err)
	}
	if publishTo(t, e, id, a) {
		t.Fatal("a disk with an earlier holder says never published")
	}
}
