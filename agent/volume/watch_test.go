package volume

import (
	"context"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// B's record of a claim whose disk was removed (Missing) does not cover
// the disk that the kernel gave its device number since: a disk A holds
// is refused. A live record on that device number (a claim, or a stage in
// progress) still leaves the disk alone.
func TestClassifyIgnoresAClaimWhoseDiskWentAway(t *testing.T) {
	needRoot(t)
	a := fencedLeaseEnv(t, nodeA, "node-a")
	b := fencedLeaseEnv(t, nodeB, "node-b")
	ctx := context.Background()
	img, devA := loop(t, 64)
	_, devB := shared(t, img)
	t.Cleanup(func() { clearRO(devA); clearRO(devB) })
	reqA := a.stageReq("vol-w", img, "w")
	reqA.AllowUnfenced = false
	if _, err := a.m.Stage(ctx, reqA); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.m.Unstage(context.Background(), "vol-w", reqA.StagingPath) })

	ev := devEvent(t, devB)
	old := &Claim{Volume: "vol-gone", Device: "/dev/vdq", DevNum: fmtDevnum(ev.Major, ev.Minor), Method: fence.MethodLease,
		Phase: PhaseStaged, State: StateHeld, Missing: true, Detail: "the disk /dev/vdq of volume vol-gone was removed from this node"}
	if err := b.m.Store().Put(old); err != nil {
		t.Fatal(err)
	}
	v, err := b.m.Classify(ctx, ev)
	if err != nil || !v.Refuse || v.Holder != keyA || v.HolderNode != "node-a" {
		t.Fatalf("B's verdict on A's disk with a stale claim on its device number: %+v %v", v, err)
	}
	old.Missing = false
	if err := b.m.Store().Put(old); err != nil {
		t.Fatal(err)
	}
	if v, err := b.m.Classify(ctx, ev); err != nil || v.Refuse {
		t.Fatalf("B's verdict on a disk of its own live claim: %+v %v", v, err)
	}
}

// A stage records the disk it claims under the watch lock, so that a
// refusal the watcher decided before the record is set before the stage
// goes on (and the stage clears it), never after.
func TestStageRecordsItsClaimUnderTheWatchLock(t *testing.T) {
	e := newEnv(t)
	img, _ := loop(t, 64)
	req := e.stageReq("vol-lock", img, "lock")
	lk := e.m.WatchLock()
	lk.Lock()
	done := make(chan error, 1)
	go func() {
		_, err := e.m.Stage(context.Background(), req)
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if c, _ := e.m.Store().Get("vol-lock"); c != nil {
		lk.Unlock()
		t.Fatalf("the stage recorded its claim while the watcher held the lock: %+v", c)
	}
	select {
	case err := <-done:
		lk.Unlock()
		t.Fatalf("the stage ended while the watcher held the lock: %v", err)
	default:
	}
	lk.Unlock()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stage did not finish after the lock was released")
	}
	if err := e.m.Unstage(context.Background(), "vol-lock", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}
