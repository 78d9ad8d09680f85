package volume

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// The host has no SCSI, so these tests put the real reservation engine in
// front of a real loop device, its commands answered by scsitest (a model
// SPC-4 target, one I_T nexus per node). Mounts, BLKROSET, the remount and
// every agent decision are real; the lab repeats this against tgt.

const nodeB = "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab"

var (
	keyA, _ = fence.KeyFromUUID(nodeA)
	keyB, _ = fence.KeyFromUUID(nodeB)
	names   = fence.Directory{keyA: "node-a", keyB: "node-b"}
)

// modelFencing fences every disk through the model target as node. With
// offset set it also behaves like a method that keeps metadata on the
// disk (as the lease does): the volume's data starts at offset, and the
// manager's onLost callback is kept for the test to call.
type modelFencing struct {
	tgt    *scsitest.Target
	node   string
	offset int64
	mu     sync.Mutex
	onLost func(*fence.LostError) bool
}

func (f *modelFencing) Choose(_ context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	key, _ := fence.KeyFromUUID(f.node)
	e, err := pr.New(dev.Path, f.tgt.Initiator(f.node), pr.Config{Key: key, Node: f.node, Disk: volume, Resolver: names, Verify: dev.Verify})
	if err != nil {
		return Choice{}, err
	}
	if onLost != nil {
		f.mu.Lock()
		f.onLost = onLost
		f.mu.Unlock()
	}
	if f.offset > 0 {
		// Metadata kept on the disk is not forgotten by a restarting
		// target: such a method is no fence.WaitingAcquirer.
		return Choice{Fencer: onDisk{e}, Method: fence.MethodPR, DataOffset: f.offset}, nil
	}
	return Choice{Fencer: e, Method: fence.MethodPR}, nil
}

// onDisk is a fencer that keeps its claim on the disk itself, as the
// lease does.
type onDisk struct{ fence.Fencer }

func newFencedEnv(t *testing.T) (*env, *scsitest.Target) {
	tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: true})
	e := newEnvWith(t, &modelFencing{tgt: tgt, node: nodeA})
	e.cfg.AllowUnfenced = false
	e.start()
	return e, tgt
}

// nodeBEngine is the other node's engine on the same model target.
func nodeBEngine(t *testing.T, tgt *scsitest.Target, volume string) *pr.Engine {
	e, err := pr.New("/dev/sdb", tgt.Initiator(nodeB), pr.Config{Key: keyB, Node: nodeB, Disk: volume, Resolver: names})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func deviceReadOnly(t *testing.T, dev string) bool {
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ro, err := readOnly(f)
	if err != nil {
		t.Fatal(err)
	}
	return ro
}

func metric(t *testing.T, m *Manager, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := m.Metrics().Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, mm := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !hasLabel(mm, labels[i], labels[i+1]) {
					continue next
				}
			}
			if mm.GetCounter() != nil {
				return mm.GetCounter().GetValue()
			}
			return mm.GetGauge().GetValue()
		}
	}
	return 0
}

func hasLabel(m *dto.Metric, k, v string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == k && l.GetValue() == v {
			return true
		}
	}
	return false
}

func TestHeldDiskIsRefusedReadOnlyAndTakenOverOnlyWithAGrant(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	if _, err := nodeBEngine(t, tgt, "vol-h").Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	req := e.stageReq("vol-h", img, "h")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "held by another node", keyB.String(), "node-b")
	if !deviceReadOnly(t, dev) || isMounted(t, req.StagingPath) || blkid(t, dev, "TYPE") != "" {
		t.Fatalf("refused disk: read-only %v, mounted %v, type %q", deviceReadOnly(t, dev), isMounted(t, req.StagingPath), blkid(t, dev, "TYPE"))
	}
	ev := e.event(events.DiskRefused)
	if ev.Volume != "vol-h" || ev.HolderKey != uint64(keyB) || ev.HolderNode != "node-b" || !strings.Contains(ev.Message, keyB.String()) {
		t.Fatalf("refusal event: %+v", ev)
	}
	if metric(t, e.m, "vco_agent_refusals_total") != 1 {
		t.Fatal("refusal not counted")
	}
	if c, _ := e.m.Store().Get("vol-h"); c != nil {
		t.Fatalf("refused first stage left a record: %+v", c)
	}
	// A grant for another key does not help.
	req.Grant = &fence.Grant{Disk: "vol-h", Node: nodeA, Supersedes: []fence.Key{keyA + 1}}
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "does not name this key")
	// The controller's grant naming node B's key: taken over.
	req.Grant = &fence.Grant{Disk: "vol-h", Node: nodeA, Supersedes: []fence.Key{keyB}}
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Method != fence.MethodPR || !res.Formatted {
		t.Fatalf("granted stage: %+v %v", res, err)
	}
	if ev := e.event(events.TakeoverGranted); ev.HolderKey != uint64(keyB) {
		t.Fatalf("takeover event: %+v", ev)
	}
	if deviceReadOnly(t, dev) || !isMounted(t, req.StagingPath) {
		t.Fatal("the disk taken over is still read-only or not mounted")
	}
	if holder, key, _, ok := tgt.Reservation(); !ok || holder != nodeA || key != uint64(keyA) {
		t.Fatalf("reservation after takeover: %s %x %v", holder, key, ok)
	}
}

func TestLostClaimStopsIOAndIsNotReclaimedWithoutAGrant(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	req := e.stageReq("vol-l", img, "l")
	req.AllowUnfenced = false
	target := e.target("p", "vol")
	e.stagePublishAndKeepTheClaim(ctx, req, target)

	// Node B takes the disk over with its own grant: node A's claim is lost.
	if _, err := nodeBEngine(t, tgt, "vol-l").Acquire(ctx, &fence.Grant{Disk: "vol-l", Node: nodeB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	e.m.CheckAll(ctx)
	e.lostToNodeBStopsIO(ctx, req, dev, target)
	// Never re-claimed by itself: not by the check, not by a restart, not
	// by a stage without a grant.
	e.m.CheckAll(ctx)
	e.start()
	e.m.Reconcile(ctx)
	if _, ok := tgt.Registered(nodeA); ok {
		t.Fatal("node A registered again by itself")
	}
	if st, _ := e.m.Stats(ctx, "vol-l", ""); !st.Abnormal {
		t.Fatal("lost volume reported healthy after restart")
	}
	wantCode(t, e.m.Unpublish(ctx, "vol-l", target), codes.OK)
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "needs a takeover grant")

	e.grantedRestageGetsItBack(ctx, req)
	if err := e.m.Unstage(ctx, "vol-l", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if _, ok := tgt.Registered(nodeA); ok {
		t.Fatal("unstage left node A registered")
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("unstage left the reservation")
	}
}

// stagePublishAndKeepTheClaim stages vol-l under persistent reservations,
// publishes it at target and writes "before" to data. An intact claim
// passes the periodic check; a restarted agent re-verifies and keeps it.
func (e *env) stagePublishAndKeepTheClaim(ctx context.Context, req StageRequest, target string) {
	t := e.t
	t.Helper()
	if res, err := e.m.Stage(ctx, req); err != nil || res.Method != fence.MethodPR {
		t.Fatalf("stage: %+v %v", res, err)
	}
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-l", StagingPath: req.StagingPath, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "data"), []byte("before"), 0o644); err != nil {
		t.Fatal(err)
	}
	// An intact claim passes the periodic check.
	e.m.CheckAll(ctx)
	if metric(t, e.m, "vco_agent_claim_checks_total", "result", "ok") != 1 || metric(t, e.m, "vco_agent_claims", "state", "held") != 1 {
		t.Fatal("intact claim not counted as checked and held")
	}
	// A restarted agent re-verifies and keeps it.
	e.start()
	e.m.Reconcile(ctx)
	if c, _ := e.m.Store().Get("vol-l"); c == nil || c.State != StateHeld {
		t.Fatalf("claim after restart: %+v", c)
	}
}

// lostToNodeBStopsIO: the check that found vol-l lost to node B announces
// it, sets the disk read-only so no write goes through the staging path
// or the target, reports the volume abnormal naming B's key, and counts
// the loss.
func (e *env) lostToNodeBStopsIO(ctx context.Context, req StageRequest, dev, target string) {
	t := e.t
	t.Helper()
	ev := e.event(events.DiskFenced)
	if ev.Volume != "vol-l" || ev.HolderKey != uint64(keyB) || ev.Reason != "claim-lost" {
		t.Fatalf("fenced event: %+v", ev)
	}
	if !deviceReadOnly(t, dev) {
		t.Fatal("lost disk not set read-only")
	}
	for _, p := range []string{req.StagingPath, target} {
		if err := os.WriteFile(filepath.Join(p, "after"), []byte("x"), 0o644); err == nil {
			t.Fatalf("write through %s succeeded after the claim was lost", p)
		}
	}
	st, err := e.m.Stats(ctx, "vol-l", target)
	if err != nil || !st.Abnormal || !strings.Contains(st.Message, "lost") || !strings.Contains(st.Message, keyB.String()) {
		t.Fatalf("stats of a lost volume: %+v %v", st, err)
	}
	if metric(t, e.m, "vco_agent_fences_total") != 1 || metric(t, e.m, "vco_agent_claims", "state", "lost") != 1 {
		t.Fatal("loss not counted")
	}
}

// grantedRestageGetsItBack: with the controller's grant naming node B,
// node A gets it back, and the data written before the loss is there,
// writable again.
func (e *env) grantedRestageGetsItBack(ctx context.Context, req StageRequest) {
	t := e.t
	t.Helper()
	req.Grant = &fence.Grant{Disk: "vol-l", Node: nodeA, Supersedes: []fence.Key{keyB}}
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Formatted {
		t.Fatalf("granted restage: %+v %v", res, err)
	}
	if b, err := os.ReadFile(filepath.Join(req.StagingPath, "data")); err != nil || string(b) != "before" {
		t.Fatalf("data after restage: %q %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "after"), []byte("x"), 0o644); err != nil {
		t.Fatalf("write after the granted restage: %v", err)
	}
}

func clearRO(dev string) {
	if f, err := os.Open(dev); err == nil {
		unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0)
		f.Close()
	}
}

// Issue 4's restart scenario: the claim is preempted while the agent is
// down; the agent reports DiskFenced at start and stops I/O.
func TestClaimLostWhileTheAgentWasDownIsFencedAtStart(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	req := e.stageReq("vol-d", img, "d")
	req.AllowUnfenced = false
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	e.m.Close()
	if _, err := nodeBEngine(t, tgt, "vol-d").Acquire(ctx, &fence.Grant{Disk: "vol-d", Node: nodeB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	e.start()
	e.m.Reconcile(ctx)
	ev := e.event(events.DiskFenced)
	if ev.Volume != "vol-d" || !strings.Contains(ev.Message, "lost") {
		t.Fatalf("fenced event at start: %+v", ev)
	}
	if !deviceReadOnly(t, dev) {
		t.Fatal("disk lost while the agent was down is writable")
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "x"), []byte("x"), 0o644); err == nil {
		t.Fatal("filesystem writable after the loss was found at start")
	}
	if st, _ := e.m.Stats(ctx, "vol-d", ""); !st.Abnormal {
		t.Fatal("volume not abnormal")
	}
	if _, ok := tgt.Registered(nodeA); ok {
		t.Fatal("the agent registered again at start")
	}
}

// A fencing method with metadata at the start of the disk: the volume is
// staged on a mapping past it, the metadata is never written, and a loss
// the fencer notices by itself stops I/O through the callback.
func TestDataAreaPastFencingMetadataAndSelfReportedLoss(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	mf := &modelFencing{tgt: tgt, node: nodeA, offset: 1 << 20}
	e := newEnvWith(t, mf)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	meta := bytes.Repeat([]byte("METADATA"), 512)
	if err := os.WriteFile(img, meta, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	req := e.stageReq("vol-m", img, "m")
	req.AllowUnfenced = false
	res := e.stagedOnAMappingPastTheMetadata(ctx, req, img, dev, meta)
	// Retry, unstage (mapping goes), restage (same filesystem).
	if r2, err := e.m.Stage(ctx, req); err != nil || r2.Formatted || r2.Device != res.Device {
		t.Fatalf("retried stage: %+v %v", r2, err)
	}
	if err := e.m.Unstage(ctx, "vol-m", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if p, ok := e.m.findDataMapping(dev, 1<<20); ok {
		t.Fatalf("data mapping %s left after unstage", p)
	}
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Formatted {
		t.Fatalf("restage: %+v %v", res, err)
	}
	t.Cleanup(func() { dropDataMapping(res.Device) })
	if _, err := os.Stat(filepath.Join(req.StagingPath, "data")); err != nil {
		t.Fatal(err)
	}

	// The fencer reports the loss itself: I/O stops before anything else.
	mf.mu.Lock()
	onLost := mf.onLost
	mf.mu.Unlock()
	onLost(&fence.LostError{Device: dev, Reason: "lease taken by key " + keyB.String(), Holder: keyB, HolderNode: "node-b"})
	if !deviceReadOnly(t, dev) {
		t.Fatal("not read-only right after the loss was reported")
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "after"), []byte("x"), 0o644); err == nil {
		t.Fatal("filesystem writable right after the loss was reported")
	}
	if ev := e.event(events.DiskFenced); ev.Volume != "vol-m" || ev.HolderNode != "node-b" {
		t.Fatalf("fenced event: %+v", ev)
	}
	if st, _ := e.m.Stats(ctx, "vol-m", ""); !st.Abnormal || !strings.Contains(st.Message, "lease taken") {
		t.Fatalf("stats: %+v", st)
	}
}

// stagedOnAMappingPastTheMetadata: the first stage formats a mapping of
// dev at 1 MiB, past the fencing metadata meta at the start of img, which
// a write through the filesystem leaves as it was. It returns the stage's
// answer.
func (e *env) stagedOnAMappingPastTheMetadata(ctx context.Context, req StageRequest, img, dev string, meta []byte) StageResult {
	t := e.t
	t.Helper()
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Device == dev || !res.Formatted {
		t.Fatalf("stage: %+v %v", res, err)
	}
	t.Cleanup(func() { dropDataMapping(res.Device) })
	if b, _ := os.ReadFile("/sys/block/" + filepath.Base(res.Device) + "/loop/offset"); strings.TrimSpace(string(b)) != "1048576" {
		t.Fatalf("mapping %s offset %q", res.Device, b)
	}
	if blkid(t, res.Device, "TYPE") != "ext4" {
		t.Fatal("no filesystem on the data mapping")
	}
	os.WriteFile(filepath.Join(req.StagingPath, "data"), []byte("x"), 0o644)
	syncFS(req.StagingPath)
	head := make([]byte, len(meta))
	if f, err := os.Open(img); err == nil {
		f.ReadAt(head, 0)
		f.Close()
	}
	if !bytes.Equal(head, meta) {
		t.Fatal("the fencing metadata area was written")
	}
	return res
}

func syncFS(p string) {
	if f, err := os.Open(p); err == nil {
		unix.Syncfs(int(f.Fd()))
		f.Close()
	}
}

// A raw block volume has no filesystem to remount: the block layer's
// read-only flag refuses writes even through a descriptor the pod opened
// before the loss.
func TestLostRawBlockVolumeRefusesWritesOnOpenDescriptors(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 16)
	t.Cleanup(func() { clearRO(dev) })
	req := StageRequest{Volume: "vol-rb", Locator: Locator{BackingFile: img}, StagingPath: e.blockStaging("rb"), Block: true}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	target := e.blockTarget("dev", "p")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-rb", StagingPath: req.StagingPath, TargetPath: target, Block: true}); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(target, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("before"), 0); err != nil {
		t.Fatalf("write before the loss: %v", err)
	}
	if _, err := nodeBEngine(t, tgt, "vol-rb").Acquire(ctx, &fence.Grant{Disk: "vol-rb", Node: nodeB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	e.m.CheckAll(ctx)
	e.event(events.DiskFenced)
	if _, err := f.WriteAt([]byte("after"), 0); !errors.Is(err, unix.EPERM) {
		t.Fatalf("write after the loss: %v, want EPERM", err)
	}
}
