package volume

import (
	"context"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Directed reproductions, seventeenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

// A lease volume is lost to another node and the stop of its I/O fails
// (its layers cannot be shown drained): recorded io_not_stopped. The agent
// restarts; the start-up check's stop fails again, and the claim is listed
// for the host watchdog as lost with its I/O running, which stops the
// feeding. The controller grants the volume back to this node, and the
// kubelet's stage drops what is left of the lost claim (dropLost): the
// staging mount goes, the live entry goes (and with it the listing), the
// record says interrupted; the data mapping over the disk stays. The
// stage then fails before its acquire (choosing the fencing fails): the
// lost claim's data mapping is left over a disk another node holds, with
// its I/O never shown stopped, the record no longer saying lost, and the
// host watchdog fed.
func TestAdv17DropLostLeavesTheDataMappingOfALostClaimUnwatched(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		r.w.disks[a.serial].holder = "other"
		r.w.failNext["drain"] = 1
		r.w.mu.Unlock()
		r.m.CheckAll(ctx)
		if c, _ := r.m.store.Get(a.id); c == nil || c.State != StateLost || !c.IONotStopped {
			t.Fatalf("%s's claim is not lost with its I/O not stopped: %s", a.id, phaseOf(c))
		}
		r.w.mu.Lock()
		r.w.crash()
		r.w.failNext["drain"] = 1
		r.w.mu.Unlock()
		old := r.m
		r.start(ctx)
		old.Close()
		if !listedRunning(r.m, a.id) {
			t.Fatalf("%s is not listed for the host watchdog as lost with its I/O running after the restart: %+v", a.id, r.m.Leases())
		}
		r.logBreak("agent restarted; %s listed as lost with its I/O running", a.id)
		req := r.stageReq(a)
		req.Grant = &fence.Grant{Disk: a.id, Node: "node-a", Supersedes: []fence.Key{0x6f74686572}}
		r.w.mu.Lock()
		r.w.failNext["choose"] = 1
		r.w.mu.Unlock()
		_, err := r.m.Stage(ctx, req)
		r.logBreak("NodeStage %s with a grant (choosing its fencing fails): %s", a.id, errText(err))
		r.w.mu.Lock()
		what := r.w.inUse(a.serial)
		r.w.mu.Unlock()
		if what != "" && !listedRunning(r.m, a.id) {
			t.Errorf("%s's lost claim left %s on the node, while the volume is no longer listed for the host watchdog (%+v)", a.id, what, r.m.Leases())
		}
		r.check()
	})
}

// listedRunning reports whether volume is listed for the host watchdog as
// a lost lease whose I/O runs, or one not taken back.
func listedRunning(m *Manager, volume string) bool {
	for _, l := range m.Leases() {
		if l.Volume == volume && (l.Running || l.Unresumed) {
			return true
		}
	}
	return false
}
