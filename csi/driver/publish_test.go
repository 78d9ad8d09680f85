package driver_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
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
	// first publish records the node and attaches, then gives up. The
	// volume is a copy, which holds data at its first stage: there the
	// flag lets the stage skip the wait for an earlier holder.
	e := newTestEnv(t, envOpts{attach: 50 * time.Millisecond})
	src := createVolume(t, e, &csi.CreateVolumeRequest{Name: "source"})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "slow", VolumeContentSource: &csi.VolumeContentSource{
		Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src}}}})
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

// TestEmptyVolumeFirstPublishWritesOneNote: a volume the driver made empty
// is blank until a node that got a publish context writes it, and a blank
// disk's stage neither waits nor meets copied lease slots, so its first
// publish writes the holders note alone (one request), and a retry of a
// first publish that returned nothing says published, which costs that
// blank disk's stage nothing.
func TestEmptyVolumeFirstPublishWritesOneNote(t *testing.T) {
	e := newTestEnv(t, envOpts{attach: 50 * time.Millisecond})
	ctx := context.Background()
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "empty"})
	before := e.sim.Calls()
	if !publishTo(t, e, id, hostUUID) {
		t.Fatal("the first publish of a new empty volume does not say never published")
	}
	after := e.sim.Calls()
	if w := after["createDiskNote"] + after["updateDiskNote"] - before["createDiskNote"] - before["updateDiskNote"]; w != 1 {
		t.Fatalf("the first publish of an empty volume wrote %d notes, want 1 (the holders note)", w)
	}
	notes, err := e.api.ListDiskNotes(ctx, hostLoc, mustDisk(t, id))
	if err != nil {
		t.Fatal(err)
	}
	if len(notes) != 1 || notes[0].Title != "vco-csi/holders" || notes[0].Content != hostUUID && notes[0].Content != "urn:uuid:"+hostUUID {
		t.Fatalf("notes after the first publish: %+v, want vco-csi/holders = %s alone", notes, hostUUID)
	}
	unpublishFrom(t, e, id, hostUUID)

	// A first publish that timed out: the retry says published.
	id2 := createVolume(t, e, &csi.CreateVolumeRequest{Name: "empty-slow"})
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(100 * time.Millisecond)})
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id2, NodeId: hostUUID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.DeadlineExceeded, id2)
	e.sim.SetFaults(sim.Faults{})
	if publishTo(t, e, id2, hostUUID) {
		t.Fatal("the retry of an empty volume's first publish says never published, without a published note behind it")
	}
}

// TestFirstPublishOfAMadeVolumeKeepsHoldersItDidNotExpect: the first
// publish of a volume this controller made adds its holders note beside
// its reads, expecting no notes. Another controller (a successor while
// this one still ran) published the volume to node a in between: the
// publish to b still writes a in the list and grants b a's takeover, and
// from the next publish on every holders note carries the whole list.
func TestFirstPublishOfAMadeVolumeKeepsHoldersItDidNotExpect(t *testing.T) {
	e, id := madeVolume(t)
	ctx := context.Background()
	vms := vmsOf(t, e, hostLoc)
	a, b := vms[0].ReferenceID, vms[1].ReferenceID
	other := otherController(t, e)
	publishOn(t, other, id, a)
	unpublishOn(t, other, id, a)
	before := e.sim.Calls()
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: b, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	if after := e.sim.Calls(); after["createDiskNote"]-before["createDiskNote"] != 1 {
		t.Fatalf("the first publish of a volume this controller made added %d notes, want 1 beside its reads", after["createDiskNote"]-before["createDiskNote"])
	}
	if driver.NeverPublished(r.PublishContext) {
		t.Fatal("a publish after another controller's to another node says never published")
	}
	wantSupersedes(t, grantOf(t, r.PublishContext, id, b), a)
	// The list, and the added note as added or, if the reads showed it,
	// with the list written into it too.
	if lists := holdersNotes(t, e, id); !slices.Equal(lists, []string{a + "," + b, "urn:uuid:" + b}) && !slices.Equal(lists, []string{a + "," + b, a + "," + b}) {
		t.Fatalf("holders notes %q, want the list %q and the added note", lists, a+","+b)
	}
	unpublishFrom(t, e, id, b)
	r = publishOn(t, other, id, hostUUID)
	wantSupersedes(t, grantOf(t, r.PublishContext, id, hostUUID), a, b)
	if lists, l := holdersNotes(t, e, id), a+","+b+","+hostUUID; !slices.Equal(lists, []string{l, l}) {
		t.Fatalf("holders notes after the next publish %q, want the list %q in both", lists, l)
	}
}

// TestFirstPublishOfAMadeVolumeToTheNodeAnotherGaveIt: another controller
// published the volume to node a before this one's first publish, also to
// a. That controller's note is a list, not an added note, so the context
// says published, and grants nothing.
func TestFirstPublishOfAMadeVolumeToTheNodeAnotherGaveIt(t *testing.T) {
	e, id := madeVolume(t)
	ctx := context.Background()
	a := vmsOf(t, e, hostLoc)[0].ReferenceID
	other := otherController(t, e)
	publishOn(t, other, id, a)
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	if driver.NeverPublished(r.PublishContext) || grantOf(t, r.PublishContext, id, a) != nil {
		t.Fatalf("publish context %v, want published and no grant", r.PublishContext)
	}
	if lists := holdersNotes(t, e, id); !slices.Equal(lists, []string{a, "urn:uuid:" + a}) {
		t.Fatalf("holders notes %q, want %q and the added note", lists, a)
	}
}

// TestFirstPublishOfAMadeVolumeOutlivesALateWrite: another controller's
// write of the list, read before this controller's first publish, lands
// after it (a retried request, or one past its client's timeout). The
// added note is one that late write does not touch, so node b, attached
// in between, stays recorded.
func TestFirstPublishOfAMadeVolumeOutlivesALateWrite(t *testing.T) {
	e, id := madeVolume(t)
	ctx := context.Background()
	vms := vmsOf(t, e, hostLoc)
	a, b, x := vms[0].ReferenceID, vms[1].ReferenceID, hostUUID
	late := &lateNotes{Client: e.api, hold: make(chan struct{}), held: make(chan struct{})}
	other := otherControllerOver(t, late)
	publishOn(t, other, id, a)
	unpublishOn(t, other, id, a)
	late.on.Store(true)
	done := make(chan error, 1)
	go func() {
		_, err := other.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: x, VolumeCapability: rwo[0]})
		done <- err
	}()
	<-late.held // the other's read is done, its write of "a,x" held
	if publishTo(t, e, id, b) {
		t.Fatal("a publish after another controller's to another node says never published")
	}
	close(late.hold)
	if err := <-done; driver.CodeForError(err) != codes.FailedPrecondition {
		t.Fatalf("the other controller's publish to x while b has the disk: %v, want FailedPrecondition", err)
	}
	unpublishFrom(t, e, id, b)
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, r.PublishContext, id, a), b, x)
}

// lateNotes holds the first note write it passes while on, until hold is
// closed, and says so on held.
type lateNotes struct {
	*cloud.Client
	on         atomic.Bool
	hold, held chan struct{}
	once       sync.Once
}

func (l *lateNotes) SetDiskNoteIn(ctx context.Context, loc string, id int64, notes []cloud.Note, title, content string) error {
	if l.on.Load() {
		l.once.Do(func() { close(l.held); <-l.hold })
	}
	return l.Client.SetDiskNoteIn(ctx, loc, id, notes, title, content)
}

// madeVolume is a volume the test's controller made, with the VMs listed
// as its node location map lists them every minute: the first publish of
// a volume it made adds its note beside its reads only for a node whose VM
// it knows.
func madeVolume(t *testing.T) (*testEnv, string) {
	t.Helper()
	e := newTestEnv(t, envOpts{})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "made"})
	if _, err := e.drv.NodeLocationMap(context.Background()); err != nil {
		t.Fatal(err)
	}
	return e, id
}

// publishOn publishes volume id to node through controller d.
func publishOn(t *testing.T, d *driver.Driver, id, node string) *csi.ControllerPublishVolumeResponse {
	t.Helper()
	r, err := d.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func unpublishOn(t *testing.T, d *driver.Driver, id, node string) {
	t.Helper()
	if _, err := d.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node}); err != nil {
		t.Fatal(err)
	}
}

// otherController is a second controller over the test's cloud.
func otherController(t *testing.T, e *testEnv) *driver.Driver { return otherControllerOver(t, e.api) }

func otherControllerOver(t *testing.T, api driver.Cloud) *driver.Driver {
	t.Helper()
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Version: "other", Mode: driver.ModeController,
		Cloud: api, DefaultLocation: hostLoc, AttachPoll: time.Millisecond, AttachTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// holdersNotes are the contents of volume id's vco-csi/holders notes.
func holdersNotes(t *testing.T, e *testEnv, id string) []string {
	t.Helper()
	notes, err := e.api.ListDiskNotes(context.Background(), hostLoc, mustDisk(t, id))
	if err != nil {
		t.Fatal(err)
	}
	var lists []string
	for _, n := range notes {
		if n.Title == "vco-csi/holders" {
			lists = append(lists, n.Content)
		}
	}
	return lists
}

// TestFirstPublishOfAMadeVolumeAttachedElsewhere: a volume this controller
// made and someone attached by hand. Its first publish is refused as any
// publish to a disk attached elsewhere; its note, added beside the reads,
// stays (docs/fencing.md), and later publishes count that node a holder.
func TestFirstPublishOfAMadeVolumeAttachedElsewhere(t *testing.T) {
	e, id := madeVolume(t)
	ctx := context.Background()
	vms := vmsOf(t, e, hostLoc)
	a, b := vms[0], vms[1].ReferenceID
	if err := e.api.AttachDisk(ctx, "cs-"+hostLoc, a.ID, mustDisk(t, id)); err != nil {
		t.Fatal(err)
	}
	_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: b, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.FailedPrecondition, id, "attached to")
	if lists := holdersNotes(t, e, id); !slices.Equal(lists, []string{"urn:uuid:" + b}) {
		t.Fatalf("holders notes after the refused first publish: %q, want the added note naming %s", lists, b)
	}
	if err := e.api.DetachDisk(ctx, "cs-"+hostLoc, a.ID, mustDisk(t, id)); err != nil {
		t.Fatal(err)
	}
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, r.PublishContext, id, hostUUID), b)
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

// grantOf parses the publish context's grant for volume id and node ref,
// nil when there is none, and checks the agent would accept it there.
func grantOf(t *testing.T, pc map[string]string, id, ref string) *fence.Grant {
	t.Helper()
	raw, ok := pc[driver.PubFenceGrant]
	if !ok {
		return nil
	}
	g, err := fence.ParseGrant(raw)
	if err != nil {
		t.Fatalf("publish context's grant %q: %v", raw, err)
	}
	if err := g.ForNode(ref, id); err != nil {
		t.Fatalf("grant %s is not for node %s and volume %s: %v", raw, ref, id, err)
	}
	return g
}

// wantSupersedes checks that g names exactly the keys of the nodes refs.
func wantSupersedes(t *testing.T, g *fence.Grant, refs ...string) {
	t.Helper()
	if g == nil {
		t.Fatalf("no grant; want one superseding the keys of %v", refs)
	}
	want := map[fence.Key]bool{}
	for _, r := range refs {
		k, err := fence.KeyFromUUID(r)
		if err != nil {
			t.Fatal(err)
		}
		want[k] = true
	}
	got := map[fence.Key]bool{}
	for _, k := range g.Supersedes {
		got[k] = true
	}
	if len(got) != len(g.Supersedes) || len(got) != len(want) {
		t.Fatalf("grant supersedes %v; want exactly the keys of %v", g.Supersedes, refs)
	}
	for k := range want {
		if !got[k] {
			t.Fatalf("grant supersedes %v; want exactly the keys of %v", g.Supersedes, refs)
		}
	}
}

// TestRetriedTakeoverPublishKeepsItsGrant is the safety issue's defect 1:
// node a died holding the disk, the disk was detached from it, and the
// publish to node b timed out once. The retry must still grant b the
// takeover of a's key, and a later publish to c must supersede both.
func TestRetriedTakeoverPublishKeepsItsGrant(t *testing.T) {
	e := newTestEnv(t, envOpts{attach: 50 * time.Millisecond})
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "takeover"})
	vms := vmsOf(t, e, hostLoc)
	a, b, c := vms[0].ReferenceID, vms[1].ReferenceID, vms[2].ReferenceID
	ctx := context.Background()
	publish := func(ref string) (map[string]string, error) {
		r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: ref, VolumeCapability: rwo[0]})
		return r.GetPublishContext(), err
	}

	pc, err := publish(a)
	if err != nil {
		t.Fatal(err)
	}
	if g := grantOf(t, pc, id, a); g != nil {
		t.Fatalf("the first publish carries grant %+v", g)
	}
	// Node a dies; Kubernetes detaches the disk from it (the controller
	// cannot tell this from a clean unpublish).
	unpublishFrom(t, e, id, a)

	// The publish to b attaches, then its wait runs out.
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(100 * time.Millisecond)})
	_, err = publish(b)
	wantCode(t, err, codes.DeadlineExceeded, id)
	e.sim.SetFaults(sim.Faults{})
	if d, _ := e.api.GetDisk(ctx, hostLoc, mustDisk(t, id)); d.VMID != vms[1].ID {
		t.Fatalf("the timed-out publish left the disk on VM %d, want it attached to b (VM %d)", d.VMID, vms[1].ID)
	}
	// The CO's retry: a's key may still be on the disk, so b needs the grant.
	pc, err = publish(b)
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, pc, id, b), a)
	// And again, as after a controller restart: the same grant.
	pc, err = publish(b)
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, pc, id, b), a)

	// b goes too; c may meet a's key (b never staged) or b's (it did).
	unpublishFrom(t, e, id, b)
	pc, err = publish(c)
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, pc, id, c), a, b)
}

// TestHolderNotesOfEarlierVersionsAreRead: a disk published by a version
// that kept only the last holder (vco-csi/holder), or by one run in
// between, loses none of its holders.
func TestHolderNotesOfEarlierVersionsAreRead(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "upgraded"})
	vms := vmsOf(t, e, hostLoc)
	a, b, c := vms[0].ReferenceID, vms[1].ReferenceID, vms[2].ReferenceID
	// An earlier version published the disk to a.
	if err := e.api.SetDiskNote(ctx, hostLoc, mustDisk(t, id), "vco-csi/holder", strings.ToUpper(a)); err != nil {
		t.Fatal(err)
	}
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: b, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, r.PublishContext, id, b), a)
	unpublishFrom(t, e, id, b)
	// The controller is rolled back, publishes to c (its note: c alone),
	// and rolled forward again.
	if err := e.api.SetDiskNote(ctx, hostLoc, mustDisk(t, id), "vco-csi/holder", c); err != nil {
		t.Fatal(err)
	}
	r, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a, VolumeCapability: rwo[0]})
	if err != nil {
		t.Fatal(err)
	}
	wantSupersedes(t, grantOf(t, r.PublishContext, id, a), b, c)
	// What a controller of the earlier version reads: the last holder.
	notes, err := e.api.ListDiskNotes(ctx, hostLoc, mustDisk(t, id))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range notes {
		if n.Title == "vco-csi/holder" && n.Content != a {
			t.Fatalf("vco-csi/holder says %q after the publish to %s", n.Content, a)
		}
	}
}

// TestHoldersAreBounded: the list keeps the most recent 32 nodes, so the
// grant after 34 different nodes names the 31 others among them.
func TestHoldersAreBounded(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "travelled"})
	var refs []string
	for i := range 34 {
		ref := fmt.Sprintf("b0b00000-0000-4000-8000-%012d", i+1)
		if _, err := e.sim.AddVM("cs-"+hostLoc, fmt.Sprintf("node-%d", i), ref, false); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	var last *fence.Grant
	for i, ref := range refs {
		r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: ref, VolumeCapability: rwo[0]})
		if err != nil {
			t.Fatal(err)
		}
		last = grantOf(t, r.PublishContext, id, ref)
		if i > 0 && i < 32 {
			wantSupersedes(t, last, refs[:i]...)
		}
		unpublishFrom(t, e, id, ref)
	}
	wantSupersedes(t, last, refs[2:33]...)
}

// TestUnreadableHoldersNoteRefusesPublish: a holders note that names no
// node (edited by hand) stops the publish before anything is attached,
// saying which note to correct.
func TestUnreadableHoldersNoteRefusesPublish(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	id := createVolume(t, e, &csi.CreateVolumeRequest{Name: "edited"})
	if err := e.api.SetDiskNote(ctx, hostLoc, mustDisk(t, id), "vco-csi/holders", vmsOf(t, e, hostLoc)[0].ReferenceID+",node-7"); err != nil {
		t.Fatal(err)
	}
	_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: rwo[0]})
	wantCode(t, err, codes.FailedPrecondition, id, "vco-csi/holders", "node-7")
	if d, _ := e.api.GetDisk(ctx, hostLoc, mustDisk(t, id)); d.VMID != 0 {
		t.Fatalf("the refused publish attached the disk to VM %d", d.VMID)
	}
}
