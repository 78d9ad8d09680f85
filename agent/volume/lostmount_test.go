package volume

import (
	"context"
	"testing"
)

// A mount whose answer is an error though it landed (a timeout): the
// stage's rollback takes it down with the rest, and when the unmount
// fails too, the mapping it keeps open stays named in the record, which
// says staged (the release guard kept the fence): a retried publish then
// finds the volume's own device on its target, not "something else".
func TestAStageWhoseMountAnswerIsLostLeavesNothingItDoesNotRecord(t *testing.T) {
	for _, lease := range []bool{false, true} {
		v := &simVolume{id: "pvc-m", serial: "sim0", encrypted: true}
		runBreak(t, lease, []*simVolume{v}, func(r *simRun, _ *hookHost) {
			ctx := context.Background()
			r.w.mu.Lock()
			r.w.loseNext["mount"] = 1
			r.w.mu.Unlock()
			_, err := r.m.Stage(ctx, r.stageReq(v))
			r.logBreak("NodeStage %s (the mount lands, its answer is lost): %s", v.id, errText(err))
			r.check()
			r.w.mu.Lock()
			_, mounted := r.w.mounts[v.staging]
			_, mapped := r.w.crypts[mapperName(v.id)]
			r.w.mu.Unlock()
			if err == nil || mounted || mapped {
				t.Errorf("lease=%v: stage whose mount answer was lost: %v; left mounted %v, mapped %v", lease, err, mounted, mapped)
			}

			r.w.mu.Lock()
			r.w.loseNext["mount"], r.w.failNext["umount"] = 1, 1
			r.w.mu.Unlock()
			_, err = r.m.Stage(ctx, r.stageReq(v))
			r.logBreak("NodeStage %s (the mount lands, its answer is lost, its unmount fails): %s", v.id, errText(err))
			r.check()
			c, _ := r.m.store.Get(v.id)
			if c == nil || c.Phase != PhaseStaged || c.Mapper != "/dev/mapper/"+mapperName(v.id) {
				t.Fatalf("lease=%v: record of a stage whose mount stayed: %+v", lease, c)
			}
			if _, err := r.m.Stage(ctx, r.stageReq(v)); err != nil {
				t.Fatalf("lease=%v: retried stage: %v", lease, err)
			}
			if err := r.m.Publish(ctx, PublishRequest{Volume: v.id, StagingPath: v.staging, TargetPath: v.targets[0]}); err != nil {
				t.Fatalf("lease=%v: publish: %v", lease, err)
			}
			if err := r.m.Publish(ctx, PublishRequest{Volume: v.id, StagingPath: v.staging, TargetPath: v.targets[0]}); err != nil {
				t.Errorf("lease=%v: retried publish: %v", lease, err)
			}
			r.check()
		})
	}
}
