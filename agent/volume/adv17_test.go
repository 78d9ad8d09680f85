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

// A lease volume's stage fails after its data mapping was made (its mount
// fails): the rollback detaches the mapping, but the record it leaves
// (interrupted: the stage wrote the lease area and a filesystem) still
// names the loop device. The volume's disk is then removed (the claim
// marked missing), another disk is attached at its device node, and a
// raw block lease volume is staged from it: the kernel gives its data
// mapping the lowest free loop device, the one the first record names
// (modelled here by numbering loop devices from the start again). The
// claim check takes back the first volume's stage cut short, finds its
// disk gone and cleans up what its record names: the second volume's data
// mapping, which is a loop device over the disk now at that node, is
// detached. The second volume is staged with nothing under it, and its
// publish fails.
func TestAdv17FailedStageRecordNamesADetachedMappingAnotherVolumeGets(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	b := &simVolume{id: "pvc-b", serial: "sim1", block: true}
	runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		r.w.mu.Lock()
		r.w.disks[b.serial].present = false
		r.w.failNext["mount"] = 1
		r.w.mu.Unlock()
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s (its mount fails): %s", a.id, errText(err))
		c, _ := r.m.store.Get(a.id)
		if err == nil || c == nil || c.Phase != PhaseInterrupted {
			t.Fatalf("%s's stage did not fail leaving an interrupted record: %v, %s", a.id, err, phaseOf(c))
		}
		r.logBreak("%s's record names the data mapping %q", a.id, c.DataDevice)
		r.remove(a)
		r.w.mu.Lock()
		da, db := r.w.disks[a.serial], r.w.disks[b.serial]
		db.path, db.minor, db.present = da.path, da.minor, true
		r.w.nLoop = 0 // the kernel hands out the lowest free loop device
		r.w.logf("disk %s attached at %s, the node %s had", b.serial, db.path, a.serial)
		r.w.mu.Unlock()
		if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
			t.Fatalf("stage %s: %v", b.id, err)
		}
		cb, _ := r.m.store.Get(b.id)
		r.logBreak("%s staged on %s with the data mapping %s", b.id, cb.Device, cb.DataDevice)
		r.m.CheckAll(ctx)
		r.logBreak("claim check")
		r.w.mu.Lock()
		_, mapped := r.w.loops[cb.DataDevice]
		r.w.mu.Unlock()
		if !mapped {
			t.Errorf("%s's data mapping %s was detached by the claim check of %s", b.id, cb.DataDevice, a.id)
		}
		err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: true})
		r.logBreak("NodePublish %s: %s", b.id, errText(err))
		if err != nil {
			t.Errorf("publish %s: %v", b.id, err)
		}
		r.check()
	})
}

// A lease volume's unstage detaches its data mapping and the agent dies
// before it records that (unmapRecorded records after the detach): the
// record, still staged, names the loop device. The next agent process
// takes the claim back; the volume's disk is then removed (the claim
// marked missing), another disk is attached at its device node, and a
// raw block lease volume is staged from it, whose data mapping gets the
// lowest free loop device: the one the first record names. The retried
// unstage of the first volume detaches what its record names, a loop
// device over the disk now at that node: the second volume's data
// mapping. The second volume is staged with nothing under it.
func TestAdv17UnstageCutShortAfterTheDetachNamesALoopDeviceAnotherVolumeGets(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	b := &simVolume{id: "pvc-b", serial: "sim1", block: true}
	runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		r.w.mu.Lock()
		r.w.disks[b.serial].present = false
		r.w.mu.Unlock()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		detach := r.m.unmapData
		r.m.unmapData = func(p string) error {
			err := detach(p)
			if err == nil {
				// The agent dies right after the detach.
				r.w.mu.Lock()
				r.w.crash()
				r.w.mu.Unlock()
				return errSimDead
			}
			return err
		}
		err := r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s (the agent dies after the detach): %s", a.id, errText(err))
		old := r.m
		r.start(ctx)
		old.Close()
		c, _ := r.m.store.Get(a.id)
		r.logBreak("agent restarted; %s: %s, data mapping %q", a.id, phaseOf(c), c.DataDevice)
		r.remove(a)
		r.w.mu.Lock()
		da, db := r.w.disks[a.serial], r.w.disks[b.serial]
		db.path, db.minor, db.present = da.path, da.minor, true
		r.w.nLoop = 0 // the kernel hands out the lowest free loop device
		r.w.logf("disk %s attached at %s, the node %s had", b.serial, db.path, a.serial)
		r.w.mu.Unlock()
		if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
			t.Fatalf("stage %s: %v", b.id, err)
		}
		cb, _ := r.m.store.Get(b.id)
		r.logBreak("%s staged on %s with the data mapping %s", b.id, cb.Device, cb.DataDevice)
		err = r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s retried: %s", a.id, errText(err))
		r.w.mu.Lock()
		_, mapped := r.w.loops[cb.DataDevice]
		r.w.mu.Unlock()
		if !mapped {
			t.Errorf("%s's data mapping %s was detached by the unstage of %s", b.id, cb.DataDevice, a.id)
		}
		err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: true})
		r.logBreak("NodePublish %s: %s", b.id, errText(err))
		if err != nil {
			t.Errorf("publish %s: %v", b.id, err)
		}
		r.check()
	})
}

// A volume is staged; its disk is removed and attached again at another
// device node while the volume is mounted (the staging mount holds the
// device it had before, or a data mapping over it, which is gone: every
// I/O of it fails). The claim check finds the disk at its new node and
// takes the claim back there, healthy. The kubelet's repeated NodeStage
// then answers that the volume is staged, and NodePublish binds the
// staging mount into a pod: both answer OK over a filesystem on a device
// that is gone, and the volume is not usable.
func TestAdv17DiskBackAtAnotherNodeLeavesAStaleMountAnsweredStaged(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lease bool
	}{{"reservations: mounted from the disk", false}, {"lease: mounted from a data mapping over the disk", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, tc.lease, []*simVolume{a}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				attachedOver := map[string]string{}
				r.m.host = backingHost{hookHost: h, attachedOver: attachedOver}
				mapData := r.m.mapData
				r.m.mapData = func(disk string, offset int64, ro bool) (string, error) {
					p, err := mapData(disk, offset, ro)
					if err == nil {
						attachedOver[p] = disk
					}
					return p, err
				}
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.remove(a)
				r.readd(a, false)
				r.m.CheckAll(ctx)
				c, _ := r.m.store.Get(a.id)
				r.w.mu.Lock()
				held := r.w.mounts[a.staging]
				r.w.mu.Unlock()
				r.logBreak("disk of %s attached again at %s; after the claim check: %s, the staging mount holds %s", a.id, c.Device, phaseOf(c), held)
				_, err := r.m.Stage(ctx, r.stageReq(a))
				r.logBreak("NodeStage %s again: %s", a.id, errText(err))
				if err == nil {
					t.Errorf("NodeStage %s answered OK while its staging mount holds %s, over a device that is gone (the disk is at %s now)", a.id, held, c.Device)
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0]})
				r.logBreak("NodePublish %s: %s", a.id, errText(err))
				if err == nil {
					t.Errorf("NodePublish %s answered OK, binding a staging mount of %s, over a device that is gone", a.id, held)
				}
				r.check()
			})
		})
	}
}

// backingHost is the simulation's host whose data mappings say, as the
// kernel's loop backing_file does, the device node they were attached
// over: a mapping over a disk that went away does not map the disk at its
// new node (the simulation's MapsDisk follows the disk wherever it is).
type backingHost struct {
	*hookHost
	attachedOver map[string]string
}

func (h backingHost) MapsDisk(p, disk string) bool {
	return h.hookHost.MapsDisk(p, disk) && h.attachedOver[p] == disk
}

func (h backingHost) MapsDiskNow(p, disk string) bool {
	return h.hookHost.MapsDiskNow(p, disk) && h.attachedOver[p] == disk
}
