package driver_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// The publish simulation drives ControllerPublishVolume and
// ControllerUnpublishVolume through every short sequence a CO can ask for
// over three nodes, and for each makes one cloud API call fail in each way
// it can: an error before the call reaches the cloud, a call that took
// effect but whose answer was lost, the controller dying before or after
// the call (its successor is a fresh driver over the same cloud), and, for
// a publish, an attach that does not show within the wait. The CO then
// retries the failed call until it succeeds, or gives a failed publish up
// and unpublishes. After every publish that returns, the grant must name
// the key of every node whose key may be on the disk, of no node that was
// never asked for the free disk, and never the node published to. No
// controller can name exactly the keys on the disk: it cannot know whether
// an attach whose answer it lost took effect, nor whether a publish
// context it returned reached the node; the test holds it to these bounds.
//
// The cloud is the simulator (csi/sim), served in-process; faults are
// injected between the driver and its API client (faultCloud), so each is
// tied to one call and the outcome does not depend on timing. A call is
// named by its kind and how many of that kind the attempt made before it
// (the publish reads the disk, the VM and the notes side by side, so the
// order of calls is not fixed, but what each call is, is).
//
// Every sequence runs on a disk made through the API, and again on one the
// controller made with CreateVolume: there its first publish adds the
// holders note beside its reads, and the test orders that note and the
// notes read both ways (noteOrder), with each fault at that first step.

// simTransport serves the client's requests with the simulator's handler
// in-process: the same requests and answers as over a socket, faster.
type simTransport struct{ h http.Handler }

func (t simTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	t.h.ServeHTTP(rec, r)
	resp := rec.Result()
	resp.Request = r
	return resp, nil
}

// faultKind is how the armed call fails.
type faultKind int

const (
	noFault     faultKind = iota
	errBefore             // the cloud never sees the call; the driver gets an error
	lostAnswer            // the call takes effect; the driver gets an error
	crashBefore           // the controller dies before the call
	crashAfter            // the controller dies after the call took effect
	slowAttach            // (whole call) the attached disk does not show within the wait
)

func (k faultKind) String() string {
	return [...]string{"none", "error-before", "lost-answer", "crash-before", "crash-after", "slow-attach"}[k]
}

// noteOrder is which of a first publish's added note and its notes read,
// sent side by side, the cloud sees first.
type noteOrder int

const (
	readFirst noteOrder = iota
	noteFirst
)

func (o noteOrder) String() string { return [...]string{"notes read first", "note added first"}[o] }

// faultCloud is the controller's view of the cloud: every call of the
// publish and unpublish paths is recorded, and the one named at fails as
// kind says. Once the controller has "died", no call of this instance
// reaches the cloud again. Calls may come concurrently.
type faultCloud struct {
	driver.Cloud
	mu     sync.Mutex
	at     callPoint
	kind   faultKind
	calls  []callPoint // this attempt's, in the order they came
	dead   bool
	fired  string // the call that failed, for the report
	diskID int64
	// order holds back the added note or the notes read of an attempt
	// until the other has answered; the read waits only when the attempt
	// is to add a note (early).
	order           noteOrder
	early           bool
	readDone, added chan struct{}
	// unordered: a wait for the other ended without it.
	unordered bool
	// beforeAttach checks the cloud as an attach is about to reach it.
	beforeAttach func(vm int64)
	// changed is called after every attach or detach that reached the
	// cloud.
	changed func()
}

func injected(op string) error {
	return &cloud.APIError{Op: op, Status: 503, Message: "injected by the publish simulation", Kind: cloud.ErrUnavailable}
}

// callPoint names one call of an attempt: its kind and how many of that
// kind came before it.
type callPoint struct {
	op  string
	nth int
}

func (c callPoint) String() string { return fmt.Sprintf("%s #%d", c.op, c.nth+1) }

// arm clears the record and arms kind at the call at; early says the
// attempt is to add its holders note beside its reads.
func (f *faultCloud) arm(kind faultKind, at callPoint, early bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls, f.kind, f.at, f.fired, f.early, f.unordered = nil, kind, at, "", early, false
	f.readDone, f.added = make(chan struct{}), make(chan struct{})
}

// hold waits, in the order armed, for the other of an added note and a
// notes read to answer, and returns what to close once this one has. A
// wait that ends without it is a driver that did not send both side by
// side: the attempt goes on, and fails the run.
func (f *faultCloud) hold(read bool) (done chan struct{}) {
	f.mu.Lock()
	wait, done := f.readDone, f.added
	if read {
		wait, done = f.added, f.readDone
	}
	if read != (f.order == noteFirst) || !f.early {
		wait = nil
	}
	f.mu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-time.After(2 * time.Second):
			f.mu.Lock()
			f.unordered = true
			f.mu.Unlock()
		}
	}
	return done
}

// answered closes c, once.
func (f *faultCloud) answered(c chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

// outcome is what the attempt's fault did, whether the controller died,
// and whether an added note and the notes read failed to meet.
func (f *faultCloud) outcome() (fired string, dead, unordered bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fired, f.dead, f.unordered
}

// made is the attempt's calls so far.
func (f *faultCloud) made() []callPoint {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// next records a call and says how it goes.
func (f *faultCloud) next(op string) (faultKind, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.dead {
		return noFault, injected(op + " (controller gone)")
	}
	c := callPoint{op, 0}
	for _, x := range f.calls {
		if x.op == op {
			c.nth++
		}
	}
	f.calls = append(f.calls, c)
	if c != f.at || f.kind == noFault || f.kind == slowAttach {
		return noFault, nil
	}
	f.fired = fmt.Sprintf("%s at %s", f.kind, c)
	if f.kind == crashBefore || f.kind == crashAfter {
		f.dead = true
	}
	return f.kind, nil
}

func (f *faultCloud) do(op string, call func() error) error {
	kind, err := f.next(op)
	switch {
	case err != nil:
		return err
	case kind == noFault:
		return call()
	case kind == errBefore || kind == crashBefore:
		return injected(op)
	case kind == lostAnswer || kind == crashAfter:
		_ = call()
		return injected(op)
	}
	panic("unknown fault kind")
}

func (f *faultCloud) GetDisk(ctx context.Context, loc string, id int64) (d *cloud.Disk, err error) {
	err = f.do("GetDisk", func() error { d, err = f.Cloud.GetDisk(ctx, loc, id); return err })
	return d, err
}

func (f *faultCloud) ListDiskNotes(ctx context.Context, loc string, id int64) (n []cloud.Note, err error) {
	done := f.hold(true)
	defer f.answered(done)
	err = f.do("ListDiskNotes", func() error { n, err = f.Cloud.ListDiskNotes(ctx, loc, id); return err })
	return n, err
}

func (f *faultCloud) AddDiskNote(ctx context.Context, loc string, id int64, title, content string) error {
	done := f.hold(false)
	defer f.answered(done)
	return f.do("AddDiskNote "+title, func() error { return f.Cloud.AddDiskNote(ctx, loc, id, title, content) })
}

func (f *faultCloud) SetDiskNoteIn(ctx context.Context, loc string, id int64, notes []cloud.Note, title, content string) error {
	return f.do("SetDiskNoteIn "+title, func() error { return f.Cloud.SetDiskNoteIn(ctx, loc, id, notes, title, content) })
}

func (f *faultCloud) ListCloudspaces(ctx context.Context) (c []cloud.Cloudspace, err error) {
	err = f.do("ListCloudspaces", func() error { c, err = f.Cloud.ListCloudspaces(ctx); return err })
	return c, err
}

func (f *faultCloud) ListVMs(ctx context.Context, cs string) (v []cloud.VM, err error) {
	err = f.do("ListVMs", func() error { v, err = f.Cloud.ListVMs(ctx, cs); return err })
	return v, err
}

func (f *faultCloud) ListVMDisks(ctx context.Context, cs string, vm int64) (ds []cloud.VMDisk, err error) {
	err = f.do("ListVMDisks", func() error { ds, err = f.Cloud.ListVMDisks(ctx, cs, vm); return err })
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.kind == slowAttach && err == nil {
		ds = slices.DeleteFunc(ds, func(d cloud.VMDisk) bool { return d.ID == f.diskID })
		f.fired = "slow-attach"
	}
	return ds, err
}

func (f *faultCloud) AttachDisk(ctx context.Context, cs string, vm, id int64) error {
	return f.do("AttachDisk", func() error {
		f.beforeAttach(vm)
		err := f.Cloud.AttachDisk(ctx, cs, vm, id)
		f.changed()
		return err
	})
}

func (f *faultCloud) DetachDisk(ctx context.Context, cs string, vm, id int64) error {
	return f.do("DetachDisk", func() error { err := f.Cloud.DetachDisk(ctx, cs, vm, id); f.changed(); return err })
}

// simOp is one CO request: publish (or unpublish) the volume to node.
type simOp struct {
	publish bool
	node    int
}

func (o simOp) String() string {
	if o.publish {
		return "P" + string(rune('A'+o.node))
	}
	return "U" + string(rune('A'+o.node))
}

func seqName(seq []simOp) string {
	s := make([]string, len(seq))
	for i, o := range seq {
		s[i] = o.String()
	}
	return strings.Join(s, "-")
}

// coSequences lists every sequence of up to n requests over nodes that a
// CO makes for a ReadWriteOnce volume: a publish only while no other node
// has it, an unpublish only where it is published. Nodes are named in the
// order they first appear, so sequences that differ only in which node is
// which are run once. Without repeats, no publish follows a publish to the
// same node (the retries after each fault repeat publishes anyway).
func coSequences(n, nodes int, repeats bool) [][]simOp {
	var out [][]simOp
	var walk func(seq []simOp, holder, used int)
	walk = func(seq []simOp, holder, used int) {
		if len(seq) > 0 {
			out = append(out, slices.Clone(seq))
		}
		if len(seq) == n {
			return
		}
		for x := 0; x < nodes && x <= used; x++ {
			nu := max(used, x+1)
			again := len(seq) > 0 && seq[len(seq)-1] == simOp{true, x}
			if (holder == -1 || holder == x) && (repeats || !again) {
				walk(append(seq, simOp{true, x}), x, nu)
			}
			if holder == x {
				walk(append(seq, simOp{false, x}), -1, nu)
			}
		}
	}
	walk(nil, -1, 0)
	return out
}

// simSequences are the simulation's sequences: every one of up to four
// requests over three nodes, and those of five and six without repeated
// publishes, which take the disk to a third node (PA-UA-PB-UB-PC: a
// died, b timed out once, c). A sequence that begins another is left out:
// the longer one's runs play it, with the same faults, and go on.
func simSequences() [][]simOp {
	all := coSequences(4, 3, true)
	for _, s := range coSequences(6, 3, false) {
		if len(s) > 4 {
			all = append(all, s)
		}
	}
	var out [][]simOp
	for _, s := range all {
		if !slices.ContainsFunc(all, func(l []simOp) bool { return len(l) > len(s) && slices.Equal(l[:len(s)], s) }) {
			out = append(out, s)
		}
	}
	return out
}

// simFault is the one failure of a run: the call at of step's first
// attempt fails as kind says, and the CO then retries (or, abandon, gives
// a failed publish up and unpublishes).
type simFault struct {
	step    int
	at      callPoint
	kind    faultKind
	abandon bool
}

func (f simFault) String() string {
	if f.kind == noFault {
		return "no fault"
	}
	then := "retry"
	if f.abandon {
		then = "abandon"
	}
	return fmt.Sprintf("step %d, %s at %s, then %s", f.step+1, f.kind, f.at, then)
}

// simWorld is one run's cloud and the truth the test keeps about it.
type simWorld struct {
	t       testing.TB
	api     *cloud.Client
	id      string
	diskID  int64
	vms     []cloud.VM
	refs    []string
	keys    []fence.Key
	drv     *driver.Driver
	fc      *faultCloud
	restart int
	trace   []string
	// what names the run, to replay it.
	what string

	// attachedEver: the disk was attached to the node's VM at some time.
	// given: a publish context went to the node. Either may have put the
	// node's key on the disk, and nothing in the sequence removes it (no
	// node stages here, and the controller could not tell if one had).
	attachedEver, given map[int]bool
	// asked: a publish to the node reached the controller while the disk
	// was attached to no other VM; only such a node may be recorded.
	asked map[int]bool
	// on is the node the disk is attached to (-1: none), known while
	// onKnown; an attach or detach that reaches the cloud unsets it.
	on      int
	onKnown bool
	// made: the controller now running made the disk and has not been
	// asked to publish it, so its next publish adds the holders note
	// beside its reads, in the order.
	made bool
	how  worldDisk
}

// worldDisk is how a run's disk is made: through the API, or by the
// controller (CreateVolume), its first publish's note and read in order.
type worldDisk struct {
	byController bool
	order        noteOrder
}

func (o worldDisk) String() string {
	if !o.byController {
		return "disk made through the API"
	}
	return "disk made by the controller, " + o.order.String()
}

func newSimWorld(t testing.TB, tokenFile string, how worldDisk) *simWorld {
	seed := sim.DefaultSeed()
	seed.HostVM.ReferenceID, seed.HostVM.Location = hostUUID, hostLoc
	s, err := sim.New(sim.Options{Customer: "acme", Token: testJWT, Seed: seed})
	if err != nil {
		t.Fatal(err)
	}
	api, err := cloud.New(cloud.Config{BaseURL: "https://sim.invalid/api/1", Customer: "acme", TokenFile: tokenFile,
		HTTPClient: &http.Client{Transport: simTransport{s}}, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	vms, err := api.ListVMs(ctx, "cs-"+hostLoc)
	if err != nil || len(vms) < 3 {
		t.Fatalf("the simulator's VMs in %s: %v %v", hostLoc, vms, err)
	}
	w := &simWorld{t: t, api: api, vms: vms[:3], how: how,
		attachedEver: map[int]bool{}, given: map[int]bool{}, asked: map[int]bool{}}
	for _, vm := range w.vms {
		k, err := fence.KeyFromUUID(vm.ReferenceID)
		if err != nil {
			t.Fatal(err)
		}
		w.refs, w.keys = append(w.refs, vm.ReferenceID), append(w.keys, k)
	}
	w.start()
	if how.byController {
		v, err := w.drv.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "sim", VolumeCapabilities: rwo})
		if err != nil {
			t.Fatal(err)
		}
		w.id, w.made = v.Volume.VolumeId, true
		// The controller knows the VMs, as its node location map has
		// it every minute: the added note is only for a known VM.
		if _, err := w.drv.NodeLocationMap(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := fmt.Sscanf(w.id, hostLoc+"/%d", &w.diskID); err != nil {
			t.Fatalf("volume id %q: %v", w.id, err)
		}
	} else {
		if w.diskID, err = api.CreateDisk(ctx, hostLoc, cloud.DiskSpec{Name: "sim", SizeGiB: 1}); err != nil {
			t.Fatal(err)
		}
		w.id = fmt.Sprintf("%s/%d", hostLoc, w.diskID)
	}
	w.fc.diskID = w.diskID
	return w
}

// start makes a new controller over the same cloud: a restart.
func (w *simWorld) start() {
	w.fc = &faultCloud{Cloud: w.api, diskID: w.diskID, changed: w.changed, order: w.how.order, beforeAttach: w.recordedBeforeAttach}
	w.made = false // a new controller knows of no disk it made
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Version: "sim", Mode: driver.ModeController,
		Cloud: w.fc, DefaultLocation: hostLoc, AttachPoll: time.Millisecond, AttachTimeout: 15 * time.Millisecond})
	if err != nil {
		w.t.Fatal(err)
	}
	w.drv = d
	w.restart++
}

// attachedTo is the node whose VM has the disk, -1 for none; the test's
// own look, not counted as a controller call.
func (w *simWorld) attachedTo() int {
	if w.onKnown {
		return w.on
	}
	w.on, w.onKnown = w.lookOn(), true
	return w.on
}

func (w *simWorld) lookOn() int {
	d, err := w.api.GetDisk(context.Background(), hostLoc, w.diskID)
	if err != nil {
		w.t.Fatal(err)
	}
	for i, vm := range w.vms {
		if d.VMID == vm.ID {
			return i
		}
	}
	if d.VMID != 0 {
		w.t.Fatalf("disk on VM %d, not one of the simulation's nodes", d.VMID)
	}
	return -1
}

// recordedBeforeAttach fails the run unless the disk's notes name the node
// of VM vm, whose attach is about to reach the cloud: no attach is asked
// before its node is recorded (docs/fencing.md).
func (w *simWorld) recordedBeforeAttach(vm int64) {
	notes, err := w.api.ListDiskNotes(context.Background(), hostLoc, w.diskID)
	if err != nil {
		w.t.Fatal(err)
	}
	for i, v := range w.vms {
		if v.ID != vm {
			continue
		}
		me, _ := fence.CanonicalUUID(w.refs[i])
		for _, n := range notes {
			if n.Title != "vco-csi/holders" {
				continue
			}
			for _, e := range strings.Split(n.Content, ",") {
				if u, err := fence.CanonicalUUID(e); err == nil && u == me {
					return
				}
			}
		}
		w.fail("the attach to node %c was asked for before a holders note named it (notes %+v)", 'A'+i, notes)
	}
}

// changed notes an attach or detach that reached the cloud.
func (w *simWorld) changed() {
	w.onKnown = false
	w.observe()
}

func (w *simWorld) observe() {
	if x := w.attachedTo(); x >= 0 {
		w.attachedEver[x] = true
	}
}

// attempt sends one request with the fault f armed (noFault for none) and
// checks what a publish returns. It restarts the controller when the
// fault killed it.
func (w *simWorld) attempt(op simOp, kind faultKind, at callPoint) (calls []callPoint, err error) {
	early := w.made && op.publish
	w.made = w.made && !op.publish
	w.fc.arm(kind, at, early)
	defer w.fc.arm(noFault, callPoint{}, false)
	ctx := context.Background()
	ref := w.refs[op.node]
	if op.publish {
		if x := w.attachedTo(); x == -1 || x == op.node {
			w.asked[op.node] = true
		}
		// What a node may hold before this publish: the grant is checked
		// against it, not against what this call did.
		must := w.mayHold()
		var r *csi.ControllerPublishVolumeResponse
		r, err = w.drv.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: w.id, NodeId: ref, VolumeCapability: rwo[0]})
		if err == nil {
			w.checkPublished(op.node, must, r.PublishContext)
			if early && !driver.NeverPublished(r.PublishContext) {
				w.fail("the first publish of a volume the controller made, which returned, does not say never published")
			}
			w.given[op.node] = true
		}
	} else {
		_, err = w.drv.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: w.id, NodeId: ref})
	}
	w.observe()
	res := "ok"
	if err != nil {
		res = fmt.Sprintf("%s: %v", driver.CodeForError(err), err)
	}
	fired, dead, unordered := w.fc.outcome()
	if fired != "" {
		res = "[" + fired + "] " + res
	}
	calls = w.fc.made()
	w.trace = append(w.trace, fmt.Sprintf("%s (controller %d, %d calls): %s", op, w.restart, len(calls), res))
	// (A controller that died made no more calls.)
	if added := slices.ContainsFunc(calls, func(c callPoint) bool { return strings.HasPrefix(c.op, "AddDiskNote") }); added != early && !dead {
		w.fail("%s added a note beside its reads: %v, want %v (calls %v)", op, added, early, calls)
	}
	if unordered {
		w.fail("%s: its added note and its notes read did not go out side by side (%s not met)", op, w.how.order)
	}
	if dead {
		w.start()
	}
	return calls, err
}

// mayHold is the set of nodes whose key may be on the disk.
func (w *simWorld) mayHold() map[int]bool {
	m := map[int]bool{}
	for x := range w.attachedEver {
		m[x] = true
	}
	for x := range w.given {
		m[x] = true
	}
	return m
}

func (w *simWorld) fail(format string, a ...any) {
	w.t.Helper()
	w.t.Fatalf("%s\nrun: %s\nwhat happened:\n  %s", fmt.Sprintf(format, a...), w.what, strings.Join(w.trace, "\n  "))
}

// checkPublished is the invariant: the grant in a publish context for
// node x supersedes the key of every other node that may hold one
// (must), of no node the controller was never asked to publish to while
// the disk was free, and never x's own. The never-published flag is set
// only while no context had been given.
func (w *simWorld) checkPublished(x int, must map[int]bool, pc map[string]string) {
	w.t.Helper()
	if driver.NeverPublished(pc) && len(w.given) > 0 {
		w.fail("publish to %s says never published, after contexts went to %v", simOp{true, x}, w.given)
	}
	var g *fence.Grant
	if raw, ok := pc[driver.PubFenceGrant]; ok {
		var err error
		if g, err = fence.ParseGrant(raw); err != nil {
			w.fail("publish to node %c: grant %q: %v", 'A'+x, raw, err)
		}
		if err := g.ForNode(w.refs[x], w.id); err != nil {
			w.fail("publish to node %c: grant %q: %v", 'A'+x, raw, err)
		}
	}
	for y := range w.refs {
		named := g.Names(w.keys[y])
		switch {
		case y == x && named:
			w.fail("the grant for node %c supersedes its own key: %+v", 'A'+x, g)
		case y != x && must[y] && !named:
			w.fail("the grant for node %c does not supersede node %c's key, which may be on the disk: %+v", 'A'+x, 'A'+y, g)
		case y != x && named && !w.asked[y]:
			w.fail("the grant for node %c supersedes node %c, which was never published the free disk: %+v", 'A'+x, 'A'+y, g)
		}
	}
	if g != nil {
		seen := map[fence.Key]bool{}
		for _, k := range g.Supersedes {
			if seen[k] || !slices.Contains(w.keys, k) {
				w.fail("the grant for node %c names key %s twice or of no node: %+v", 'A'+x, k, g)
			}
			seen[k] = true
		}
	}
}

// untilOK retries op as the CO does; it must succeed within a few tries.
func (w *simWorld) untilOK(op simOp) {
	for range 3 {
		if _, err := w.attempt(op, noFault, callPoint{}); err == nil {
			return
		}
	}
	w.fail("%s still fails after 3 retries without faults", op)
}

// run plays seq with fault f and returns the calls each step's first
// attempt made.
func (w *simWorld) run(seq []simOp, f simFault) [][]callPoint {
	w.what = fmt.Sprintf("sequence %s, %s, %s (replay: go test ./csi/driver -run 'TestPublishSimulation/^%s$')", seqName(seq), w.how, f, seqName(seq))
	counts := make([][]callPoint, len(seq))
	for i, op := range seq {
		if i != f.step {
			n, err := w.attempt(op, noFault, callPoint{})
			counts[i] = n
			if err != nil {
				w.fail("%s failed without a fault: %v", op, err)
			}
			w.probe()
			continue
		}
		n, err := w.attempt(op, f.kind, f.at)
		counts[i] = n
		if err == nil {
			w.probe()
			continue
		}
		if f.abandon && op.publish {
			w.untilOK(simOp{false, op.node})
		} else {
			w.untilOK(op)
		}
		w.probe()
	}
	return counts
}

// probe asks, as a CO must not, to publish the disk to another node while
// it is attached: the controller refuses, and must record nothing (the
// grant check's "never published the free disk").
func (w *simWorld) probe() {
	x := w.attachedTo()
	if x < 0 {
		return
	}
	other := simOp{true, (x + 1) % len(w.refs)}
	if _, err := w.attempt(other, noFault, callPoint{}); driver.CodeForError(err) != codes.FailedPrecondition {
		w.fail("%s while the disk is attached to node %c: %v, want FailedPrecondition", other, 'A'+x, err)
	}
}

func TestPublishSimulation(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "token")
	if err := os.WriteFile(tok, []byte(testJWT), 0o600); err != nil {
		t.Fatal(err)
	}
	seqs := simSequences()
	runs := 0
	start := time.Now()
	for _, seq := range seqs {
		t.Run(seqName(seq), func(t *testing.T) {
			// On a disk the controller made only the first step differs
			// (its added note): the faults there are played, the rest as
			// on any disk.
			for _, how := range []worldDisk{{}, {true, readFirst}, {true, noteFirst}} {
				clean := newSimWorld(t, tok, how).run(seq, simFault{step: -1})
				runs++
				for step, op := range seq {
					if how.byController && step > 0 {
						break
					}
					for _, f := range stepFaults(step, op, clean[step]) {
						newSimWorld(t, tok, how).run(seq, f)
						runs++
					}
				}
			}
		})
	}
	t.Logf("%d sequences, %d runs, %v", len(seqs), runs, time.Since(start).Round(time.Millisecond))
}

// stepFaults are the faults played at step, whose first attempt made
// calls in a run without faults: each way each call can fail, then the
// CO's retry or, for a publish, its giving up; and an attach too slow.
func stepFaults(step int, op simOp, calls []callPoint) []simFault {
	var out []simFault
	for _, kind := range []faultKind{errBefore, lostAnswer, crashBefore, crashAfter} {
		for _, at := range calls {
			for _, abandon := range []bool{false, true} {
				if !abandon || op.publish {
					out = append(out, simFault{step: step, at: at, kind: kind, abandon: abandon})
				}
			}
		}
	}
	if op.publish {
		for _, abandon := range []bool{false, true} {
			out = append(out, simFault{step: step, kind: slowAttach, abandon: abandon})
		}
	}
	return out
}

// faultCloud must implement what the driver calls.
var _ driver.Cloud = (*faultCloud)(nil)
