package volume

import (
	"context"
	"os/exec"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// Issue 9, the other node's side: the target restarted and forgot node
// B's claim. A stage on node A without a grant finds no registration at
// generation 0 on a disk with a filesystem, and waits for node B to
// re-establish before it would claim.

// forgotten returns node A's manager with reclaim_wait set to wait, and a
// disk with an ext4 filesystem that node B held until the target
// restarted; node B's check has reported the loss.
func forgotten(t *testing.T, wait time.Duration) (*env, *scsitest.Target, *pr.Engine, string, string) {
	t.Helper()
	e, tgt := newFencedEnv(t)
	e.cfg.ReclaimWait = wait
	e.start()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	b := nodeBEngine(t, tgt, "vol-f")
	if _, err := b.Acquire(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	tgt.Restart()
	if err := b.Check(context.Background()); err == nil {
		t.Fatal("node B's check passed on the restarted target")
	}
	return e, tgt, b, img, dev
}

func nodeARead(ini string, cdb []byte) bool {
	return ini == nodeA && len(cdb) > 1 && cdb[0] == scsi.OpPersistentReserveIn && scsi.PRInAction(cdb[1]&0x1f) == scsi.ReadKeys
}

// notClaimed asserts that node A's failed first stage left nothing: no
// registration, no record, nothing mounted, and the device read-only only
// when it was a refusal.
func notClaimed(t *testing.T, e *env, tgt *scsitest.Target, dev string, req StageRequest, refused bool) {
	t.Helper()
	if deviceReadOnly(t, dev) != refused || isMounted(t, req.StagingPath) {
		t.Fatalf("after the stage: read-only %v (want %v), mounted %v", deviceReadOnly(t, dev), refused, isMounted(t, req.StagingPath))
	}
	if _, reg := tgt.Registered(nodeA); reg {
		t.Fatal("node A registered")
	}
	if c, _ := e.m.Store().Get(req.Volume); c != nil {
		t.Fatalf("the first stage left a record: %+v", c)
	}
}

func reclaimWaits(t *testing.T, m *Manager, result string) float64 {
	return metric(t, m, "vco_agent_reclaim_waits_total", "result", result)
}

// givenUpDuringTheWait stages req, whose caller gives up (kubelet's
// deadline) once the stage is in its reclaim wait, and asserts that the
// wait was counted as ended and the stage left nothing behind.
func givenUpDuringTheWait(t *testing.T, e *env, tgt *scsitest.Target, dev string, req StageRequest) {
	t.Helper()
	short, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reads := 0
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		// Node A's first READ KEYS is the stage's own look; the second
		// is the wait's.
		if nodeARead(ini, cdb) {
			if reads++; reads == 2 {
				cancel()
			}
		}
	}
	_, err := e.m.Stage(short, req)
	tgt.BeforeCommand = nil
	wantCode(t, err, codes.Canceled, req.Volume, "re-establish")
	notClaimed(t, e, tgt, dev, req, false)
	if reclaimWaits(t, e.m, "ended") != 1 {
		t.Fatal("the wait cut short is not counted")
	}
}

func TestStageRefusedWhenTheHolderReestablishesDuringTheWait(t *testing.T) {
	e, tgt, b, img, dev := forgotten(t, time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reads := 0
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		// Node A's first READ KEYS is its stage's own look; node B's
		// check comes round during the wait that follows.
		if nodeARead(ini, cdb) {
			if reads++; reads == 2 {
				if _, err := b.Reestablish(ctx); err != nil {
					t.Errorf("node B's re-establish: %v", err)
				}
			}
		}
	}
	req := e.stageReq("vol-f", img, "f")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	tgt.BeforeCommand = nil
	wantCode(t, err, codes.FailedPrecondition, "held by another node", keyB.String(), "node-b")
	ev := e.event(events.DiskRefused)
	if ev.Volume != "vol-f" || ev.HolderKey != uint64(keyB) || ev.HolderNode != "node-b" {
		t.Fatalf("refusal event: %+v", ev)
	}
	notClaimed(t, e, tgt, dev, req, true)
	if reclaimWaits(t, e.m, "refused") != 1 {
		t.Fatal("the wait that ended in a refusal is not counted")
	}
	if err := b.Check(ctx); err != nil {
		t.Fatalf("node B's re-established claim: %v", err)
	}
}

func TestStageClaimsAfterTheWaitWhenNoHolderComesBack(t *testing.T) {
	const wait = 300 * time.Millisecond
	e, tgt, b, img, dev := forgotten(t, wait)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req := e.stageReq("vol-f", img, "f")
	req.AllowUnfenced = false
	start := time.Now()
	res, err := e.m.Stage(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < wait {
		t.Fatalf("claimed after %s, before the %s wait was over", waited, wait)
	}
	if res.Method != fence.MethodPR || res.Formatted || deviceReadOnly(t, dev) || !isMounted(t, req.StagingPath) {
		t.Fatalf("stage after the wait: %+v, read-only %v, mounted %v (the filesystem must be mounted, not made again)", res, deviceReadOnly(t, dev), isMounted(t, req.StagingPath))
	}
	if h, k, _, ok := tgt.Reservation(); !ok || h != nodeA || fence.Key(k) != keyA {
		t.Fatalf("reservation (%q, %s, %v), want node A's", h, fence.Key(k), ok)
	}
	if reclaimWaits(t, e.m, "claimed") != 1 {
		t.Fatal("the wait is not counted")
	}
	// Node B comes back too late and fences itself.
	if _, err := b.Reestablish(ctx); err == nil {
		t.Fatal("node B re-established over node A's claim")
	}
}

func TestStageOfABlankDiskDoesNotWait(t *testing.T) {
	e, tgt := newFencedEnv(t)
	e.cfg.ReclaimWait = time.Hour
	e.start()
	// A new disk: blank, its target at generation 0. A wait would outlast
	// the context.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	if tgt.Generation() != 0 {
		t.Fatal("model: a new target is not at generation 0")
	}
	req := e.stageReq("vol-n", img, "n")
	req.AllowUnfenced = false
	if res, err := e.m.Stage(ctx, req); err != nil || !res.Formatted {
		t.Fatalf("stage of a blank disk: %+v %v", res, err)
	}
	// Unstaged and staged again: its filesystem is data now, but the
	// target's generation moved, so no wait either.
	if err := e.m.Unstage(ctx, "vol-n", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if tgt.Generation() == 0 {
		t.Fatal("model: release left the generation at 0")
	}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("second stage: %v", err)
	}
	for _, r := range []string{"claimed", "refused", "ended", "error"} {
		if n := reclaimWaits(t, e.m, r); n != 0 {
			t.Fatalf("%v waits counted as %s", n, r)
		}
	}
}

func TestReclaimWaitEndsWithTheCallAndItsRetryGoesOn(t *testing.T) {
	e, tgt, _, img, dev := forgotten(t, 2*time.Second)
	req := e.stageReq("vol-f", img, "f")
	req.AllowUnfenced = false
	givenUpDuringTheWait(t, e, tgt, dev, req)
	ctx, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("the retry: %v", err)
	}
	if reclaimWaits(t, e.m, "claimed") != 1 {
		t.Fatal("the retry's wait is not counted")
	}
}

// restored returns node A's manager with a reclaim wait of an hour and a
// disk as a volume restored from a snapshot first looks: an ext4
// filesystem, and a target that no node ever registered with.
func restored(t *testing.T) (*env, *scsitest.Target, string, string) {
	t.Helper()
	e, tgt := newFencedEnv(t)
	e.cfg.ReclaimWait = time.Hour
	e.start()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	if tgt.Generation() != 0 {
		t.Fatal("model: a new target is not at generation 0")
	}
	return e, tgt, img, dev
}

func TestNeverPublishedStageSkipsTheReclaimWait(t *testing.T) {
	e, tgt, img, dev := restored(t)
	req := e.stageReq("vol-r", img, "r")
	req.AllowUnfenced = false

	// Without the controller's word, the data may be a forgotten holder's:
	// the stage waits, here until its caller gives up.
	givenUpDuringTheWait(t, e, tgt, dev, req)

	// With it, the disk is claimed at once: an hour's wait would outlast
	// the context.
	ctx, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	req.NeverPublished = true
	res, err := e.m.Stage(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != fence.MethodPR || res.Formatted || !isMounted(t, req.StagingPath) {
		t.Fatalf("stage with the flag: %+v, mounted %v (the filesystem must be mounted, not made again)", res, isMounted(t, req.StagingPath))
	}
	if h, k, _, ok := tgt.Reservation(); !ok || h != nodeA || fence.Key(k) != keyA {
		t.Fatalf("reservation (%q, %s, %v), want node A's", h, fence.Key(k), ok)
	}
	for _, r := range []string{"claimed", "refused", "error"} {
		if n := reclaimWaits(t, e.m, r); n != 0 {
			t.Fatalf("%v waits counted as %s", n, r)
		}
	}
}

func TestNeverPublishedStageStillRefusesAHeldDisk(t *testing.T) {
	e, tgt, img, dev := restored(t)
	if _, err := nodeBEngine(t, tgt, "vol-r").Acquire(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req := e.stageReq("vol-r", img, "r")
	req.AllowUnfenced, req.NeverPublished = false, true
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "held by another node", keyB.String(), "node-b")
	notClaimed(t, e, tgt, dev, req, true)
	if h, k, _, ok := tgt.Reservation(); !ok || h != nodeB || fence.Key(k) != keyB {
		t.Fatalf("reservation (%q, %s, %v), want node B's still", h, fence.Key(k), ok)
	}
}
