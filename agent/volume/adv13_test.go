package volume

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

// Directed reproductions, thirteenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

// Volume A is staged on disk X at /dev/vdb; X is removed from the node
// (the claim is recorded missing), and disk Y, volume B's, is attached
// and takes the freed node name and number, /dev/vdb; B is staged on it
// and its disk marked claimed for the udev rules (the mark lets systemd
// take the disk as ready: without it the rules say SYSTEMD_READY=0 of a
// disk whose filesystem is mounted). A's claim is then let go of -- by
// its unstage (the disk detached: dropDetached), or by the start-up
// check of a restarted agent (cleanupGone) -- and each clears the claim
// mark of the node name A's record still holds, vdb: B's disk, staged
// and mounted, is marked unclaimed by an operation of volume A. A claim
// whose disk is gone names a device node that is no longer its disk's;
// only a mark of its own disk is its to clear.
func TestAdv13GoneClaimClearsTheClaimMarkOfTheDiskAtItsOldNode(t *testing.T) {
	for _, how := range []string{"unstage", "restart"} {
		t.Run(how, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			dir := t.TempDir()
			claimed, sysfs := filepath.Join(dir, "claimed"), filepath.Join(dir, "sys")
			tune := func(m *Manager) {
				// No sysfs under the fake root: the mark is written, the
				// change uevent is not triggered.
				m.o.Config.ClaimedDir, m.finder.SysfsRoot = claimed, sysfs
			}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				tune(r.m)
				r.w.mu.Lock()
				r.w.disks[b.serial].present = false
				r.w.mu.Unlock()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Errorf("stage %s: %v", a.id, err)
					return
				}
				r.remove(a)
				r.w.mu.Lock()
				x, y := r.w.disks[a.serial], r.w.disks[b.serial]
				y.path, y.minor, y.present = x.path, x.minor, true
				r.w.mu.Unlock()
				r.logBreak("disk of %s removed; disk of %s attached at %s", a.id, b.id, y.path)
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Errorf("stage %s: %v", b.id, err)
					return
				}
				mark := filepath.Join(claimed, filepath.Base(y.path))
				if _, err := os.Stat(mark); err != nil {
					t.Errorf("the staged disk of %s is not marked claimed: %v", b.id, err)
					return
				}
				switch how {
				case "unstage":
					err := r.m.Unstage(ctx, a.id, a.staging)
					r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				case "restart":
					r.w.mu.Lock()
					r.w.crash()
					r.w.mu.Unlock()
					r.m.Close()
					r.startWith(ctx, "sim-boot", nil, tune)
					r.logBreak("agent restarted")
				}
				if c, _ := r.m.store.Get(a.id); c != nil {
					t.Logf("%s's claim is still recorded: %s", a.id, phaseOf(c))
				}
				cb, _ := r.m.store.Get(b.id)
				if _, err := os.Stat(mark); err != nil {
					t.Errorf("letting go of volume %s's claim (its disk gone) cleared the claim mark of %s, volume %s's disk, staged there (record: %s): %v",
						a.id, y.path, b.id, phaseOf(cb), err)
				}
			})
		})
	}
}
