package volume

import (
	"context"
	"os"
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

// Volumes A and B are staged. A's claim record is damaged so that it
// holds B's claim (a record restored from a copy under the wrong name, a
// hand edit): the record read for volume id A says volume B. A
// NodeUnstage of volume id A at B's staging path (a hostile or mistaken
// request) is checked against that record alone: it unmounts B's
// filesystem, releases B's fence and deletes B's record, under the lock
// of volume A, not B's (a call of B's runs beside it). One volume's
// operation takes down another's, and a damaged record gets a write, not
// a refusal. Control: the same unstage with A's record intact is refused
// (A is not staged at B's staging path) and B stays staged.
func TestAdv12RecordNamingAnotherVolumeLetsItsUnstageTakeThatVolumeDown(t *testing.T) {
	for _, damaged := range []bool{false, true} {
		name := map[bool]string{false: "control", true: "damaged"}[damaged]
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				for _, v := range []*simVolume{a, b} {
					if _, err := r.m.Stage(ctx, r.stageReq(v)); err != nil {
						t.Errorf("stage %s: %v", v.id, err)
						return
					}
				}
				if damaged {
					rec, err := os.ReadFile(r.m.store.file(b.id))
					if err == nil {
						err = os.WriteFile(r.m.store.file(a.id), rec, 0o600)
					}
					if err != nil {
						t.Fatal(err)
					}
					r.logBreak("the claim record of %s damaged: it holds %s's claim", a.id, b.id)
				}
				err := r.m.Unstage(ctx, a.id, b.staging)
				r.logBreak("NodeUnstage %s at %s's staging path: %s", a.id, b.id, errText(err))
				r.w.mu.Lock()
				_, mounted := r.w.mounts[b.staging]
				holder := r.w.disks[b.serial].holder
				r.w.mu.Unlock()
				cb, _ := r.m.store.Get(b.id)
				if err == nil {
					t.Errorf("NodeUnstage of %s at %s's staging path answered OK", a.id, b.id)
				}
				if !mounted || holder != "us" || cb == nil || cb.Phase != PhaseStaged {
					t.Errorf("an unstage of volume %s took volume %s down: staging mounted=%v, fence held by %q, record: %s", a.id, b.id, mounted, holder, phaseOf(cb))
				}
			})
		})
	}
}
