package volume

import (
	"context"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// Directed reproductions, eighteenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

var adv18Rewrap = luks2.TransitToken{Mount: "transit", KeyName: "sim", KeyVersion: 2, Ciphertext: "vault:v2:c2lt"}

// An encrypted volume is staged on /dev/vdb. Its disk leaves the node
// (the uevent watcher is off, volumes.watch_disks: false, or its event
// not yet handled; the claim check's next pass is up to 10 s away), and
// another disk is attached at the same device node: a clone of the
// volume, whose LUKS2 header (passphrase and token) is the volume's own,
// and which this node never staged nor fenced. The node plugin rewraps
// the volume's token: UpdateVolumeToken writes the header at the device
// node the record names without proving it is still the volume's disk
// (Expand proves it, stillOurs), and rewrites the clone's header, a disk
// another node may hold.
func TestAdv18TokenRewriteWritesTheDiskAtTheVolumesOldDeviceNode(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
	clone := &simVolume{id: "pvc-clone", serial: "sim1", encrypted: true}
	runBreak(t, false, []*simVolume{a, clone}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		r.w.mu.Lock()
		r.w.disks[clone.serial].present = false
		r.w.mu.Unlock()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		r.w.rewriting = a.serial
		da, dc := r.w.disks[a.serial], r.w.disks[clone.serial]
		da.present = false
		dc.path, dc.minor, dc.present = da.path, da.minor, true
		r.w.content[dc.serial+"@0"] = "luks"
		r.w.logf("disk %s left the node (no uevent handled); disk %s, a clone of %s, attached at %s", da.serial, dc.serial, a.id, dc.path)
		r.w.mu.Unlock()
		_, err := r.m.UpdateVolumeToken(ctx, a.id, []byte("sim passphrase"), *r.stageReq(a).Token, adv18Rewrap)
		r.logBreak("UpdateVolumeToken %s: %s", a.id, errText(err))
		// A write of another disk's header is a violation (simCrypt's
		// ReplaceToken), which runBreak reports.
		if err == nil || agenterr.KindOf(err) != agenterr.FailedPrecondition {
			t.Errorf("the token rewrite of %s, whose disk is no longer at its device node: %v, want a refusal (FailedPrecondition)", a.id, err)
		}
	})
}

// A lease volume (its filesystem on a loop device over the data area of
// its virtio disk /dev/vdb) is staged and published. Its disk leaves the
// node (the uevent watcher marks the claim missing) and is attached
// again at the same device node, with the same device number: a new
// block device, while the staging mount and the loop device under it
// hold the one that left, whose every I/O fails. The disk's identity
// check passes (same node, same number, same serial), so the claim check
// says the disk is back, and the kubelet's repeated NodeStage and
// NodePublish answer OK: the volume is reported staged and healthy while
// what the pod writes goes nowhere. Control: the disk never left.
func TestAdv18DiskBackAtItsOwnNodeLeavesTheVolumeOnTheDeviceThatLeft(t *testing.T) {
	for _, tc := range []struct {
		name  string
		block bool
		left  bool
	}{
		{"control: filesystem, the disk stays", false, false},
		{"filesystem, the disk back at its node", false, true},
		{"control: raw block, the disk stays", true, false},
		{"raw block, the disk back at its node", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", block: tc.block}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				pub := PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: a.block}
				if err := r.m.Publish(ctx, pub); err != nil {
					t.Fatalf("publish %s: %v", a.id, err)
				}
				if tc.left {
					r.remove(a)
					r.readd(a, true)
					r.logBreak("disk of %s removed and attached again at its own device node", a.id)
				}
				r.m.CheckAll(ctx)
				_, serr := r.m.Stage(ctx, r.stageReq(a))
				r.logBreak("NodeStage %s again: %s", a.id, errText(serr))
				perr := r.m.Publish(ctx, pub)
				r.logBreak("NodePublish %s again: %s", a.id, errText(perr))
				st, sterr := r.m.Stats(ctx, a.id, "")
				r.logBreak("NodeGetVolumeStats %s: abnormal %v %q, %s", a.id, st.Abnormal, st.Message, errText(sterr))
				c, _ := r.m.store.Get(a.id)
				r.w.mu.Lock()
				defer r.w.mu.Unlock()
				dead := c != nil && c.DataDevice != "" && r.w.loops[c.DataDevice] != a.serial
				switch {
				case dead && (serr == nil || perr == nil):
					t.Errorf("%s is staged over %s, which maps the disk that left (%q), and NodeStage answered %v, NodePublish %v",
						a.id, c.DataDevice, r.w.loops[c.DataDevice], serr, perr)
				case dead && sterr == nil && !st.Abnormal:
					t.Errorf("%s is staged over %s, which maps the disk that left, and its health is reported normal", a.id, c.DataDevice)
				case !tc.left && (serr != nil || perr != nil || sterr != nil || st.Abnormal):
					t.Errorf("control: NodeStage %v, NodePublish %v, stats %+v %v", serr, perr, st, sterr)
				}
			})
		})
	}
}
