package volume

// Directed reproductions, fifth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go, break2_test.go,
// adv3_test.go, adv4_test.go).

import (
	"context"
	"testing"
)

// An unfenced stage (the explicit opt-in of the request and the agent)
// cut short between its mount and its record: the agent dies, its record
// says claiming with method "none". The next process's start-up check
// cannot unmount the staging path (EBUSY) and its choice of the disk's
// fencing fails (an INQUIRY that times out). reconcileInterrupted goes to
// the unresolved path on a failed choice only for a lease claim or one
// whose record names a method other than "none", and proves the volume
// unused only when the choice succeeded with no fencer: an unfenced claim
// whose choice failed falls through both, and is recorded interrupted
// with its filesystem still mounted at the staging path (I3). No check
// takes it back (it is neither unresolved nor missing), and every retried
// stage answers UNAVAILABLE "the claim check takes it back".
func TestAdv5UnfencedStageCutShortWhoseChoiceFailsRecordedInterruptedWhileMounted(t *testing.T) {
	unfencedStageCutShortAfterItsMount(t, "its unmount busy, its choice of fencing failing", func(s simFencers) FencerFactory { return chooseFails{s} })
}

// An encrypted raw block volume whose unstage stops at the release
// guard's flush of the disk (an I/O error of the disk's cache flush),
// after it closed the volume's dm-crypt mapping (closeLUKS records
// Mapper ""). The claim stays staged, as it should, for the retry. But a
// NodeStage of it now (the kubelet stages it again for a pod scheduled
// back on the node) answers "already staged": restaged's stillStaged
// counts a raw block volume as intact without looking at its mappings
// (it only checks the staging mount, which a raw block volume has none
// of), so the repair that would open the mapping again never runs, and
// the stage answers the disk itself as the volume's device. NodePublish
// then binds the ciphertext disk, LUKS2 header and all, into the pod as
// its raw block device: the pod's first write lands on the header and
// the volume's data is gone. A repeated stage must repair what is
// missing (reopen the mapping), or answer UNAVAILABLE.
func TestAdv5EncryptedRawBlockRestagedAfterUnstageStoppedPublishesTheCiphertextDisk(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", block: true, encrypted: true}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		fh := &flushFailHost{hookHost: h}
		r.m.host = fh
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		fh.mu.Lock()
		fh.failFlush = 1
		fh.mu.Unlock()
		err := r.m.Unstage(ctx, a.id, a.staging)
		c, _ := r.m.store.Get(a.id)
		mapper := ""
		if c != nil {
			mapper = c.Mapper
		}
		r.logBreak("NodeUnstage %s (the flush before the release fails): %s; record: %s mapper %q", a.id, errText(err), phaseOf(c), mapper)
		res, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s again: %s; device %q", a.id, errText(err), res.Device)
		err = r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: true})
		r.logBreak("NodePublish %s (raw block): %s", a.id, errText(err))
		r.w.mu.Lock()
		src, published := r.w.mounts[a.targets[0]]
		want := "/dev/mapper/" + mapperName(a.id)
		if published && src != want {
			r.w.violate("the encrypted raw block volume %s is published from %s (its LUKS2 ciphertext), not its dm-crypt mapping %s", a.id, src, want)
		}
		r.w.mu.Unlock()
	})
}

// The same for a lease-fenced raw block volume (not encrypted): its
// unstage detaches the data mapping (unmapAll, which leaves the record's
// data_device as it was) and stops at the release guard's flush of the
// disk. The claim stays staged, naming the detached loop device. A
// NodeStage of it now answers "already staged" with that loop device
// (stillStaged counts a raw block volume as intact without looking at
// its mappings), and NodePublish binds the detached loop device into the
// pod: the kubelet's retries end "staged and published" with no mapping
// of the volume's disk behind the pod's device (I5), and on a node the
// kernel hands that loop number to the next mapping made, another
// volume's data mapping included.
func TestAdv5LeaseRawBlockRestagedAfterUnstageStoppedPublishesADetachedMapping(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		fh := &flushFailHost{hookHost: h}
		r.m.host = fh
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		fh.mu.Lock()
		fh.failFlush = 1
		fh.mu.Unlock()
		err := r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s (the flush before the release fails): %s", a.id, errText(err))
		res, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s again: %s; device %q", a.id, errText(err), res.Device)
		err = r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0], Block: true})
		r.logBreak("NodePublish %s (raw block): %s", a.id, errText(err))
		r.w.mu.Lock()
		if src, ok := r.w.mounts[a.targets[0]]; ok && r.w.loops[r.w.pods[src]] != a.serial {
			r.w.violate("the lease raw block volume %s is published from %s, which maps nothing (attached mappings: %v)", a.id, src, r.w.loops)
		}
		r.w.mu.Unlock()
	})
}
