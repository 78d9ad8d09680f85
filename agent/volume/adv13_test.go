package volume

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
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

// Volume A's stage is cut short by a crash during its mkfs on disk X at
// /dev/vdb: its record names that format, begun and not finished. X is
// detached from the node before the agent is back (the controller moves
// the volume), and the start-up check, finding X nowhere, forgets A's
// claim -- except for its record, kept for the format's sake
// (forget): interrupted, nothing held, but still naming X's device node
// and number, and not missing. Disk Y, volume B's, is attached and gets
// the free node and number, /dev/vdb. B's stage is refused for as long
// as A's record stays ("disk /dev/vdb is already staged on this node as
// volume pvc-a"), and A's unstage keeps that record again: B never
// stages (I5), by the record of a volume whose disk is not on the node.
// The same record makes the uevent watcher's Classify take any disk at
// that number for one of this agent's claims and leave it alone unread,
// a disk another node holds included. Control: Y attached at a node of
// its own stages.
func TestAdv13KeptRecordOfAGoneDiskClaimsTheDiskThatTakesItsNode(t *testing.T) {
	for _, sameNode := range []bool{false, true} {
		name := map[bool]string{false: "control: Y at a node of its own", true: "Y at X's old node"}[sameNode]
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, false, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				r.w.mu.Lock()
				r.w.disks[b.serial].present = false
				r.w.mu.Unlock()
				h.beforeMkfs = func(blank.Proof) error {
					r.w.mu.Lock()
					r.w.logf("    mkfs: crash before it finishes")
					r.w.crash()
					r.w.mu.Unlock()
					return errSimDead
				}
				_, err := r.m.Stage(ctx, r.stageReq(a))
				r.logBreak("NodeStage %s, the agent dying in its mkfs: %s", a.id, errText(err))
				r.w.mu.Lock()
				x, y := r.w.disks[a.serial], r.w.disks[b.serial]
				x.present = false
				if sameNode {
					y.path, y.minor = x.path, x.minor
				}
				y.present = true
				r.w.mu.Unlock()
				r.logBreak("disk of %s detached; disk of %s attached at %s", a.id, b.id, y.path)
				r.m.Close()
				r.start(ctx)
				ca, _ := r.m.store.Get(a.id)
				r.logBreak("agent restarted; %s's record: %s", a.id, phaseOf(ca))
				if err := r.m.Unstage(ctx, a.id, a.staging); err != nil {
					r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				}
				for try := 0; try < 3; try++ {
					if _, err = r.m.Stage(ctx, r.stageReq(b)); err == nil {
						break
					}
				}
				r.logBreak("NodeStage %s, retried: %s", b.id, errText(err))
				if err != nil {
					t.Errorf("volume %s's stage on its disk %s is refused by the record volume %s kept of a disk no longer on the node: %v", b.id, y.path, a.id, err)
				}
				if err := r.m.Unstage(ctx, b.id, b.staging); err != nil {
					t.Errorf("unstage %s: %v", b.id, err)
				}
				v, cerr := r.m.Classify(ctx, ueventOf(y.minor))
				r.logBreak("Classify of the disk at %s: %+v, %s", y.path, v, errText(cerr))
				if cerr == nil && !v.Refuse {
					t.Errorf("the disk at %s, on no claim of this node, was left alone by Classify without being read", y.path)
				}
			})
		})
	}
}
