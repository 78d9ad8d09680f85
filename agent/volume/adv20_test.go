package volume

// Directed reproductions, twentieth adversarial round. They work on the
// host, through the agent's own stage and publish (volume_test.go's env):
// root, losetup, blkid and mkfs (needRoot), skipped cleanly without them;
// every loop device they attach is detached when they end.

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// The loss of a raw block lease volume drains its device stack top first
// (drainData), and the top layer it sets read-only is the pod device its
// record names, opened by that name with no look at what it is now. The
// record keeps naming a pod device that its pod detached: LOOP_CLR_FD on
// its own device asks for no capability, and the kernel unbinds it once
// the kubelet's loop device over it goes at the unpublish; the name
// stays until the next stage or unstage looks (unmapPodRecorded). The
// kernel gives that free number to the next loop device attached on the
// node -- another volume's data mapping or pod device, the kubelet's
// loop device of another raw block volume. When the volume's lease is
// lost then, its loss handler sets that other device read-only (and
// fsyncs it, and waits for its queue), so a hostile pod makes the agent
// act on another volume's loop device (under a filesystem, its writes
// then fail), and the loss is reported as drained (stopped) of a layer
// that is not the volume's. Every other use of the recorded pod device
// (publish, Expand, the unstage's detach) first checks that it is a loop
// device over the volume's data mapping (PodDeviceOver); the drain does
// not.
func TestAdv20LossDrainSetsAnotherLoopDeviceReadOnlyThroughAStalePodDevice(t *testing.T) {
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	_, target := e.stageAndPublishRawBlock(ctx, rawBlockCase{name: "lease", lease: true}, img, dev)
	pod, mapping := stagedPodDevice(t, e, dev, target)
	// The loss sets the disk and the data mapping read-only, a flag a
	// loop device keeps past its detach: not left to the next test.
	t.Cleanup(func() { clearRO(dev); clearRO(mapping) })
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}
	// The pod's LOOP_CLR_FD: with nothing else holding it, the pod
	// device is unbound at once.
	if err := loopdev.Detach(pod); err != nil {
		t.Fatal(err)
	}
	if loopAttr(pod, "backing_file") != "" {
		t.Fatalf("the pod device %s is still bound after its detach", pod)
	}
	// Another program binds that free number: here another volume's
	// image, as losetup binds a named device.
	other := filepath.Join(t.TempDir(), "other.img")
	if err := os.WriteFile(other, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", pod, other).CombinedOutput(); err != nil {
		t.Skipf("could not bind %s to another image: %v: %s", pod, err, out)
	}
	t.Cleanup(func() {
		if loopAttr(pod, "backing_file") == other {
			_ = clearReadOnly(pod)
			_ = loopdev.Detach(pod)
		}
	})
	if ro, err := readOnlyAt(pod); err != nil || ro {
		t.Fatalf("control: %s over %s is read-only (%v) before the loss", pod, other, err)
	}
	c, err := e.m.store.Get("vol-rb")
	if err != nil || c == nil || c.PodDevice != pod || c.DataDevice != mapping {
		t.Fatalf("the claim before the loss: %+v (%v); want pod device %s over %s", c, err, pod, mapping)
	}
	l := e.m.getLive("vol-rb")
	if l == nil {
		t.Fatal("the staged claim has no live entry")
	}
	// The lease is lost (another node took it over): the loss handler's
	// own path, under the volume's lock as recordLoss takes it.
	release, err := e.m.locks.try("vol-rb", "test: recording a lost claim")
	if err != nil {
		t.Fatal(err)
	}
	e.m.lose(c, l.dev, &fence.LostError{Device: dev, Reason: "test: the lease was taken over"})
	release()
	if got := loopAttr(pod, "backing_file"); got != other {
		t.Fatalf("%s is over %q after the loss, not %s", pod, got, other)
	}
	ro, err := readOnlyAt(pod)
	if err != nil {
		t.Fatal(err)
	}
	if ro {
		t.Fatalf("the loss of vol-rb set %s read-only: its record names it as the pod device, but it is a loop device over %s, not over the data mapping %s (the pod detached its device and the number went to another); the agent acted on another volume's loop device",
			pod, other, mapping)
	}
}

// readOnlyAt reads the block layer's read-only flag of the device at p.
func readOnlyAt(p string) (bool, error) {
	f, err := os.Open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	return readOnly(f)
}

// The stage of an encrypted lease volume fails at its mount; its
// rollback cannot close the dm-crypt mapping, so the release guard keeps
// the fence and the claim goes live with the stage's lease fencer (its
// engine renews the lease), and the records that would say so cannot be
// written: the record still says claiming. The claim check takes back a
// claim recorded claiming while no stage runs (cutShort, then
// reconcileInterrupted): it closes the mapping, proves nothing in use,
// releases the fence through a fencer it chooses anew, and records the
// stage interrupted with no fence -- and leaves the live entry the stage
// made, with the stage's fencer, in place. That engine goes on renewing:
// its next renewal finds its slot released by the other engine
// (verifyOwn), calls it a loss, and its loss handler sets the disk
// read-only, stops the staging path's filesystem and records the claim
// lost; the kubelet's retried stage is then refused until the controller
// grants a takeover of a disk nobody else holds. Until then the manager
// holds a live fence for a claim recorded interrupted with none (a claim
// record never says less than what is on the node). Reached with two
// writes of the claim store failing (the sim's fsync fault), after the
// reservation variant of adv19store_test.go.
func TestAdv20StoreKeptStageTakenBackByTheCheckLeavesItsLiveFencer(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0", encrypted: true}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		mountFailsArming(r, h, map[string]int{"dm-crypt close": 1, "fsync claim record": 3})
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s, its mount, its dm-crypt close and its last record failing: %s", a.id, errText(err))
		c, _ := r.m.store.Get(a.id)
		l := r.m.getLive(a.id)
		if c == nil || c.Phase != PhaseClaiming || l == nil || l.fencer == nil {
			t.Skipf("the failed stage did not leave a claiming record with a live fencer (record %s, live %v): the case is not reached", phaseOf(c), l != nil)
		}
		r.m.CheckAll(ctx)
		c, gerr := r.m.store.Get(a.id)
		r.logBreak("claim check: the record of %s is %s (%v)", a.id, phaseOf(c), gerr)
		r.w.mu.Lock()
		holder := r.w.disks[a.serial].holder
		r.w.mu.Unlock()
		l = r.m.getLive(a.id)
		if c != nil && c.Phase != PhaseStaged && c.State != StateHeld && holder != "us" && l != nil && l.fencer != nil {
			t.Errorf("the claim check took %s back (record %s, state %q, its fence released: holder %q), and its live entry still holds the failed stage's fencer: a lease engine renewing a fence no record names",
				a.id, c.Phase, c.State, holder)
		}
		uerr := r.m.Unstage(ctx, a.id, a.staging)
		c, _ = r.m.store.Get(a.id)
		r.logBreak("NodeUnstage %s: %s; its record %s", a.id, errText(uerr), phaseOf(c))
		if l := r.m.getLive(a.id); uerr == nil && (c == nil || c.State != StateHeld) && l != nil && l.fencer != nil {
			t.Errorf("%s unstaged (its record %s), and the manager still holds the failed stage's live fencer for it", a.id, phaseOf(c))
		}
	})
}
