package volume

import (
	"context"
	"testing"
)

// Directed reproductions, twelfth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

// Volume A is staged on disk X, which never leaves the node. The
// kubelet unstages A: the staging path is unmounted, the data mapping
// detached, and the release finds the identity read of X failing (a
// SCSI INQUIRY that times out), and the fresh lookup failing too (the
// same read, once more). The unstage takes that for "the disk was
// detached from this node" (detached: cameBack answers diskGone for any
// lookup error), forgets A's claim, and leaves A's fence on X: the
// reservation stays this node's, with no record left to release it (a
// later stage elsewhere is refused until the controller grants a
// takeover), and the lease is left to lapse without the release guard's
// proof. A lookup that failed says nothing of where the disk is: the
// unstage must answer an error and keep the claim, and its retry release
// the fence. (A disk the lookup finds nowhere is forgotten as before:
// detached_test.go.)
func TestAdv12UnstageTakesAFailedLookupForADetachedDisk(t *testing.T) {
	for _, lease := range []bool{false, true} {
		name := map[bool]string{false: "reservations", true: "lease"}[lease]
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, lease, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Errorf("stage %s: %v", a.id, err)
					return
				}
				r.w.mu.Lock()
				r.w.failNext["verify"] = 1
				r.w.failNext["locate"] = 1
				r.w.mu.Unlock()
				err := r.m.Unstage(ctx, a.id, a.staging)
				c, _ := r.m.store.Get(a.id)
				r.logBreak("NodeUnstage %s with the identity read and the lookup failing once: %s; record: %s", a.id, errText(err), phaseOf(c))
				if err == nil && c == nil {
					r.w.mu.Lock()
					holder, present := r.w.disks[a.serial].holder, r.w.disks[a.serial].present
					r.w.mu.Unlock()
					if present && holder == "us" {
						t.Errorf("the unstage of %s forgot its claim with its disk attached and its fence held (a failed lookup taken for a detached disk): nothing is left to release the fence", a.id)
						return
					}
				}
				for try := 0; try < 3; try++ {
					if err = r.m.Unstage(ctx, a.id, a.staging); err == nil {
						break
					}
				}
				r.logBreak("NodeUnstage %s retried: %s", a.id, errText(err))
				r.w.mu.Lock()
				holder := r.w.disks[a.serial].holder
				r.w.mu.Unlock()
				if err != nil || holder != "" {
					t.Errorf("after the retried unstage of %s (%s), its fence is held by %q, not released", a.id, errText(err), holder)
				}
			})
		})
	}
}
