package volume

import (
	"context"
	"testing"
)

// Directed reproductions, seventeenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go): the
// controller's takeover grant of a disk to another node.

// A lease volume lost to another node (the controller granted its disk
// away) is staged again on this node with a grant. The restage drops what
// is left of the lost claim (dropLost), and its record stops saying lost.
// The mount and the dm-crypt mapping went, but the data mapping was left
// over the disk: when the granted stage then fails before it holds the
// disk (its acquire fails), that mapping stays over the disk the other
// node holds, under no fence of this node, with nothing recording the
// loss (I1; sequences 49, 74 and 110). A data mapping that cannot be shown
// to be over the disk (its loop device's backing file unread) is left
// alone by the detach, which the drop must not take for nothing in use
// (sequence 179).
func TestAdv17GrantedRestageOfLostClaimLeavesItsDataMapping(t *testing.T) {
	for _, tc := range []struct{ name, fail string }{
		{"the granted stage's acquire fails", ""},
		{"the data mapping's backing file cannot be read, then the acquire fails", "loop backing file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.w.mu.Lock()
				d := r.w.disks[a.serial]
				d.holder, d.renewer, d.granted = "other", nil, true
				r.w.mu.Unlock()
				r.m.CheckAll(ctx)
				if c, _ := r.m.store.Get(a.id); c == nil || c.State != StateLost {
					t.Fatalf("%s's claim is not lost after another node took its disk: %+v", a.id, c)
				}
				r.logBreak("%s lost to another node; the controller publishes it to this node again, with a grant", a.id)
				r.w.mu.Lock()
				r.w.failNext["acquire"] = 1
				if tc.fail != "" {
					r.w.failNext[tc.fail] = 1
				}
				r.w.mu.Unlock()
				_, err := r.m.Stage(ctx, r.stageReq(a))
				r.logBreak("NodeStage %s with a grant: %s", a.id, errText(err))
				r.check()
				r.w.mu.Lock()
				what := r.w.inUse(a.serial)
				r.w.mu.Unlock()
				c, _ := r.m.store.Get(a.id)
				if what != "" && (c == nil || c.State != StateLost) {
					t.Errorf("%s: %s over the disk another node holds, and its claim says %s", a.id, what, phaseOf(c))
				}
			})
		})
	}
}

// The unstage of a lost claim releases nothing (the fence is the other
// node's) and so made no release guard's proof: when its teardown could
// not find or detach the data mapping (the lookup of the mapping failed,
// which reads as none; a backing file that cannot be read leaves the
// recorded one alone), the record went and the mapping stayed over the
// disk the other node holds, under no fence and no record of this node
// (I1; sequence 1100156, where the lookup hung).
func TestAdv17UnstageOfLostClaimForgetsItWithItsDataMappingLeft(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		d := r.w.disks[a.serial]
		d.holder, d.renewer, d.granted = "other", nil, true
		r.w.mu.Unlock()
		r.m.CheckAll(ctx)
		if c, _ := r.m.store.Get(a.id); c == nil || c.State != StateLost {
			t.Fatalf("%s's claim is not lost after another node took its disk: %+v", a.id, c)
		}
		r.w.mu.Lock()
		r.w.failNext["loop backing file"] = 1
		r.w.mu.Unlock()
		err := r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s (the data mapping's backing file cannot be read): %s", a.id, errText(err))
		r.check()
		r.w.mu.Lock()
		what := r.w.inUse(a.serial)
		r.w.mu.Unlock()
		c, _ := r.m.store.Get(a.id)
		if what != "" && (c == nil || c.State != StateLost) {
			t.Errorf("%s: %s over the disk another node holds, and its claim says %s (unstage: %s)", a.id, what, phaseOf(c), errText(err))
		}
		// The retry, its lookups answering, finishes the unstage.
		if err := r.m.Unstage(ctx, a.id, a.staging); err != nil {
			t.Errorf("retried unstage of %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		what = r.w.inUse(a.serial)
		r.w.mu.Unlock()
		if what != "" {
			t.Errorf("%s unstaged, but %s", a.id, what)
		}
	})
}
