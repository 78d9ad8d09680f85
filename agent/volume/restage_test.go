package volume

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// A repeated NodeStage of a staged, published, encrypted volume, whose
// check of the disk's identity, of its fence or of its mount fails once,
// answers UNAVAILABLE and changes nothing: the fence stays held and (for
// the lease) renewed by the live fencer, the volume mounted, its record
// staged (the simulation's I1 and I3); the retry answers as the stage did.
// The first stage's path run over the mounted volume released the fence
// in its rollback.
func TestRepeatedStageKeepsTheFenceOfAMountedVolume(t *testing.T) {
	for _, lease := range []bool{true, false} {
		for _, call := range []string{"verify", "check fence", "is mount point"} {
			t.Run(fmt.Sprintf("lease=%v/%s fails", lease, call), func(t *testing.T) {
				a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
				runBreak(t, lease, []*simVolume{a}, func(r *simRun, _ *hookHost) {
					ctx := context.Background()
					if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
						t.Fatalf("first stage: %v", err)
					}
					if err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0]}); err != nil {
						t.Fatalf("publish: %v", err)
					}
					r.w.mu.Lock()
					r.w.failNext[call] = 1
					r.w.mu.Unlock()
					_, err := r.m.Stage(ctx, r.stageReq(a))
					r.logBreak("repeated NodeStage with %s failing once: %s", call, errText(err))
					if agenterr.Code(err) != codes.Unavailable {
						t.Errorf("the repeated stage answered %v; want UNAVAILABLE for the kubelet to retry", err)
					}
					r.check()
					if d := r.w.disks[a.serial]; d.holder != "us" {
						t.Errorf("the disk's fence is held by %q after the repeated stage; want this node", d.holder)
					}
					if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
						t.Errorf("the retry: %v", err)
					}
					r.check()
				})
			})
		}
	}
}

// The start-up check of a stage cut short after its mount (the record
// still says claiming) whose unmount fails keeps the fence: the release
// guard finds the mount, and the claim is taken back as staged and
// checked, not recorded interrupted with its fence released.
func TestInterruptedStageWhoseUnmountFailsKeepsItsFence(t *testing.T) {
	for _, lease := range []bool{true, false} {
		t.Run(fmt.Sprintf("lease=%v", lease), func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, lease, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				r.stagedButRecordedClaiming(t, a)
				r.w.mu.Lock()
				r.w.crash()
				r.w.failNext["umount"] = 1
				r.w.mu.Unlock()
				old := r.m
				r.start(ctx)
				old.Close()
				r.logBreak("agent restarted over a stage cut short after its mount, its unmount failing once")
				r.check()
				if d := r.w.disks[a.serial]; d.holder != "us" {
					t.Errorf("the disk's fence is held by %q after the start-up check; want this node", d.holder)
				}
				if now, _ := r.m.store.Get(a.id); now == nil || now.Phase != PhaseStaged {
					t.Errorf("the claim after the start-up check: %s; want staged (mounted, fence kept)", phaseOf(now))
				}
			})
		})
	}
}

// stagedButRecordedClaiming stages v, then puts its record back to
// claiming: the agent died after the mount, before its record.
func (r *simRun) stagedButRecordedClaiming(t *testing.T, v *simVolume) {
	t.Helper()
	if _, err := r.m.Stage(context.Background(), r.stageReq(v)); err != nil {
		t.Fatalf("first stage: %v", err)
	}
	c, err := r.m.store.Get(v.id)
	if err != nil || c == nil {
		t.Fatalf("record: %v %v", c, err)
	}
	c.Phase = PhaseClaiming
	if err := r.m.store.Put(c); err != nil {
		t.Fatal(err)
	}
}
