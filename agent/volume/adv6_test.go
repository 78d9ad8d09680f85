package volume

// Directed reproductions, sixth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go, break2_test.go).

import (
	"context"
	"strings"
	"testing"
)

// adv6PublishAfterNodeReused stages the raw block volume a without
// fencing (the request's and the agent's explicit opt-in),
// then (swap) its disk leaves the node and the kernel gives its device
// node to another disk, one another node holds, before the agent has
// handled the removal's uevent (the watcher lags behind, or the netlink
// socket overflowed and the rescan is still to come); then the kubelet
// publishes a. It checks that the pod is given the volume's own disk.
func adv6PublishAfterNodeReused(t *testing.T, swap bool) {
	a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		r.m.o.Config.AllowUnfenced = true
		r.m.o.Fencers = noFencingNow{simFencers{w: r.w, gen: r.w.gen}}
		req := r.stageReq(a)
		req.AllowUnfenced = true
		if _, err := r.m.Stage(ctx, req); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		if swap {
			r.w.mu.Lock()
			d := r.w.disks[a.serial]
			d.present, d.removed = false, true
			r.w.minor++
			r.w.disks["sim9"] = &simDiskState{serial: "sim9", path: d.path, minor: r.w.minor, present: true, lease: true, leaseArea: true, holder: "other"}
			r.w.mu.Unlock()
			r.logBreak("disk %s leaves the node; disk sim9 (node-b's, fenced with the lease, which blocks no write) appears at its node %s; the removal's uevent is not handled yet", a.serial, d.path)
		}
		err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: true})
		r.logBreak("NodePublish %s (raw block): %s", a.id, errText(err))
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		if src, ok := r.w.mounts[a.targets[0]]; ok {
			if s, _, _ := r.w.region(src); s != a.serial {
				r.w.violate("P1: the pod of %s is given %s, which is disk %s (not the volume's disk %s, and whose lease node-b holds)", a.id, src, s, a.serial)
			}
		} else if !swap {
			t.Errorf("control: %s was not published: %v", a.id, err)
		}
	})
}

// NodePublish of an unfenced raw block volume (staged by the explicit
// opt-in) binds the device node path recorded at stage time (c.Device)
// into the pod without checking that the node is still the volume's
// disk. fenceHeld skips a claim that is not held (a fenced claim's
// fencer would run the identity check inside its Check) and blockIntact
// looks only at the record's mappings; neither runs Device.Verify, which
// a repeated stage runs (stillStaged). When the disk leaves the node and
// the kernel gives its node name to another disk before the agent has
// handled the removal (the watcher lags, or its netlink socket overflowed
// and the rescan is to come), the pod is given that other disk: another
// node's lease-fenced volume, whose lease blocks none of the pod's
// writes. A filesystem volume is safe (its bind is of the staging mount);
// a raw block one is bound by name.
func TestAdv6RawBlockPublishBindsWhateverDiskNowHasTheNodeName(t *testing.T) {
	adv6PublishAfterNodeReused(t, true)
}

// Control: the disk stays; the publish binds the volume's own disk.
func TestAdv6RawBlockPublishBindsItsOwnDiskControl(t *testing.T) {
	adv6PublishAfterNodeReused(t, false)
}

// adv6EncryptedBlockCloseAnswerLost stages the encrypted raw block
// volume a, unstages it once (lose: the dm-crypt close's answer is lost,
// its effect done), stages it again and publishes it, and checks that the
// pod's device is the volume's open dm-crypt mapping.
func adv6EncryptedBlockCloseAnswerLost(t *testing.T, lose bool) {
	a := &simVolume{id: "pvc-a", serial: "sim0", block: true, encrypted: true}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		if lose {
			r.w.mu.Lock()
			r.w.loseNext["dm-crypt close"] = 1
			r.w.mu.Unlock()
		}
		err := r.m.Unstage(ctx, a.id, a.staging)
		c, _ := r.m.store.Get(a.id)
		mapper := ""
		if c != nil {
			mapper = c.Mapper
		}
		r.logBreak("NodeUnstage %s: %s; record: %s mapper %q; open mappings %v", a.id, errText(err), phaseOf(c), mapper, r.w.crypts)
		res, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s again: %s; device %q", a.id, errText(err), res.Device)
		err = r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: true})
		r.logBreak("NodePublish %s (raw block): %s", a.id, errText(err))
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		src, ok := r.w.mounts[a.targets[0]]
		if !ok {
			r.w.violate("I5: with no fault left, the kubelet's stage and publish of %s do not end published: %v", a.id, err)
			return
		}
		if s, _, found := r.w.region(src); !found || s != a.serial || !strings.HasPrefix(src, "/dev/mapper/") {
			r.w.violate("the pod of the encrypted raw block volume %s is given %s, which is no open dm-crypt mapping of its disk (open: %v)", a.id, src, r.w.crypts)
		}
	})
}

// An encrypted raw block volume's unstage whose dm-crypt close takes
// effect but answers an error (a timeout: the mapping is gone, the
// record keeps naming it, as the last commit's rollback wants for a close
// that failed). The claim stays staged for the retry. A NodeStage now
// answers "already staged": stillStaged's blockIntact only asks whether
// the record names a mapping (c.Mapper != ""), never whether it is open,
// so the repair that would open it again never runs, and NodePublish binds
// /dev/mapper/<name>, which no longer exists (on a node: the bind fails
// with ENOENT on every retry; the kubelet, told the volume is staged,
// never stages it again): the retries never converge (I5), and a mapping
// of that name made later (by hand, a restore) is handed to the pod
// unchecked.
func TestAdv6EncryptedRawBlockCloseAnswerLostRestagedWithoutItsMapping(t *testing.T) {
	adv6EncryptedBlockCloseAnswerLost(t, true)
}

// Control: the unstage's close answers; stage and publish give the pod
// the mapping.
func TestAdv6EncryptedRawBlockRestagedControl(t *testing.T) {
	adv6EncryptedBlockCloseAnswerLost(t, false)
}
