package volume

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

// A stage request for volume A names a staging path P while A's disk is
// still being hot-plugged: the stage waits for it (locateAttaching, up to
// volumes.attach_wait). The refusal of a staging path that another
// volume's claim records (stagedAt) is made before that wait, and A's
// claim is recorded only after it. Meanwhile volume B is staged at P
// (B's stage finds no record naming P) and mounts its filesystem there.
// A's disk then appears: A's stage records P, fences its disk, and its
// mount is refused (B's filesystem is on P); its rollback asks the
// release guard whether anything of A is in use, which finds B's mount at
// A's recorded staging path: A's fence is kept and A recorded staged at
// P. The kubelet's unstage of A then unmounts B's filesystem (one
// volume's operation touches another's mount; hostile input writes).
// Control: A's own staging path.
func TestAdv11StageWaitingForItsDiskTakesAStagingPathStagedMeanwhile(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hostile bool
	}{{"control: A at its own staging path", false}, {"A names the staging path B is staged at while A waits", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				r.w.mu.Lock()
				r.w.disks[a.serial].present = false
				r.w.mu.Unlock()
				req := r.stageReq(a)
				if tc.hostile {
					req.StagingPath = b.staging
				}
				done := make(chan error, 1)
				go func() {
					_, err := r.m.Stage(ctx, req)
					done <- err
				}()
				synctest.Wait()
				r.logBreak("NodeStage %s at %s: waiting for its disk", a.id, req.StagingPath)
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				r.w.mu.Lock()
				r.w.disks[a.serial].present = true
				r.w.mu.Unlock()
				time.Sleep(time.Second)
				err := <-done
				r.logBreak("NodeStage %s at %s: %s", a.id, req.StagingPath, errText(err))
				uerr := r.m.Unstage(ctx, a.id, req.StagingPath)
				r.w.mu.Lock()
				src, mounted := r.w.mounts[b.staging]
				r.w.mu.Unlock()
				r.logBreak("NodeUnstage %s at %s: %s; %s's staging path mounted: %v (%s)", a.id, req.StagingPath, errText(uerr), b.id, mounted, src)
				if !mounted {
					t.Errorf("volume %s's staging path %s was unmounted by the unstage of volume %s (stage: %v; unstage: %v)", b.id, b.staging, a.id, err, uerr)
				}
			})
		})
	}
}
