package volume

import (
	"context"
	"testing"
)

// A volume whose disk the platform detached from this node while it was
// staged (a partition's takeover: the controller detached it to attach it
// to another node) is unstaged when the kubelet asks, once its staging
// path is unmounted: nothing of this node reaches the disk any more, and
// its fence is not this node's to release from here. Before, the unstage
// tried the release on the vanished device and failed for as long as the
// agent ran, and the kubelet retried it for ever.
func TestUnstageOfAVolumeWhoseDiskWasDetachedForgetsItsClaim(t *testing.T) {
	for _, lease := range []bool{false, true} {
		name := map[bool]string{false: "reservations", true: "lease"}[lease]
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, lease, []*simVolume{a}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Errorf("stage %s: %v", a.id, err)
					return
				}
				r.remove(a)
				r.logBreak("disk of %s detached", a.id)
				err := r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				if err != nil {
					t.Errorf("unstage of %s after its disk was detached: %v", a.id, err)
					return
				}
				r.w.mu.Lock()
				holder := r.w.disks[a.serial].holder
				r.w.mu.Unlock()
				if holder != "us" {
					t.Errorf("the detached disk's fence was touched: held by %q", holder)
				}
				if c, _ := r.m.store.Get(a.id); c != nil {
					t.Errorf("the claim of %s is still recorded: %+v", a.id, c)
				}
				if err := r.m.Unstage(ctx, a.id, a.staging); err != nil {
					t.Errorf("a repeated unstage: %v", err)
				}
			})
		})
	}
}
