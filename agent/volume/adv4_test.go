package volume

// Directed reproductions, fourth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go, adv3_test.go).

import (
	"context"
	"os/exec"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// adv4WWN is the stage request of v with its disk named by a WWN as well
// (the locator of a disk that reports no serial).
func adv4WWN(r *simRun, v *simVolume) StageRequest {
	req := r.stageReq(v)
	req.Locator.Disk.WWN = "naa.6001405f00000000000000000000a4a4"
	return req
}

// A disk that reports no serial (a virtio disk attached without one,
// named by the controller through its WWN or PCI address). A claim check
// whose identity read of the mounted, published disk fails and whose
// fresh lookup fails too (the same read failing twice: cameBack answers
// diskGone) records the claim missing while the disk never left. The
// one-disk-one-volume rule (claimedBy) skips missing claims unless their
// serial matches the disk's, and an empty serial matches nothing: a
// second volume id whose locator names the same disk is staged over the
// mounted first one (its own fencer takes the disk's fence over from the
// first one's, the filesystem is mounted a second time). It must be
// refused (FAILED_PRECONDITION), as it is for a disk with a serial.
func TestAdv4MissingClaimOfDiskWithoutSerialLetsASecondVolumeStageIt(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: ""}
	b := &simVolume{id: "pvc-b", serial: ""}
	runBreak(t, true, []*simVolume{a, b}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, adv4WWN(r, a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		if err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0]}); err != nil {
			t.Fatalf("publish %s: %v", a.id, err)
		}
		r.w.mu.Lock()
		r.w.failNext["verify"] = 1
		r.w.failNext["locate"] = 1
		r.w.mu.Unlock()
		r.m.CheckAll(ctx)
		c, _ := r.m.store.Get(a.id)
		r.logBreak("claim check with the identity read and the lookup failing once; %s's record: %s missing=%v", a.id, phaseOf(c), c != nil && c.Missing)
		_, err := r.m.Stage(ctx, adv4WWN(r, b))
		r.logBreak("NodeStage %s (same disk, no serial, as the mounted %s): %s", b.id, a.id, errText(err))
		r.vols = []*simVolume{a}
		r.check()
		if agenterr.Code(err) != codes.FailedPrecondition {
			t.Errorf("a second volume's stage of the disk of the mounted, published %s answered %s; want FAILED_PRECONDITION (one disk, one volume)", a.id, errText(err))
		}
		r.w.mu.Lock()
		if _, ok := r.w.mounts[b.staging]; ok {
			r.w.violate("one disk, one volume: %s's filesystem is mounted at %s's staging path too", a.id, b.id)
		}
		r.w.mu.Unlock()
	})
}

// A reservation-fenced (PR) stage cut short after its mount (the agent
// died before its record said staged), whose start-up check can neither
// unmount the staging path (EBUSY) nor make the release guard's proof
// once (reading the mount table or sysfs fails). The guard keeps the
// fence (right), and reconcileInterrupted leaves the claim unresolved for
// "the check to try again" (unresolvedInterrupted); but only a lease
// claim is listed as unresolved: a PR claim recorded claiming is skipped
// by every periodic check (CheckAll retakes a claim not staged only when
// it is unresolved or missing). The volume stays mounted with its fence
// never checked: when another node preempts the reservation (a takeover
// with the controller's grant), no check finds the loss and nothing stops
// the mounted filesystem's I/O (I1, P4), and the record says "claiming"
// for a mounted volume (I3). The retried NodeStage answers UNAVAILABLE
// ("the claim check takes it back"), which never comes.
func TestAdv4PRStageCutShortWhoseProofFailsOnceIsNeverCheckedAgain(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		r.stagedButRecordedClaiming(t, a)
		r.w.mu.Lock()
		r.w.crash()
		r.w.failNext["umount"] = 1
		r.w.failNext["in use"] = 1
		r.w.mu.Unlock()
		old := r.m
		r.start(ctx)
		old.Close()
		now, _ := r.m.store.Get(a.id)
		r.logBreak("agent restarted over a PR stage cut short after its mount; its unmount and the guard's proof failing once: %s", phaseOf(now))
		r.m.CheckAll(ctx)
		r.m.CheckAll(ctx)
		now, _ = r.m.store.Get(a.id)
		r.logBreak("two claim checks: %s", phaseOf(now))
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s retried: %s", a.id, errText(err))
		// Another node takes the disk over with the controller's grant.
		r.w.mu.Lock()
		r.w.disks[a.serial].holder = "other"
		r.w.logf("another node preempts the reservation of %s", a.serial)
		r.w.mu.Unlock()
		r.m.CheckAll(ctx)
		now, _ = r.m.store.Get(a.id)
		r.logBreak("claim check: %s", phaseOf(now))
		r.check()
		if now == nil || (now.Phase != PhaseStaged && now.State != StateLost) {
			t.Errorf("the mounted volume's claim after the checks: %s; want staged and checked (lost once preempted)", phaseOf(now))
		}
	})
}

// checkI3Of checks I3 alone for v: mounted at its staging path or a target
// while its record says nothing or interrupted (the harness's I1 counts
// an unfenced claim's mount as a fence not held).
func checkI3Of(r *simRun, v *simVolume, when string) {
	r.w.mu.Lock()
	defer r.w.mu.Unlock()
	c, _ := r.m.store.Get(v.id)
	for _, p := range append([]string{v.staging}, v.targets...) {
		if _, ok := r.w.mounts[p]; ok && (c == nil || c.Phase == PhaseInterrupted) {
			r.w.violate("I3 (%s): %s is mounted at %s but its claim record says %s", when, v.id, p, phaseOf(c))
			return
		}
	}
}

// An unfenced stage (the explicit opt-in of the request and the agent)
// cut short between its mount and its record: the agent dies, its
// record says claiming with method "none". The next process's start-up
// check cannot unmount the staging path (EBUSY: something of the node
// holds the filesystem open). reconcileInterrupted makes the release
// guard's proof only for a disk with a fencer, or for a disk whose record
// names a method other than "none"; for an unfenced claim it proves
// nothing and records the claim interrupted with the filesystem still
// mounted at the staging path (I3): the same defect the rollback of an
// unfenced stage had (unrecord), on the start-up check's path. No check
// takes an interrupted claim back, and every retried stage answers
// UNAVAILABLE "the claim check takes it back", which never comes.
func TestAdv4UnfencedStageCutShortWhoseUnmountFailsRecordedInterrupted(t *testing.T) {
	unfencedStageCutShortAfterItsMount(t, "its unmount of the staging path busy", func(s simFencers) FencerFactory { return noFencingNow{s} })
}

// unfencedStageCutShortAfterItsMount: an unfenced stage (by opt-in) whose
// agent dies right after the mount; the next process starts with its
// unmount of the staging path busy and its fencing as fencers makes it.
// The record must say staged whenever the volume is mounted (I3): after
// the start-up check, and after a claim check and a retried stage.
func unfencedStageCutShortAfterItsMount(t *testing.T, what string, fencers func(simFencers) FencerFactory) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		r.m.o.Config.AllowUnfenced = true
		r.m.o.Fencers = noFencingNow{simFencers{w: r.w, gen: r.w.gen}}
		r.m.host = crashAfterMountHost{hookHost: h, target: a.staging}
		req := r.stageReq(a)
		req.AllowUnfenced = true
		_, err := r.m.Stage(ctx, req)
		r.logBreak("NodeStage %s (unfenced; the agent dies right after the mount): %s", a.id, errText(err))
		old := r.m
		r.startHosted(ctx, "sim-boot", fencers,
			func(h simHost) host { return busyUnmountHost{simHost: h, busy: map[string]bool{a.staging: true}} },
			func(m *Manager) { m.o.Config.AllowUnfenced = true })
		old.Close()
		c, _ := r.m.store.Get(a.id)
		r.logBreak("agent process %d started (%s): %s", r.w.gen, what, phaseOf(c))
		checkI3Of(r, a, "after the start-up check")
		r.m.CheckAll(ctx)
		_, err = r.m.Stage(ctx, req)
		c, _ = r.m.store.Get(a.id)
		r.logBreak("claim check, then NodeStage %s retried: %s; record: %s", a.id, errText(err), phaseOf(c))
		checkI3Of(r, a, "after a claim check and a retried stage")
	})
}

// A claim record whose data mapping names a device that is not a data
// mapping of the volume (a damaged or hostile record: data_device is
// taken from the record unchecked). Its unstage detaches "the data
// mapping" with dropDataMapping, which counts any device that is not an
// unbound loop device as bound, clears its read-only flag and detaches
// it: here another disk of the node, which the uevent watcher set
// read-only because another node holds it (P2), is made writable again
// and (being a loop device here) detached. A record must never make the
// agent write to a device it does not name as the volume's own; the
// unstage must refuse the record, or leave the other disk as it is.
func TestAdv4HostileRecordDataDeviceClearsAnotherDisksReadOnlyFlag(t *testing.T) {
	e := newEnv(t)
	_, other := loop(t, 8)
	t.Cleanup(func() { clearRO(other) })
	if out, err := exec.Command("blockdev", "--setro", other).CombinedOutput(); err != nil {
		t.Fatalf("blockdev --setro: %v: %s", err, out)
	}
	staging := e.path("plugins/kubernetes.io/csi/" + simDriver + "/" + strings.Repeat("ab", 32) + "/globalmount")
	c := &Claim{Volume: "pvc-hostile", Locator: Locator{Disk: discovery.Locator{Serial: "nowhere"}}, StagingPath: staging, FsType: "ext4",
		Method: fence.MethodNone, State: StateUnfenced, Phase: PhaseStaged, DataDevice: other, DataOffset: 1 << 20}
	if err := e.m.store.Put(c); err != nil {
		t.Fatal(err)
	}
	err := e.m.Unstage(context.Background(), c.Volume, staging)
	t.Logf("NodeUnstage over the record naming %s as its data mapping: %v", other, err)
	out, _ := exec.Command("blockdev", "--getro", other).Output()
	if strings.TrimSpace(string(out)) != "1" {
		t.Errorf("the read-only flag of %s, another disk the record names as the volume's data mapping, was cleared by the unstage (blockdev --getro: %q)", other, strings.TrimSpace(string(out)))
	}
	if all, _ := exec.Command("losetup", "-a").Output(); !strings.Contains(string(all), other+":") {
		t.Errorf("%s, another disk the record names as the volume's data mapping, was detached by the unstage", other)
	}
}
