package volume

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// Issue 9: the iSCSI target restarts and forgets every reservation. The
// agent takes its claim back when no other key appeared, by the periodic
// check and by the start-up check alike, and fences itself when one did.
func TestClaimForgottenByARestartedTargetIsReestablishedUnlessAnotherKeyAppeared(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	req := e.stageReq("vol-r", img, "r")
	req.AllowUnfenced = false
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	e.event(events.DiskClaimed)

	// The periodic check finds the target empty and re-establishes.
	tgt.Restart()
	e.m.CheckAll(ctx)
	e.checkReestablished()
	e.checkHeldByNodeA(tgt, dev, req.StagingPath, "after the first restart")
	if metric(t, e.m, "vco_agent_reestablishes_total", "result", "ok") != 1 || metric(t, e.m, "vco_agent_fences_total") != 0 {
		t.Fatal("re-establish not counted, or counted as a fence")
	}
	e.m.CheckAll(ctx)
	if metric(t, e.m, "vco_agent_claim_checks_total", "result", "ok") < 1 {
		t.Fatal("the re-established claim does not pass the next check")
	}

	// The agent and the target restart together: the start-up check does
	// the same.
	e.m.Close()
	tgt.Restart()
	e.start()
	e.m.Reconcile(ctx)
	e.checkReestablished()
	e.checkHeldByNodeA(tgt, dev, req.StagingPath, "after an agent and target restart")

	e.nodeBRacesTheReregistrationAndAFencesItself(ctx, tgt, dev, req.StagingPath)
	// Fenced for good: neither the check nor a restart takes it back.
	e.m.CheckAll(ctx)
	e.start()
	e.m.Reconcile(ctx)
	if c, _ := e.m.Store().Get("vol-r"); c == nil || c.State != StateLost {
		t.Fatalf("claim after the refusal: %+v", c)
	}
	if _, reg := tgt.Registered(nodeA); reg {
		t.Fatal("node A registered again")
	}
}

// writeIn writes a file name, holding its name, in the staged volume at
// staging.
func writeIn(staging, name string) error {
	return os.WriteFile(filepath.Join(staging, name), []byte(name), 0o644)
}

// checkHeldByNodeA: node A holds the reservation, the claim of vol-r is
// held without detail, and the volume at staging is writable (when names
// the moment, in failures and in the file written).
func (e *env) checkHeldByNodeA(tgt *scsitest.Target, dev, staging, when string) {
	t := e.t
	t.Helper()
	if h, k, _, ok := tgt.Reservation(); !ok || h != nodeA || fence.Key(k) != keyA {
		t.Fatalf("%s: reservation (%q, %s, %v), want node A's", when, h, fence.Key(k), ok)
	}
	if c, _ := e.m.Store().Get("vol-r"); c == nil || c.State != StateHeld || c.Detail != "" {
		t.Fatalf("%s: claim %+v", when, c)
	}
	if deviceReadOnly(t, dev) {
		t.Fatalf("%s: device read-only", when)
	}
	if err := writeIn(staging, strings.ReplaceAll(when, " ", "-")); err != nil {
		t.Fatalf("%s: write: %v", when, err)
	}
}

// checkReestablished: the next DiskClaimed event says node A's claim of
// vol-r was re-established after the target forgot it.
func (e *env) checkReestablished() {
	t := e.t
	t.Helper()
	ev := e.event(events.DiskClaimed)
	if ev.Reason != "reservation-reestablished" || ev.Volume != "vol-r" || ev.HolderKey != uint64(keyA) || !strings.Contains(ev.Message, "forgot") {
		t.Fatalf("event: %+v", ev)
	}
}

// nodeBRacesTheReregistrationAndAFencesItself: node B finds the disk free
// and claims it while node A re-registers: node A fences itself (no
// writes, not registered, counted as a refused re-establish) and leaves
// node B's claim alone.
func (e *env) nodeBRacesTheReregistrationAndAFencesItself(ctx context.Context, tgt *scsitest.Target, dev, staging string) {
	t := e.t
	t.Helper()
	tgt.Restart()
	b := nodeBEngine(t, tgt, "vol-r")
	raced := false
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == nodeA && !raced && len(cdb) > 1 && cdb[0] == scsi.OpPersistentReserveOut && scsi.PROutAction(cdb[1]&0x1f) == scsi.Register {
			raced = true
			if _, err := b.Acquire(ctx, nil); err != nil {
				t.Error(err)
			}
		}
	}
	e.m.CheckAll(ctx)
	tgt.BeforeCommand = nil
	if !raced {
		t.Fatal("node A never registered again, so node B never raced it")
	}
	ev := e.event(events.DiskFenced)
	if ev.Volume != "vol-r" || ev.HolderKey != uint64(keyB) || ev.HolderNode != "node-b" {
		t.Fatalf("fenced event: %+v", ev)
	}
	if !deviceReadOnly(t, dev) || writeIn(staging, "after-b") == nil {
		t.Fatal("node A still writes after node B claimed the disk")
	}
	if _, reg := tgt.Registered(nodeA); reg {
		t.Fatal("node A registered while node B held the disk")
	}
	if err := b.Check(ctx); err != nil {
		t.Fatalf("node B's claim after node A's check: %v", err)
	}
	if metric(t, e.m, "vco_agent_reestablishes_total", "result", "refused") != 1 || metric(t, e.m, "vco_agent_fences_total") != 1 {
		t.Fatalf("refused re-establish not counted: refused %v, fences %v", metric(t, e.m, "vco_agent_reestablishes_total", "result", "refused"), metric(t, e.m, "vco_agent_fences_total"))
	}
}

// An agent killed during an unstage, after it released the reservation and
// before it removed the record, finds its own key gone when it comes back.
// That was its own release, not a loss: no DiskFenced, nothing stopped,
// and the retried unstage finishes.
func TestUnstageCutShortAfterTheReleaseIsNotALoss(t *testing.T) {
	e, tgt := newFencedEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	req := e.stageReq("vol-u", img, "u")
	req.AllowUnfenced = false
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	e.event(events.DiskClaimed)
	left := e.unstageKeepingTheRecordAtTheRelease(ctx, tgt, req.StagingPath)

	e.m.Close()
	if err := e.m.Store().Put(left); err != nil {
		t.Fatal(err)
	}
	e.start()
	e.m.Reconcile(ctx)
	if n := metric(t, e.m, "vco_agent_fences_total"); n != 0 {
		t.Fatalf("its own release counted as %v fence(s)", n)
	}
	if deviceReadOnly(t, dev) {
		t.Fatal("device set read-only after its own release")
	}
	c, _ := e.m.Store().Get("vol-u")
	if c == nil || c.Phase != PhaseInterrupted || c.State == StateLost {
		t.Fatalf("record after the restart: %+v", c)
	}
	if err := e.m.Unstage(ctx, "vol-u", req.StagingPath); err != nil {
		t.Fatalf("retried unstage: %v", err)
	}
	if c, _ := e.m.Store().Get("vol-u"); c != nil {
		t.Fatalf("record kept after the retried unstage: %+v", c)
	}
	if ev := e.event(events.DiskReleased); ev.Volume != "vol-u" || strings.Contains(ev.Message, "lost") {
		t.Fatalf("released event: %+v", ev)
	}
	if _, reg := tgt.Registered(nodeA); reg {
		t.Fatal("node A registered again")
	}
}

// unstageKeepingTheRecordAtTheRelease unstages vol-u and returns its
// record as a crash right after node A's release would leave it (phase
// unstaging); the unstage leaves node A unregistered and announces the
// release.
func (e *env) unstageKeepingTheRecordAtTheRelease(ctx context.Context, tgt *scsitest.Target, staging string) *Claim {
	t := e.t
	t.Helper()
	var left *Claim
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == nodeA && left == nil && len(cdb) > 1 && cdb[0] == scsi.OpPersistentReserveOut {
			left, _ = e.m.Store().Get("vol-u")
		}
	}
	if err := e.m.Unstage(ctx, "vol-u", staging); err != nil {
		t.Fatal(err)
	}
	tgt.BeforeCommand = nil
	if left == nil || left.Phase != PhaseUnstaging {
		t.Fatalf("record when the release began: %+v", left)
	}
	if _, reg := tgt.Registered(nodeA); reg {
		t.Fatal("node A still registered after the unstage")
	}
	e.event(events.DiskReleased)
	return left
}
