package volume

import (
	"context"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Directed reproductions, fifteenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

// The first agent process after a boot (afterBoot) stages a lease volume,
// loses it to another node and is asked to stage it again with the
// controller's grant. The lost claim's data mapping is still there
// (dropLost leaves it), the takeover's acquire answers an error although
// it took the lease (its answer lost), and the rollback's release guard
// keeps the fence for the mapping: the fence goes live without a fencer,
// listed for the host watchdog as not resumed (keptLive). The claim check
// then takes it back (reconcileFence), and the resume fails (a read of
// the lease area that times out): the entry is made again as not resumed
// only when mayBeWriting, which is false for the whole life of the first
// process since the boot, though the mapping is this very process's. The
// volume's disk stays mapped, its lease renewed by nobody, and the host
// watchdog is fed (I1). A process of the same boot (control) keeps it
// listed.
func TestAdv15FirstProcessSinceBootFeedsTheWatchdogForAKeptLeaseItCannotResume(t *testing.T) {
	for _, tc := range []struct {
		name string
		boot string
	}{{"control: a later process of the same boot", "sim-boot"}, {"the first process since the boot", "boot-2"}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				r.reboot()
				old := r.m
				r.startBooted(ctx, tc.boot, nil)
				old.Close()
				if got := r.m.mayBeWriting(); got == (tc.boot != "sim-boot") {
					t.Fatalf("mayBeWriting = %v in process of boot %s", got, tc.boot)
				}
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.w.mu.Lock()
				r.w.disks[a.serial].holder = "other"
				r.w.mu.Unlock()
				r.m.CheckAll(ctx)
				if c, _ := r.m.store.Get(a.id); c == nil || c.State != StateLost {
					t.Fatalf("%s's claim is not lost after another node took its disk: %+v", a.id, c)
				}
				r.logBreak("%s lost; the controller grants it back to this node", a.id)
				req := r.stageReq(a)
				req.Grant = &fence.Grant{Disk: a.id, Node: "node-a", Supersedes: []fence.Key{0x6f74686572}}
				r.w.mu.Lock()
				r.w.loseNext["acquire"] = 1
				r.w.mu.Unlock()
				_, err := r.m.Stage(ctx, req)
				r.logBreak("NodeStage %s with a grant: %s", a.id, errText(err))
				r.check()
				r.w.mu.Lock()
				r.w.failNext["resume"] = 1
				r.w.mu.Unlock()
				r.m.CheckAll(ctx)
				r.logBreak("claim check (its resume fails)")
				r.check()
			})
		})
	}
}
