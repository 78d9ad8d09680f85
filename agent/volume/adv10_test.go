package volume

import (
	"context"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// adv10Swap removes the disk of volume a (its Removed uevent delivered)
// and attaches the disk of volume b at the device node and number a's
// disk had: the kernel gives a new disk the lowest free name and minor.
func adv10Swap(r *simRun, a, b *simVolume) {
	x := r.w.disks[a.serial]
	r.remove(a)
	r.w.mu.Lock()
	y := r.w.disks[b.serial]
	y.path, y.minor, y.present = x.path, x.minor, true
	r.w.mu.Unlock()
}

// Volume A is staged on disk X (/dev/vdb, lease-fenced, so its data is
// mapped by a loop device past the lease area). X is removed (the watcher
// marks A's claim missing) and disk Y, volume B's, is attached and gets
// the name and device number X had. B is staged on Y (A's claim is
// missing and names another serial, so B's stage is allowed), which maps
// Y's data region. Then the kubelet unstages A. A's unstage detaches "a
// data mapping of the volume's disk that its record does not name" by
// looking up the data mapping over the node its record names, /dev/vdb:
// that is Y now, and the mapping it finds is B's. An operation of volume
// A tears down volume B's data mapping: raw block B is left staged on a
// device that maps nothing, and its publish is refused; a filesystem B
// keeps it only because it is busy (on the node, a loop device detached
// while open goes at its last close). Control: without the swap (Y
// attached at a node of its own) A's unstage leaves B whole.
func TestAdv10UnstageAfterDiskSwapTakesAnotherVolumesDataMapping(t *testing.T) {
	for _, tc := range []struct {
		name        string
		swap, block bool
	}{
		{"control: B's disk at its own node, raw block", false, true},
		{"control: B's disk at its own node, filesystem", false, false},
		{"B's disk at X's old node, raw block", true, true},
		{"B's disk at X's old node, filesystem", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
			b := &simVolume{id: "pvc-b", serial: "sim1", block: tc.block}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				if tc.swap {
					r.w.mu.Lock()
					r.w.disks[b.serial].present = false
					r.w.mu.Unlock()
					adv10Swap(r, a, b)
				} else {
					r.remove(a)
				}
				r.logBreak("disk of %s removed; disk of %s at %s", a.id, b.id, r.w.disks[b.serial].path)
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				if err := r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: b.block}); err != nil {
					t.Fatalf("publish %s: %v", b.id, err)
				}
				if err := r.m.Unpublish(ctx, b.id, b.targets[0]); err != nil {
					t.Fatalf("unpublish %s: %v", b.id, err)
				}
				cb, _ := r.m.store.Get(b.id)
				mapping := cb.DataDevice
				err := r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				time.Sleep(time.Minute)
				r.w.mu.Lock()
				_, mapped := r.w.loops[mapping]
				r.w.mu.Unlock()
				if !mapped {
					t.Errorf("unstaging %s detached %s, volume %s's data mapping", a.id, mapping, b.id)
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: b.block})
				r.logBreak("NodePublish %s: %s", b.id, errText(err))
				if err != nil {
					t.Errorf("publishing %s after %s's unstage: %v (%s)", b.id, a.id, err, agenterr.Code(err))
				}
			})
		})
	}
}
