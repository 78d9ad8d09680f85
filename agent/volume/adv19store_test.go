package volume

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// Directed reproductions, nineteenth adversarial round (the claim store
// and the sequences that fault it), over the manager simulation's
// modelled node (sim_test.go, break_test.go).

// A lease volume is staged; the controller grants its disk to another
// node, and the lease engine's loss handler records the claim lost. The
// agent restarts in the same boot, and its start-up check cannot locate
// the disk (a scan that failed): the lost claim is recorded missing. A
// data mapping over the disk that the record does not name is there too
// (a stage whose attach answer was lost leaves one). The claim check
// skipped a lost claim whose I/O was stopped, so the disk was never looked
// for again: the claim stayed missing for ever, and its unstage, which
// looks for an unnamed mapping only over a disk not missing, failed for
// ever on that mapping (volume sequence 1190).
func TestAdv19StoreLostClaimMissingAtStartIsLookedForAgain(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.logBreak("takeover of %s: %s", a.id, r.takeOver(a))
		r.w.mu.Lock()
		r.w.crash()
		r.w.failNext["locate"] = 1
		r.w.nLoop++
		stray := fmt.Sprintf("/dev/loop%d", r.w.nLoop)
		r.w.loops[stray] = a.serial
		r.w.logf("a data mapping %s over disk %s that the record does not name", stray, a.serial)
		r.w.mu.Unlock()
		r.start(ctx)
		c, err := r.m.store.Get(a.id)
		if err != nil || c == nil || c.State != StateLost || !c.Missing {
			t.Fatalf("after the restart whose lookup failed, the claim of %s is %+v (%v), want lost and missing", a.id, c, err)
		}
		var uerr error
		for try := range 3 {
			r.m.CheckAll(ctx)
			uerr = r.m.Unstage(ctx, a.id, a.staging)
			r.logBreak("check, then NodeUnstage %s (try %d): %s", a.id, try, errText(uerr))
			if uerr == nil {
				break
			}
			time.Sleep(10 * time.Second)
		}
		if uerr != nil {
			t.Errorf("the unstage of lost %s never succeeded: %v", a.id, uerr)
		}
		if r.m.unresolved(a.id) {
			t.Errorf("the lease of lost %s is still listed as not taken back: the host watchdog stays unfed", a.id)
		}
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		if what := r.w.inUse(a.serial); what != "" {
			t.Errorf("%s unstaged, but %s", a.id, what)
		}
	})
}

// A lease volume is staged; the controller grants its disk to another
// node, and the lease engine's loss handler stops the volume's I/O and
// records the claim lost -- but the fsync of the record's temporary file
// fails once (the store's disk). The record stayed "held" until the next
// claim check's fence check found the loss again: meanwhile the API
// calls, the release guard and an agent restarted act on a claim the
// record says is held, its disk another node's (I1; volume sequences
// 2064, 4828, 4928 and 23 more of 1-20000).
func TestAdv19StoreLossRecordFailingOnceIsWrittenAgain(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		r.m.store.sys = simStore{w: r.w, gen: r.w.gen}
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		r.w.failNext["fsync claim record"] = 1
		r.w.mu.Unlock()
		r.logBreak("takeover of %s, the next record's fsync failing: %s", a.id, r.takeOver(a))
		r.check()
		c, err := r.m.store.Get(a.id)
		if err != nil || c == nil || c.State != StateLost {
			t.Errorf("after the loss handler ran, the claim of %s is recorded %s (%v), want lost", a.id, phaseOf(c), err)
		}
	})
}

// The stage of a lease volume records it claiming, takes the fence, and
// fails to attach its data mapping; its rollback's release fails (the
// fence stays held), and the record that would say so (interrupted,
// held) cannot be written: the record still says claiming, with no
// fence. The unstage then forgot the record without releasing the fence,
// which stayed held by this node for ever (I5; volume sequence 4489).
func TestAdv19StoreStageRecordFailingAfterItsReleaseFailedLeavesNoFence(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		r.m.store.sys = simStore{w: r.w, gen: r.w.gen}
		r.m.mapData = func(string, int64, bool) (string, error) {
			r.w.mu.Lock()
			defer r.w.mu.Unlock()
			r.w.failNext["release"] = 1
			r.w.failNext["fsync claim record"] = 1
			return "", fmt.Errorf("map data: %w", errSimFault)
		}
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s, its data mapping, its release and its last record failing: %s", a.id, errText(err))
		err = r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
		c, gerr := r.m.store.Get(a.id)
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		if holder := r.w.disks[a.serial].holder; err == nil && holder == "us" {
			t.Errorf("the unstage of %s answered ok, its record %s (%v), and this node still holds the fence of its disk", a.id, phaseOf(c), gerr)
		}
	})
}

// The stage of an encrypted volume fails at its mount; its rollback
// cannot close the dm-crypt mapping, so the release guard keeps the
// fence, and the record that would say so (staged, its fence kept) cannot
// be written: the record still says claiming. The retried stage found the
// stage cut short with its mapping open, and said the claim check would
// take it back, which the check did only for a claim the start-up check
// could not resolve: the volume never staged again (I5; volume sequence
// 17821).
func TestAdv19StoreStageRecordFailingAfterItsFenceWasKeptIsTakenBack(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		mountFailsArming(r, h, map[string]int{"dm-crypt close": 1, "fsync claim record": 1})
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s, its mount, its dm-crypt close and its last record failing: %s", a.id, errText(err))
		if err := checkThenStage(ctx, r, a); err != nil {
			t.Errorf("the stage of %s never succeeded again: %v", a.id, err)
		}
	})
}

// The stage of an encrypted volume fenced with reservations is cut short
// by the agent's death after its dm-crypt mapping was opened: its record
// says claiming. The next agent process cannot locate the disk (a scan
// that failed) and records the claim missing -- a record that cannot be
// written. The claim check took a claim not staged back only when its
// record said missing or the start-up check had left it unresolved, so
// nothing took this one back: the retried stage found the stage cut
// short with its mapping open for ever (I5; volume sequence 1101973).
func TestAdv19StoreStageCutShortWhoseMissingRecordFailedIsTakenBack(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		h.beforeMount = func(string, string) error {
			h.beforeMount = nil
			r.w.mu.Lock()
			defer r.w.mu.Unlock()
			r.w.crash()
			r.w.failNext["locate"] = 1
			r.w.failNext["fsync claim record"] = 1
			return errSimDead
		}
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s, the agent dying before its mount: %s", a.id, errText(err))
		r.startWith(ctx, r.w.bootID(), nil, func(m *Manager) { m.store.sys = simStore{w: r.w, gen: r.w.gen} })
		if err := checkThenStage(ctx, r, a); err != nil {
			t.Errorf("the stage of %s never succeeded again: %v", a.id, err)
		}
	})
}

// mountFailsArming has the claim store faulted (simStore) and the next
// mount fail, arming faults (call name: how many) as it does.
func mountFailsArming(r *simRun, h *hookHost, faults map[string]int) {
	r.m.store.sys = simStore{w: r.w, gen: r.w.gen}
	h.beforeMount = func(string, string) error {
		h.beforeMount = nil
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		for call, n := range faults {
			r.w.failNext[call] = n
		}
		return fmt.Errorf("mount: %w", errSimFault)
	}
}

// checkThenStage runs a claim check and the kubelet's retried stage of a,
// up to three times ten seconds apart, and returns the last stage's error.
func checkThenStage(ctx context.Context, r *simRun, a *simVolume) error {
	var err error
	for try := range 3 {
		r.m.CheckAll(ctx)
		_, err = r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("check, then NodeStage %s (try %d): %s", a.id, try, errText(err))
		if err == nil {
			return nil
		}
		time.Sleep(10 * time.Second)
	}
	return err
}
