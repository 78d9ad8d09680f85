package volume

import (
	"context"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"google.golang.org/grpc/codes"
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

// Volume A (raw block, lease-fenced: its data mapped by a loop device
// over disk X) loses its fence to another node: the claim check records
// it lost and stops its I/O, and A stays staged (read-only) until the
// kubelet unstages it. The other node lets X go. A stage of volume B
// whose locator names X (the controller's error, or a hostile request)
// is not refused: the stage's "one disk, one volume" rule (claimedBy)
// skips lost claims. B takes the lease, and its data mapping step finds
// A's loop device over X and makes it B's. A's unstage then detaches
// its recorded data mapping, which is B's: volume B is left staged on a
// device that maps nothing (one volume's operation touches another's
// loop device). Control: B on a disk of its own.
func TestAdv11StageOfALostClaimsDiskTakesItsDataMapping(t *testing.T) {
	for _, tc := range []struct {
		name   string
		serial string
	}{{"control: B on its own disk", "sim1"}, {"B's locator names A's lost disk", "sim0"}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
			b := &simVolume{id: "pvc-b", serial: tc.serial, block: true}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.w.mu.Lock()
				r.w.disks[a.serial].holder = "other"
				r.w.mu.Unlock()
				r.m.CheckAll(ctx)
				ca, _ := r.m.store.Get(a.id)
				if ca == nil || ca.State != StateLost {
					t.Fatalf("%s's claim is not lost after another node took its disk: %+v", a.id, ca)
				}
				r.w.mu.Lock()
				r.w.disks[a.serial].holder = ""
				r.w.mu.Unlock()
				r.logBreak("%s lost (data mapping %s); the other node let its disk go", a.id, ca.DataDevice)
				_, err := r.m.Stage(ctx, r.stageReq(b))
				r.logBreak("NodeStage %s on %s: %s", b.id, b.serial, errText(err))
				if err != nil {
					return
				}
				cb, _ := r.m.store.Get(b.id)
				mapping := cb.DataDevice
				err = r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				r.w.mu.Lock()
				_, mapped := r.w.loops[mapping]
				r.w.mu.Unlock()
				if !mapped {
					t.Errorf("unstaging %s detached %s, volume %s's data mapping", a.id, mapping, b.id)
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: true})
				r.logBreak("NodePublish %s: %s", b.id, errText(err))
				if err != nil {
					t.Errorf("publishing %s after %s's unstage: %v", b.id, a.id, err)
				}
			})
		})
	}
}

// adv11OptsHost is the simulation's host whose mount table says, as
// /proc/mounts does, whether each publication's bind mount is read-only
// ("ro") or not ("rw").
type adv11OptsHost struct {
	*hookHost
	ro map[string]bool
}

func (h adv11OptsHost) Bind(source, target string, block bool, opts []string) error {
	err := h.hookHost.Bind(source, target, block, opts)
	if err == nil {
		h.w.mu.Lock()
		h.ro[target] = slices.Contains(opts, "ro")
		h.w.mu.Unlock()
	}
	return err
}

func (h adv11OptsHost) List() ([]mount.MountPoint, error) {
	mps, err := h.hookHost.List()
	h.w.mu.Lock()
	defer h.w.mu.Unlock()
	for i := range mps {
		if ro, ok := h.ro[mps[i].Path]; ok {
			mps[i].Opts = []string{map[bool]string{true: "ro", false: "rw"}[ro]}
		}
	}
	return mps, err
}

// Volume A is published read-write at target T. A publish of A at T that
// asks for it read-only (a repeated call with differing args: another
// pod's read-only use, or a hostile request) is answered OK, and the pod
// that asked for a read-only volume is handed the read-write bind mount
// (CSI: a publication at the target that is not compatible with the
// request's readonly flag is ALREADY_EXISTS). Control: the same publish
// repeated.
func TestAdv11RepeatedPublishAsksReadOnlyGetsTheWritableMount(t *testing.T) {
	for _, block := range []bool{false, true} {
		for _, ro := range []bool{false, true} {
			name := map[bool]string{false: "filesystem", true: "raw block"}[block]
			if !ro {
				name += ", control: repeated as it was"
			} else {
				name += ", repeated read-only"
			}
			t.Run(name, func(t *testing.T) {
				a := &simVolume{id: "pvc-a", serial: "sim0", block: block}
				runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
					ctx := context.Background()
					r.m.host = adv11OptsHost{hookHost: h, ro: map[string]bool{}}
					if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
						t.Fatalf("stage %s: %v", a.id, err)
					}
					req := PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: block}
					if err := r.m.Publish(ctx, req); err != nil {
						t.Fatalf("publish %s: %v", a.id, err)
					}
					req.ReadOnly = ro
					err := r.m.Publish(ctx, req)
					r.logBreak("NodePublish %s at %s again, read_only=%v: %s", a.id, req.TargetPath, ro, errText(err))
					switch {
					case !ro && err != nil:
						t.Errorf("the repeated publish of %s failed: %v", a.id, err)
					case ro && agenterr.Code(err) != codes.AlreadyExists:
						t.Errorf("a read-only publish of %s at %s, bound read-write there, answered %v, not ALREADY_EXISTS", a.id, req.TargetPath, errText(err))
					}
				})
			})
		}
	}
}
