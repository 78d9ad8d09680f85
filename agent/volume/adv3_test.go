package volume

// Directed reproductions, third adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go, break2_test.go).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// One disk, one volume (openDisk, claimedBy) holds only while the claim
// of the first volume is not marked missing, and a claim check marks a
// mounted, present disk missing on one failed identity read (an INQUIRY
// that times out: checkOne's Verify fails, cameBack finds the disk at the
// same device number, and the claim is recorded Missing). Until a later
// check clears the mark, claimedBy skips that claim, so a second volume id
// whose locator names the same disk is staged over the first while it is
// mounted and published: its own fencer acquires the disk again (the lease
// renewed by the second volume's fencer, not the first's: I1), and its
// filesystem is mounted a second time under another volume. The second
// stage must be refused (FAILED_PRECONDITION), as it is when the first
// claim is not marked. (The lease engine of the second stage takes this
// node's live slot for "our own record from an earlier run" and resumes
// it, so the first volume's engine finds its slot rewritten: its own node
// fences it off under the pod.)
func TestAdv3TransientlyMissingClaimLetsASecondVolumeStageItsDisk(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	b := &simVolume{id: "pvc-b", serial: "sim0"}
	runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		if err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0]}); err != nil {
			t.Fatalf("publish %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		r.w.failNext["verify"] = 1
		r.w.mu.Unlock()
		r.m.CheckAll(ctx)
		c, _ := r.m.store.Get(a.id)
		r.logBreak("claim check with one identity read failing; %s's record: %s missing=%v", a.id, phaseOf(c), c != nil && c.Missing)
		_, err := r.m.Stage(ctx, r.stageReq(b))
		r.logBreak("NodeStage %s (same disk as the mounted %s): %s", b.id, a.id, errText(err))
		// The invariants of the first volume only: the harness would
		// count its mount against the second, which shares its disk.
		r.vols = []*simVolume{a}
		r.check()
		if agenterr.Code(err) != codes.FailedPrecondition {
			t.Errorf("a second volume's stage of the disk of the mounted, published %s answered %s; want FAILED_PRECONDITION (one disk, one volume)", a.id, errText(err))
		}
		r.w.mu.Lock()
		if _, ok := r.w.mounts[b.staging]; ok {
			r.w.violate("one disk, one volume: %s's filesystem is mounted at %s's staging path too", a.id, b.id)
		}
		r.w.mu.Unlock()
	})
}

// adv3BusyHost is the hook host whose unmount of busy answers EBUSY, and
// runs onUnmount first.
type adv3BusyHost struct {
	*hookHost
	busy      string
	onUnmount func()
}

func (h adv3BusyHost) Unmount(target string) error {
	if target != h.busy {
		return h.hookHost.Unmount(target)
	}
	if h.onUnmount != nil {
		h.onUnmount()
	}
	return h.do("umount", func() error { return fmt.Errorf("umount %s: target is busy", target) })
}

// A stage of a disk without fencing (the explicit opt-in of the request
// and the agent) whose record step fails right after the mount (a claim
// record that cannot be written for a moment), and whose rollback cannot
// unmount the staging path (EBUSY: something of the node holds the new
// filesystem open). The rollback's unmount failure is only logged; with
// no fence there is no release, so the release guard, which keeps a
// fenced stage recorded staged when something is in use, never runs; and
// unrecord records the claim interrupted while the filesystem stays
// mounted at the staging path: the record says less than the node (I3).
// The claim checks skip an interrupted claim that is not unresolved or
// missing, so nothing takes it back, and every retried stage answers
// UNAVAILABLE ("the claim check takes it back"), which never comes.
func TestAdv3UnfencedStageWhoseRollbackCannotUnmountRecordedInterrupted(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		r.m.o.Config.AllowUnfenced = true
		r.m.o.Fencers = noFencingNow{simFencers{w: r.w, gen: r.w.gen}}
		tmp := r.m.store.file(a.id) + ".tmp"
		h.beforeMount = func(_, target string) error {
			if target == a.staging {
				// The record step's write fails: its temporary file
				// cannot be made.
				if err := os.MkdirAll(filepath.Join(tmp, "x"), 0o700); err != nil {
					t.Error(err)
				}
			}
			return nil
		}
		r.m.host = adv3BusyHost{hookHost: h, busy: a.staging, onUnmount: func() { os.RemoveAll(tmp) }}
		req := r.stageReq(a)
		req.AllowUnfenced = true
		_, err := r.m.Stage(ctx, req)
		c, _ := r.m.store.Get(a.id)
		r.logBreak("NodeStage %s (unfenced; the record step fails, the rollback's unmount is busy): %s; record: %s", a.id, errText(err), phaseOf(c))
		// I3 alone: the harness's I1 counts an unfenced claim's mount
		// as a fence not held.
		i3 := func(when string) {
			r.w.mu.Lock()
			defer r.w.mu.Unlock()
			c, _ := r.m.store.Get(a.id)
			if _, ok := r.w.mounts[a.staging]; ok && (c == nil || c.Phase == PhaseInterrupted) {
				r.w.violate("I3 (%s): %s is mounted at its staging path but its claim record says %s", when, a.id, phaseOf(c))
			}
		}
		i3("after the failed stage")
		r.m.CheckAll(ctx)
		_, err = r.m.Stage(ctx, req)
		c, _ = r.m.store.Get(a.id)
		r.logBreak("claim check, then NodeStage %s retried: %s; record: %s", a.id, errText(err), phaseOf(c))
		i3("after a claim check and a retried stage")
	})
}
