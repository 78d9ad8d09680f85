package volume

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence"
	"google.golang.org/grpc/codes"
)

// adv9StopHost gives StopFilesystem the real host's guard
// (stopFilesystem): a path that is no mount point is left alone, and so
// is one whose filesystem is not on device, when the device node is there
// to compare; otherwise the filesystem mounted there is stopped, which
// it notes.
type adv9StopHost struct {
	*hookHost
	mu      *sync.Mutex
	stopped *[]string
}

func (h adv9StopHost) StopFilesystem(p, device string) error {
	w := h.w
	w.mu.Lock()
	src, mounted := w.mounts[p]
	_, _, present := w.region(device)
	w.mu.Unlock()
	if !mounted {
		return nil
	}
	if device != "" && present && src != device {
		return fmt.Errorf("%s holds the filesystem of %s, not %s's; left alone", p, src, device)
	}
	h.mu.Lock()
	*h.stopped = append(*h.stopped, p+" ("+src+")")
	h.mu.Unlock()
	return nil
}

// A stage request for volume A names the staging path where volume B is
// staged (hostile or mistaken input). The stage records A's claim with
// that staging path, fences A's disk, maps its data region, and then
// refuses (B's filesystem is mounted there); its rollback detaches the
// data mapping before it releases the fence. A loss of A's lease noticed
// in between (the renewal runs beside the rollback) has onLost stop the
// filesystem at the recorded staging path "whatever the phase", naming
// the device by the record: the data mapping just detached. With no
// device node to compare, stopFilesystem takes whatever is mounted there
// for A's: B's filesystem, in use and fenced by B, is remounted read-only
// (or shut down) by an operation of volume A (P1: every operation touches
// only the volume's own device; hostile input never writes). Control: the
// same failed stage and loss at A's own staging path stops nothing.
func TestAdv9LossDuringRollbackStopsAnotherVolumesFilesystem(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hostile bool
	}{{"control: A's own staging path, mount fails", false}, {"A's stage names B's staging path", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				var mu sync.Mutex
				var stops []string
				r.m.host = adv9StopHost{hookHost: h, mu: &mu, stopped: &stops}
				lost := &fence.LostError{Device: "/dev/vdb", Reason: "the lease is held by another node", Holder: 0x6f74686572}
				unmap := r.m.unmapData
				delivered := false
				var answer bool
				var recorded string
				r.m.unmapData = func(p string) error {
					// The record names the mapping no longer while it is
					// detached (unmapNamed).
					if c, _ := r.m.store.Get(a.id); !delivered && p != "" && c != nil && (c.DataDevice == p || c.DataDevice == "") {
						delivered = true
						recorded = c.MountDevice()
						answer = r.m.onLost(a.id)(lost)
					}
					return unmap(p)
				}
				req := r.stageReq(a)
				if tc.hostile {
					req.StagingPath = b.staging
				} else {
					r.w.failNext["mount"] = 1
				}
				_, err := r.m.Stage(ctx, req)
				r.logBreak("NodeStage %s at %s: %s", a.id, req.StagingPath, errText(err))
				time.Sleep(time.Minute)
				synctest.Wait()
				if !delivered {
					// Refused before anything was taken: no rollback, no
					// loss to deliver, nothing of B's touched.
					if tc.hostile && agenterr.Code(err) == codes.FailedPrecondition {
						return
					}
					t.Fatal("the loss was never delivered during the rollback")
				}
				mu.Lock()
				defer mu.Unlock()
				r.logBreak("onLost(%s) answered %v; the record named %s; filesystems stopped: %v", a.id, answer, recorded, stops)
				if c, _ := r.m.store.Get(a.id); c != nil {
					r.logBreak("%s's record after the stage: phase %s state %s staging %s mapper %q", a.id, c.Phase, c.State, c.StagingPath, c.Mapper)
				}
				for _, s := range stops {
					t.Errorf("the loss of volume %s's lease stopped the filesystem at %s, volume %s's (stage error: %v)", a.id, s, b.id, err)
				}
			})
		})
	}
}

// A stage request for volume A names the staging path where volume B is
// staged (hostile or mistaken input). The stage refuses it (B's
// filesystem is mounted there), but its rollback asks the release guard
// whether anything of A is in use, and the guard takes B's mount at the
// recorded staging path for A's: A's fence is kept and A's claim recorded
// staged at B's staging path. The kubelet's unstage of A (its stage
// failed; it cleans up) then unmounts B's filesystem from under B, which
// is staged and published (P1: every operation touches only the volume's
// own device; hostile input never writes). Control: the refused stage
// with a staging path where nothing is mounted leaves B mounted through
// A's unstage.
func TestAdv9StageAtAnotherVolumesStagingPathUnstagesIt(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hostile bool
	}{{"control: A's own staging path, mount fails", false}, {"A's stage names B's staging path", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				if err := r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0]}); err != nil {
					t.Fatalf("publish %s: %v", b.id, err)
				}
				req := r.stageReq(a)
				if tc.hostile {
					req.StagingPath = b.staging
				} else {
					r.w.failNext["mount"] = 1
				}
				_, err := r.m.Stage(ctx, req)
				c, _ := r.m.store.Get(a.id)
				if c != nil {
					r.logBreak("NodeStage %s at %s: %s; record: phase %s state %s", a.id, req.StagingPath, errText(err), c.Phase, c.State)
				}
				uerr := r.m.Unstage(ctx, a.id, req.StagingPath)
				r.w.mu.Lock()
				src, mounted := r.w.mounts[b.staging]
				r.w.mu.Unlock()
				r.logBreak("NodeUnstage %s at %s: %s; %s's staging path mounted: %v (%s)", a.id, req.StagingPath, errText(uerr), b.id, mounted, src)
				if !mounted {
					t.Errorf("volume %s's staging path %s was unmounted by the unstage of volume %s, whose stage there was refused (stage: %v; unstage: %v)", b.id, b.staging, a.id, err, uerr)
				}
			})
		})
	}
}
