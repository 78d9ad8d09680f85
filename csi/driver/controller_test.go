package driver_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
)

var rwo = []*csi.VolumeCapability{{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}}

func topo(loc string) *csi.Topology {
	return &csi.Topology{Segments: map[string]string{driver.TopologyKey: loc}}
}

func wantCode(t *testing.T, err error, code codes.Code, words ...string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want %s", err, code)
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("error %q does not say %q", err, w)
		}
	}
}

func TestCreateVolumeTopology(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	cases := []struct {
		name string
		req  *csi.TopologyRequirement
		want string
	}{
		{"preferred-wins", &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("ch-gen-1"), topo("nl-ams-1")},
			Preferred: []*csi.Topology{topo("nl-ams-1")}}, "nl-ams-1"},
		{"requisite-only", &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("ch-gen-1")}}, "ch-gen-1"},
		{"unknown-preferred-falls-to-requisite", &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("ch-gen-1")},
			Preferred: []*csi.Topology{topo("xx-nowhere-1")}}, "ch-gen-1"},
		{"none-uses-default", nil, hostLoc},
	}
	for _, c := range cases {
		resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: c.name, VolumeCapabilities: rwo,
			AccessibilityRequirements: c.req})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		v := resp.GetVolume()
		if !strings.HasPrefix(v.VolumeId, c.want+"/") || len(v.AccessibleTopology) != 1 ||
			v.AccessibleTopology[0].Segments[driver.TopologyKey] != c.want {
			t.Fatalf("%s: volume %s with topology %v, want location %s", c.name, v.VolumeId, v.AccessibleTopology, c.want)
		}
	}
	_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "nowhere", VolumeCapabilities: rwo,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("xx-nowhere-1")}}})
	wantCode(t, err, codes.ResourceExhausted, "xx-nowhere-1")
}

func TestCreateVolumeSizingParametersAndIdempotency(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	req := &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: rwo,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 3*(1<<30) + 1},
		Parameters:    map[string]string{"type": "physical", "iops": "700", "encryption": "true", "csi.storage.k8s.io/pvc/name": "data"}}
	first, err := e.ctrl.CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	v := first.GetVolume()
	if v.CapacityBytes != 4<<30 {
		t.Fatalf("capacity %d, want 4 GiB (rounded up)", v.CapacityBytes)
	}
	if v.VolumeContext["cloud.whitesky/encrypted"] != "true" {
		t.Fatalf("volume context %v lacks encryption", v.VolumeContext)
	}
	loc, id := splitID(t, v.VolumeId)
	disk, err := e.api.GetDisk(ctx, loc, id)
	if err != nil || disk.Type != cloud.DiskTypePhysical || disk.IOTune.IOPS != 700 || disk.SizeGiB != 4 {
		t.Fatalf("disk = %+v, %v", disk, err)
	}
	again, err := e.ctrl.CreateVolume(ctx, req)
	if err != nil || again.GetVolume().VolumeId != v.VolumeId {
		t.Fatalf("repeat: %v, %v; want the same volume %s", again, err, v.VolumeId)
	}
	other := proto.Clone(req).(*csi.CreateVolumeRequest)
	other.CapacityRange = &csi.CapacityRange{RequiredBytes: 8 << 30}
	_, err = e.ctrl.CreateVolume(ctx, other)
	wantCode(t, err, codes.AlreadyExists, "pvc-a", "4 GiB")
	// Grown since it was made: a repeated create is still answered with
	// it, unless its size is now above the request's limit.
	if _, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 6 << 30}}); err != nil {
		t.Fatal(err)
	}
	again, err = e.ctrl.CreateVolume(ctx, req)
	if err != nil || again.GetVolume().VolumeId != v.VolumeId || again.GetVolume().CapacityBytes != 6<<30 {
		t.Fatalf("repeat after expansion: %v, %v; want volume %s with 6 GiB", again, err, v.VolumeId)
	}
	other = proto.Clone(req).(*csi.CreateVolumeRequest)
	other.CapacityRange.LimitBytes = 5 << 30
	_, err = e.ctrl.CreateVolume(ctx, other)
	wantCode(t, err, codes.AlreadyExists, "pvc-a", "6 GiB", "limit")
	other = proto.Clone(req).(*csi.CreateVolumeRequest)
	other.Parameters = map[string]string{"type": "physical", "iops": "700"}
	_, err = e.ctrl.CreateVolume(ctx, other)
	wantCode(t, err, codes.AlreadyExists, "encryption")

	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bad", VolumeCapabilities: rwo, Parameters: map[string]string{"type": "fast"}})
	wantCode(t, err, codes.InvalidArgument, "type")
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bad", VolumeCapabilities: rwo, Parameters: map[string]string{"colour": "red"}})
	wantCode(t, err, codes.InvalidArgument, "colour")
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small", VolumeCapabilities: rwo,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 100 << 20, LimitBytes: 500 << 20}})
	wantCode(t, err, codes.OutOfRange, "whole GiB")
	rwx := []*csi.VolumeCapability{{AccessType: rwo[0].AccessType,
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER}}}
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "rwx", VolumeCapabilities: rwx})
	wantCode(t, err, codes.InvalidArgument, "one VM at a time")
}

// A copy made before its source grew still answers a repeated create of
// it (the request has not changed); a new copy is the source's new size.
func TestCopyOfAGrownSource(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	src, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "src", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	id := src.GetVolume().GetVolumeId()
	copyOf := func(name string) *csi.CreateVolumeRequest {
		return &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: rwo, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}}
	}
	first, err := e.ctrl.CreateVolume(ctx, copyOf("copy"))
	if err != nil || first.GetVolume().GetCapacityBytes() != 1<<30 {
		t.Fatalf("copy: %v, %v", first, err)
	}
	if _, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 3 << 30}}); err != nil {
		t.Fatal(err)
	}
	again, err := e.ctrl.CreateVolume(ctx, copyOf("copy"))
	if err != nil || again.GetVolume().GetVolumeId() != first.GetVolume().GetVolumeId() || again.GetVolume().GetCapacityBytes() != 1<<30 {
		t.Fatalf("repeated copy after the source grew: %v, %v; want %s with 1 GiB", again, err, first.GetVolume().GetVolumeId())
	}
	fresh, err := e.ctrl.CreateVolume(ctx, copyOf("copy-2"))
	if err != nil || fresh.GetVolume().GetCapacityBytes() != 3<<30 {
		t.Fatalf("copy of the grown source: %v, %v; want 3 GiB", fresh, err)
	}
	over := copyOf("copy-3")
	over.CapacityRange.LimitBytes = 2 << 30
	_, err = e.ctrl.CreateVolume(ctx, over)
	wantCode(t, err, codes.OutOfRange, "copy-3", "3 GiB")
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
	_, err = e.ctrl.CreateVolume(ctx, copyOf("copy-4"))
	wantCode(t, err, codes.NotFound, id, "copy-4")
}

func splitID(t *testing.T, id string) (string, int64) {
	t.Helper()
	var n int64
	i := strings.IndexByte(id, '/')
	if _, err := fmt.Sscan(id[i+1:], &n); err != nil {
		t.Fatalf("volume id %q: %v", id, err)
	}
	return id[:i], n
}

func TestForbiddenCreateIsPermissionDeniedWithoutCredential(t *testing.T) {
	e := newTestEnv(t, envOpts{faults: sim.Faults{ForbidCreate: true}})
	_, err := e.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: rwo})
	wantCode(t, err, codes.PermissionDenied, "location-scoped grant", hostLoc)
	sig := testJWT[strings.LastIndexByte(testJWT, '.')+1:]
	for _, text := range []string{err.Error(), e.logs.String()} {
		if strings.Contains(text, testJWT) || strings.Contains(text, sig) {
			t.Fatalf("credential leaked into %q", text)
		}
	}
	if !strings.Contains(e.logs.String(), "CreateVolume") {
		t.Fatalf("the failed call was not logged: %q", e.logs.String())
	}
}

// vmsOf returns the simulator's VMs in a location, this host's first.
func vmsOf(t *testing.T, e *testEnv, loc string) []cloud.VM {
	t.Helper()
	vms, err := e.api.ListVMs(context.Background(), "cs-"+loc)
	if err != nil {
		t.Fatal(err)
	}
	return vms
}

func TestPublishRefusesSecondVMAndGrantsTakeover(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	vol, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "shared", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().VolumeId
	vms := vmsOf(t, e, hostLoc)
	a, b := vms[0], vms[1]

	publishFirstWithoutAGrant(ctx, t, e, id, a)

	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: b.ReferenceID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.FailedPrecondition, a.Name, a.ReferenceID)

	unpublishOnlyFromTheHolder(ctx, t, e, id, a, b)
	pb, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: b.ReferenceID, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	checkTakeoverGrant(t, pb.PublishContext[driver.PubFenceGrant], id, a, b)

	// Published nodes show in ListVolumes and ControllerGetVolume.
	gv, err := e.ctrl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
	if err != nil || len(gv.Status.PublishedNodeIds) != 1 || gv.Status.PublishedNodeIds[0] != b.ReferenceID {
		t.Fatalf("get volume: %v %v", gv, err)
	}
	// Delete while attached is refused, naming the volume.
	_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, err, codes.FailedPrecondition, id)
	// Unknown node.
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "00000000-0000-0000-0000-000000000000", VolumeCapability: rwo[0]})
	wantCode(t, err, codes.NotFound, "reference_id")
}

// publishFirstWithoutAGrant publishes volume id to VM a (named in upper
// case): the context carries the device address and no grant, there being
// no earlier holder; publishing again to a is the same answer.
func publishFirstWithoutAGrant(ctx context.Context, t *testing.T, e *testEnv, id string, a cloud.VM) {
	t.Helper()
	pa, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: strings.ToUpper(a.ReferenceID), VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	pc := pa.GetPublishContext()
	if pc[driver.PubPCISlot] != "6" || pc[driver.PubPCIBus] != "0" || pc[driver.PubDiskID] == "" {
		t.Fatalf("publish context %v lacks the device address", pc)
	}
	if g, ok := pc[driver.PubFenceGrant]; ok {
		t.Fatalf("first publish carries a grant %s; there was no earlier holder", g)
	}
	// Publishing again to the same node is the same answer.
	if again, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a.ReferenceID, VolumeCapability: rwo[0]}); err != nil || again.PublishContext[driver.PubPCISlot] != "6" {
		t.Fatalf("repeat publish: %v %v", again, err)
	}
}

// unpublishOnlyFromTheHolder unpublishes volume id from node b, which does
// not have it (nothing changes), then twice from its holder a.
func unpublishOnlyFromTheHolder(ctx context.Context, t *testing.T, e *testEnv, id string, a, b cloud.VM) {
	t.Helper()
	// Unpublish from a node that does not have it changes nothing.
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: b.ReferenceID}); err != nil {
		t.Fatal(err)
	}
	if d, _ := e.api.GetDisk(ctx, hostLoc, mustDisk(t, id)); d.VMID != a.ID {
		t.Fatalf("disk moved to VM %d by an unpublish from another node", d.VMID)
	}
	for range 2 { // idempotent
		if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: a.ReferenceID}); err != nil {
			t.Fatal(err)
		}
	}
}

// checkTakeoverGrant: the agent's own parser accepts the grant, for node b
// and this volume, superseding exactly a's key.
func checkTakeoverGrant(t *testing.T, grant, id string, a, b cloud.VM) {
	t.Helper()
	g, err := fence.ParseGrant(grant)
	if err != nil {
		t.Fatal(err)
	}
	keyA, _ := fence.KeyFromUUID(a.ReferenceID)
	keyB, _ := fence.KeyFromUUID(b.ReferenceID)
	if err := g.ForNode(b.ReferenceID, id); err != nil {
		t.Fatal(err)
	}
	if !g.Names(keyA) || g.Names(keyB) || len(g.Supersedes) != 1 {
		t.Fatalf("takeover grant = %+v, want it to supersede only %s (node %s)", g, keyA, a.ReferenceID)
	}
	if g.ForNode(a.ReferenceID, id) == nil {
		t.Fatal("the grant for node b is accepted by node a")
	}
}

func mustDisk(t *testing.T, id string) int64 { _, n := splitID(t, id); return n }

func TestPublishAcrossLocationsRefused(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	vol, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "far", VolumeCapabilities: rwo,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("nl-ams-1")}}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.Volume.VolumeId, NodeId: hostUUID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.FailedPrecondition, "nl-ams-1", hostLoc)
}

func TestPublishWaitIsBounded(t *testing.T) {
	// Every API call takes 100ms, longer than the 50ms attach wait allows
	// for looking at the VM's disks.
	e := newTestEnv(t, envOpts{attach: 50 * time.Millisecond})
	ctx := context.Background()
	vol, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "slow", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(100 * time.Millisecond)})
	start := time.Now()
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.Volume.VolumeId, NodeId: hostUUID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.DeadlineExceeded, vol.Volume.VolumeId)
	if time.Since(start) > 5*time.Second {
		t.Fatalf("publish took %v despite a 50ms attach wait", time.Since(start))
	}
}

func TestConcurrentOperationOnAVolumeIsAborted(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(300 * time.Millisecond)})
	first := make(chan error, 1)
	go func() {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "same", VolumeCapabilities: rwo})
		first <- err
	}()
	// Once the simulator has seen the first call's lookup, that call holds
	// the name's lock (it is taken before any API request).
	for deadline := time.Now().Add(10 * time.Second); sum(e.sim.Calls()) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first CreateVolume never reached the simulator")
		}
	}
	_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "same", VolumeCapabilities: rwo})
	wantCode(t, err, codes.Aborted, "same", "in progress")
	r := <-first
	if r != nil {
		t.Fatalf("first call: %v", r)
	}

	// A snapshot, and a copy (made through one), are operations on their
	// source volume: they wait for no delete or expand of that volume,
	// and their refusal names the volume.
	v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "snapped", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	id := v.GetVolume().GetVolumeId()
	before := sum(e.sim.Calls())
	go func() {
		_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
		first <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); sum(e.sim.Calls()) == before; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the expansion never reached the simulator")
		}
	}
	_, err = e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-during-expand", SourceVolumeId: id})
	wantCode(t, err, codes.Aborted, id, "in progress")
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "copy", VolumeCapabilities: rwo,
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}})
	wantCode(t, err, codes.Aborted, id, "source of volume copy", "in progress")
	if err := <-first; err != nil {
		t.Fatalf("expansion: %v", err)
	}
}

func TestListVolumesPagingAndSnapshots(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	var ids []string
	for i := range 5 {
		v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("v%d", i), VolumeCapabilities: rwo})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, v.Volume.VolumeId)
	}
	// A disk the driver did not make is not listed.
	if _, err := e.api.CreateDisk(ctx, hostLoc, cloud.DiskSpec{Name: "foreign", Description: "someone else's", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	listsEachVolumeOnceInPagesOf2(ctx, t, e, 5, 3)
	_, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "nonsense"})
	wantCode(t, err, codes.Aborted, "nonsense")

	// Snapshot, restore a bigger volume from it, expand.
	s, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: ids[0]})
	if err != nil || !s.Snapshot.ReadyToUse || s.Snapshot.SourceVolumeId != ids[0] {
		t.Fatalf("snapshot: %v %v", s, err)
	}
	_, err = e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: ids[1]})
	wantCode(t, err, codes.AlreadyExists, ids[0])
	restoreBiggerAndExpand(ctx, t, e, s.Snapshot.SnapshotId)
	ls, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: ids[0]})
	if err != nil || len(ls.Entries) != 1 {
		t.Fatalf("list snapshots: %v %v", ls, err)
	}
}

// listsEachVolumeOnceInPagesOf2 pages through ListVolumes two entries at a
// time: no volume comes twice, and it lists volumes of them in
// pagesWanted pages.
func listsEachVolumeOnceInPagesOf2(ctx context.Context, t *testing.T, e *testEnv, volumes, pagesWanted int) {
	t.Helper()
	seen := map[string]bool{}
	token := ""
	pages := 0
	for {
		r, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: token})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, en := range r.Entries {
			if seen[en.Volume.VolumeId] {
				t.Fatalf("volume %s listed twice", en.Volume.VolumeId)
			}
			seen[en.Volume.VolumeId] = true
		}
		if token = r.NextToken; token == "" {
			break
		}
	}
	if len(seen) != volumes || pages != pagesWanted {
		t.Fatalf("listed %d volumes in %d pages, want %d in %d", len(seen), pages, volumes, pagesWanted)
	}
}

// restoreBiggerAndExpand restores a 3 GiB volume from snapshot snap and
// expands it, as a filesystem volume and then as a raw block one: each
// expansion needs the node.
func restoreBiggerAndExpand(ctx context.Context, t *testing.T, e *testEnv, snap string) {
	t.Helper()
	r, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "restored", VolumeCapabilities: rwo,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 3 << 30},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap}}}})
	if err != nil || r.Volume.CapacityBytes != 3<<30 || r.Volume.ContentSource.GetSnapshot().GetSnapshotId() != snap {
		t.Fatalf("restore: %v %v", r, err)
	}
	x, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: r.Volume.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 5<<30 - 10}})
	if err != nil || x.CapacityBytes != 5<<30 || !x.NodeExpansionRequired {
		t.Fatalf("expand: %v %v", x, err)
	}
	// A raw block volume needs the node too: a lease's data mapping or a
	// dm-crypt mapping may sit between the disk and the pod, which the
	// controller cannot see; grown or already at the size.
	block := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	for _, want := range []int64{6 << 30, 6 << 30} {
		x, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: r.Volume.VolumeId,
			CapacityRange: &csi.CapacityRange{RequiredBytes: want}, VolumeCapability: block})
		if err != nil || x.CapacityBytes != want || !x.NodeExpansionRequired {
			t.Fatalf("expand of a raw block volume: %v %v; want node expansion required", x, err)
		}
	}
}

func TestCodeForError(t *testing.T) {
	cases := []struct {
		err  error
		want codes.Code
	}{
		{&cloud.APIError{Kind: cloud.ErrNotFound}, codes.NotFound},
		{&cloud.APIError{Kind: cloud.ErrConflict}, codes.FailedPrecondition},
		{&cloud.APIError{Kind: cloud.ErrForbidden}, codes.PermissionDenied},
		{&cloud.APIError{Kind: cloud.ErrUnauthorized}, codes.Unauthenticated},
		{&cloud.APIError{Kind: cloud.ErrRateLimited}, codes.Unavailable},
		{&cloud.APIError{Kind: cloud.ErrUnavailable}, codes.Unavailable},
		{fmt.Errorf("wrapped: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("agent said: %w", status.Error(codes.FailedPrecondition, "disk held by node x")), codes.FailedPrecondition},
		{errors.New("anything else"), codes.Internal},
	}
	for _, c := range cases {
		if got := driver.CodeForError(c.err); got != c.want {
			t.Errorf("CodeForError(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}

// TestFlakyAPI: with a fifth of all API requests answered 503, concurrent
// creates and publishes still succeed through the client's retries, and
// no name yields two disks.
func TestFlakyAPI(t *testing.T) {
	e := newTestEnv(t, envOpts{faults: sim.Faults{ErrorRate: 0.2}})
	ctx := context.Background()
	vms := vmsOf(t, e, hostLoc)
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("flaky-%d", i), VolumeCapabilities: rwo})
			if err == nil {
				_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.Volume.VolumeId,
					NodeId: vms[i%len(vms)].ReferenceID, VolumeCapability: rwo[0]})
			}
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if e.sim.Calls()["createDisk"] == 0 {
		t.Fatal("no create reached the simulator")
	}
	names := map[string]int{}
	for _, d := range e.sim.Snapshot().Disks {
		names[d.Name]++
		if len(d.Attachments) != 1 {
			t.Errorf("disk %s has %d attachments", d.Name, len(d.Attachments))
		}
	}
	if len(names) != 20 {
		t.Fatalf("%d distinct disks, want 20", len(names))
	}
	for n, c := range names {
		if c != 1 {
			t.Errorf("%d disks named %s", c, n)
		}
	}
}

// TestSnapshotReadinessIsTheAPIs: a snapshot is ready once the API
// reports its creation time, not before; CreateSnapshot, its repeats,
// ListSnapshots and GetSnapshot (the API's snapshot endpoint) all say so.
// The simulator's SnapshotPendingReads stands in for a platform that has
// not finished a snapshot (the API has no status field).
func TestSnapshotReadinessIsTheAPIs(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "src", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	caps, err := e.ctrl.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	hasGet := false
	for _, c := range caps.Capabilities {
		hasGet = hasGet || c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_GET_SNAPSHOT
	}
	if !hasGet {
		t.Error("the controller does not offer GET_SNAPSHOT")
	}

	id := snapshotPendingThenReady(ctx, t, e, v.Volume)

	// Without pending reads a snapshot is ready at once.
	e.sim.SetFaults(sim.Faults{})
	s, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "at-once", SourceVolumeId: v.Volume.VolumeId})
	if err != nil || !s.Snapshot.ReadyToUse {
		t.Fatalf("snapshot: %v %v", s, err)
	}

	// Gone, or never of this driver: NOT_FOUND.
	if _, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
		t.Fatal(err)
	}
	for _, gone := range []string{id, "ch-lug-1/999999/snap-1", "nonsense"} {
		_, err = e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: gone})
		wantCode(t, err, codes.NotFound, gone)
	}
	_, err = e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{})
	wantCode(t, err, codes.InvalidArgument)
}

// snapshotPendingThenReady takes snapshot "pending" of v while the API
// gives it no creation time for its first three reads (the snapshot
// endpoint right after the take, the list on the repeat, GetSnapshot):
// not ready on each of them; then ready. It returns the snapshot's ID.
func snapshotPendingThenReady(ctx context.Context, t *testing.T, e *testEnv, v *csi.Volume) string {
	t.Helper()
	e.sim.SetFaults(sim.Faults{SnapshotPendingReads: 3})
	s, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "pending", SourceVolumeId: v.VolumeId})
	if err != nil || s.Snapshot.ReadyToUse || s.Snapshot.CreationTime == nil {
		t.Fatalf("a snapshot the API gives no creation time: %v %v; want not ready, with a creation time", s, err)
	}
	id := s.Snapshot.SnapshotId
	again, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "pending", SourceVolumeId: v.VolumeId})
	if err != nil || again.Snapshot.SnapshotId != id || again.Snapshot.ReadyToUse {
		t.Fatalf("repeated CreateSnapshot while pending: %v %v; want the same snapshot, not ready", again, err)
	}
	g, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id})
	if err != nil || g.Snapshot.ReadyToUse || g.Snapshot.SnapshotId != id || g.Snapshot.SourceVolumeId != v.VolumeId {
		t.Fatalf("GetSnapshot while pending: %v %v", g, err)
	}
	snapshotReadyOnceTheAPISaysSo(ctx, t, e, v, id)
	return id
}

// snapshotReadyOnceTheAPISaysSo: once the API reports snapshot id's
// creation time, GetSnapshot (one read of the snapshot endpoint),
// ListSnapshots and a repeated CreateSnapshot all say it is ready, with
// one creation time.
func snapshotReadyOnceTheAPISaysSo(ctx context.Context, t *testing.T, e *testEnv, v *csi.Volume, id string) {
	t.Helper()
	before := e.sim.Calls()["getDiskSnapshot"]
	g, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id})
	if err != nil || !g.Snapshot.ReadyToUse || g.Snapshot.SizeBytes != v.CapacityBytes ||
		time.Since(g.Snapshot.CreationTime.AsTime()) > time.Minute || e.sim.Calls()["getDiskSnapshot"] != before+1 {
		t.Fatalf("GetSnapshot once the API reports it: %v %v (snapshot endpoint asked %d times)", g, err, e.sim.Calls()["getDiskSnapshot"]-before)
	}
	l, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: id})
	if err != nil || len(l.Entries) != 1 || !l.Entries[0].Snapshot.ReadyToUse {
		t.Fatalf("ListSnapshots by id: %v %v", l, err)
	}
	again, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "pending", SourceVolumeId: v.VolumeId})
	if err != nil || !again.Snapshot.ReadyToUse || !again.Snapshot.CreationTime.AsTime().Equal(g.Snapshot.CreationTime.AsTime()) {
		t.Fatalf("repeated CreateSnapshot once ready: %v %v", again, err)
	}
}

// TestGetCapacityIsTheLocationsAPI: GET_CAPACITY answers what the API's
// location capacity endpoint says is left in the location asked for (su,
// storage units of 1 TiB), shrinking as disks are made; a location the
// customer lacks has none; a class the plugin refuses is refused here too.
func TestGetCapacityIsTheLocationsAPI(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	caps, err := e.ctrl.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(caps.Capabilities, func(c *csi.ControllerServiceCapability) bool {
		return c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_GET_CAPACITY
	}) {
		t.Error("the controller does not offer GET_CAPACITY")
	}
	const tib = int64(1) << 40
	e.sim.SetCapacity("ch-gen-1", 3)
	e.sim.SetCapacity("nl-ams-1", 0)
	at := func(loc string) *csi.Topology {
		return &csi.Topology{Segments: map[string]string{driver.TopologyKey: loc}}
	}
	capacity := func(loc string, params map[string]string) (int64, error) {
		r, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: at(loc), Parameters: params, VolumeCapabilities: rwo})
		if err != nil {
			return 0, err
		}
		if r.GetMaximumVolumeSize() != nil && r.GetMaximumVolumeSize().GetValue() > r.AvailableCapacity {
			t.Errorf("%s: maximum volume size %d above the available %d", loc, r.GetMaximumVolumeSize().GetValue(), r.AvailableCapacity)
		}
		return r.AvailableCapacity, nil
	}
	before := e.sim.Calls()["getCustomerLocationCapacity"]
	for loc, want := range map[string]int64{"ch-gen-1": 3 * tib, "nl-ams-1": 0, "xx-none-1": 0} {
		got, err := capacity(loc, map[string]string{"diskType": "PHYSICAL"})
		if err != nil || got != want {
			t.Errorf("capacity of %s: %d, %v; want %d", loc, got, err, want)
		}
	}
	if n := e.sim.Calls()["getCustomerLocationCapacity"] - before; n != 2 {
		t.Errorf("the location capacity endpoint was asked %d times for the two known locations", n)
	}
	// A disk of 600 GiB leaves less than 3 SU: 2.
	if _, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "big", VolumeCapabilities: rwo,
		CapacityRange:             &csi.CapacityRange{RequiredBytes: 600 << 30},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{at("ch-gen-1")}}}); err != nil {
		t.Fatal(err)
	}
	if got, err := capacity("ch-gen-1", nil); err != nil || got != 2*tib {
		t.Errorf("capacity of ch-gen-1 after a 600 GiB disk: %d, %v; want 2 TiB", got, err)
	}
	// A full location refuses the disk the scheduler would have been warned off.
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "nowhere", VolumeCapabilities: rwo,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{at("nl-ams-1")}}})
	if err == nil {
		t.Error("a disk was made in a location whose capacity is 0")
	}
	// Without topology: the location a volume without topology gets.
	r, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{})
	if err != nil || r.AvailableCapacity != sim.DefaultCapacitySU*tib {
		t.Errorf("capacity without topology: %v %v", r, err)
	}
	_, err = capacity("ch-gen-1", map[string]string{"iops": "99"})
	wantCode(t, err, codes.InvalidArgument, "iops")
	_, err = capacity("ch-gen-1", map[string]string{"size": "big"})
	wantCode(t, err, codes.InvalidArgument, "size")
}

// TestSizesNeverLessThanAsked: the simulator takes the create call's
// disk_size in GB, as the API documents it, and the resize call's in GiB.
// Every volume holds at least the bytes asked, and reports no more than it
// holds nor less than asked, made and grown, repeated or listed.
func TestSizesNeverLessThanAsked(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	holds := func(id string) int64 {
		_, diskID := splitID(t, id)
		d := e.sim.Snapshot().Disks[diskID]
		if d.Bytes > 0 {
			return d.Bytes
		}
		return d.SizeGiB << 30
	}
	for i, req := range []int64{1, 1_000_000_000, 1 << 30, 1<<30 + 1, 3 << 30, 10 << 30, 100<<30 - 512, 1000 << 30} {
		name := fmt.Sprintf("size-%d", i)
		r, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: rwo,
			CapacityRange: &csi.CapacityRange{RequiredBytes: req}})
		if err != nil {
			t.Fatalf("%d bytes: %v", req, err)
		}
		id, got := r.Volume.VolumeId, r.Volume.CapacityBytes
		if h := holds(id); h < req || got < req || got > h {
			t.Errorf("asked %d bytes: the disk holds %d, reported %d", req, h, got)
		}
		again, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: rwo,
			CapacityRange: &csi.CapacityRange{RequiredBytes: req}})
		if err != nil || again.Volume.CapacityBytes < req || again.Volume.CapacityBytes > holds(id) {
			t.Errorf("asked %d bytes again: %v %v (holds %d)", req, again, err, holds(id))
		}
		grow := req + 3<<30 + 7
		x, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id,
			CapacityRange: &csi.CapacityRange{RequiredBytes: grow}})
		if err != nil || x.CapacityBytes < grow || x.CapacityBytes > holds(id) || holds(id) < grow {
			t.Errorf("grown to %d bytes: %v %v, holds %d", grow, x, err, holds(id))
		}
	}
	l, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range l.Entries {
		if h := holds(en.Volume.VolumeId); en.Volume.CapacityBytes > h {
			t.Errorf("ListVolumes reports %s with %d bytes; it holds %d", en.Volume.VolumeId, en.Volume.CapacityBytes, h)
		}
	}
}
