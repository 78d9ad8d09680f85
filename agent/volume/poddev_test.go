package volume

// The pod device of a raw block lease volume on the host (needRoot): what
// the stage makes and records, what the pod is given, what the release
// guard sees while it is attached, and what the unstage leaves.

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// loopAttr reads the sysfs loop attribute attr of the loop device p ("":
// not bound).
func loopAttr(p, attr string) string {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(p), "loop", attr))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// stagedPodDevice checks the pod device of vol-rb, staged and published
// at target as a raw block lease volume on dev: recorded, over the data
// mapping from its byte 0, and the device at the pod's target. It returns
// the pod device and the data mapping, which are detached when the test
// ends while they are still over this test's devices.
func stagedPodDevice(t *testing.T, e *env, dev, target string) (pod, mapping string) {
	t.Helper()
	c, err := e.m.store.Get("vol-rb")
	if err != nil || c == nil || c.DataDevice == "" || c.PodDevice == "" || c.PodDevice == c.DataDevice {
		t.Fatalf("the staged raw block lease volume's claim: %+v (%v); want a data mapping and a pod device, two loop devices", c, err)
	}
	pod, mapping = c.PodDevice, c.DataDevice
	t.Cleanup(func() {
		if loopAttr(pod, "backing_file") == mapping {
			_ = loopdev.Detach(pod)
		}
		if loopAttr(mapping, "backing_file") == dev {
			_ = loopdev.Detach(mapping)
		}
	})
	if got, off := loopAttr(pod, "backing_file"), loopAttr(pod, "offset"); got != mapping || off != "0" {
		t.Fatalf("the pod device %s is over %q from byte %s; want the data mapping %s from byte 0", pod, got, off, mapping)
	}
	var got, want unix.Stat_t
	if err := unix.Stat(target, &got); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(pod, &want); err != nil {
		t.Fatal(err)
	}
	if got.Rdev != want.Rdev {
		t.Fatalf("the pod's target %s is device %d:%d, not the pod device %s (%d:%d)", target, unix.Major(got.Rdev), unix.Minor(got.Rdev), pod, unix.Major(want.Rdev), unix.Minor(want.Rdev))
	}
	return pod, mapping
}

// The stage of a raw block lease volume records a pod device, a loop
// device over the data mapping from its byte 0 (with direct I/O here),
// and the publish binds it, not the data mapping, at the pod's target.
// While it is attached, the data mapping stays bound even when it is
// detached by hand (the kernel unbinds it at the pod device's detach), so
// the release guard's proof fails. The unstage detaches both and releases
// the fence.
func TestRawBlockLeaseVolumeGetsAPodDeviceOverItsDataMapping(t *testing.T) {
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	req, target := e.stageAndPublishRawBlock(ctx, rawBlockCase{name: "lease", lease: true}, img, dev)
	pod, mapping := stagedPodDevice(t, e, dev, target)
	t.Logf("the pod device's direct I/O (sysfs dio): %s", loopAttr(pod, "dio"))
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}

	// The data mapping detached by hand under the pod device: it stays
	// bound, and the release guard's proof fails.
	if err := loopdev.Detach(mapping); err != nil {
		t.Fatal(err)
	}
	if loopAttr(mapping, "backing_file") != dev {
		t.Fatalf("the data mapping %s was unbound while the pod device %s is over it", mapping, pod)
	}
	if err := inuse.Disk("/sys", dev); err == nil {
		t.Fatalf("the release guard's proof passed for %s while the pod device %s is over its data mapping %s", dev, pod, mapping)
	}

	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if b := loopAttr(pod, "backing_file"); b == mapping {
		t.Fatalf("the pod device %s is still over %s after the unstage", pod, b)
	}
	if b := loopAttr(mapping, "backing_file"); b == dev {
		t.Fatalf("the data mapping %s is still over %s after the unstage", mapping, b)
	}
	if c, err := e.m.store.Get("vol-rb"); err != nil || c != nil {
		t.Fatalf("the claim after the unstage: %+v %v; want it forgotten (its fence released)", c, err)
	}
	if err := inuse.Disk("/sys", dev); err != nil {
		t.Fatalf("the release guard's proof after the unstage: %v", err)
	}
}

// A pod device is found through the claim's record only. Another loop
// device over the data mapping from its byte 0 (the kubelet's over a
// published raw block device looks the same in sysfs) is never taken for
// it: a restarted agent's start-up check and a repeated stage keep the
// recorded one, and the unstage detaches only that; the other keeps the
// data mapping bound, so the release guard keeps the fence until it goes.
func TestRawBlockPodDeviceIsFoundThroughTheRecordOnly(t *testing.T) {
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	req, target := e.stageAndPublishRawBlock(ctx, rawBlockCase{name: "lease", lease: true}, img, dev)
	pod, mapping := stagedPodDevice(t, e, dev, target)
	other, err := loopdev.Attach(mapping, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if loopAttr(other, "backing_file") == mapping {
			_ = loopdev.Detach(other)
		}
	})

	e.start() // the agent restarts: its start-up check takes the claim back
	e.m.Reconcile(ctx)
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("the repeated stage after the restart: %v", err)
	}
	if c, err := e.m.store.Get("vol-rb"); err != nil || c == nil || c.PodDevice != pod || c.DataDevice != mapping {
		t.Fatalf("after the restart and a repeated stage the claim names pod device %q over %q (%v); want %s over %s", c.PodDevice, c.DataDevice, err, pod, mapping)
	}
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err == nil {
		t.Fatalf("the unstage released the fence of %s while the loop device %s is over its data mapping %s", dev, other, mapping)
	}
	if loopAttr(pod, "backing_file") == mapping {
		t.Fatalf("the unstage left the recorded pod device %s over %s", pod, mapping)
	}
	if loopAttr(other, "backing_file") != mapping {
		t.Fatalf("the unstage detached %s, a loop device over the data mapping its record does not name", other)
	}
	if err := loopdev.Detach(other); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
		t.Fatalf("the unstage once the other loop device is gone: %v", err)
	}
	if b := loopAttr(mapping, "backing_file"); b == dev {
		t.Fatalf("the data mapping %s is still over %s after the unstage", mapping, b)
	}
}

// A staged raw block lease volume whose pod device was detached (by
// hand, or by its pod: LOOP_CLR_FD asks for no capability) is not
// published as it is; the repeated stage makes a pod device again over
// the data mapping, recorded, and the publish then binds it.
func TestRawBlockPodDeviceDetachedIsMadeAgainByTheStage(t *testing.T) {
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	req, target := e.stageAndPublishRawBlock(ctx, rawBlockCase{name: "lease", lease: true}, img, dev)
	pod, mapping := stagedPodDevice(t, e, dev, target)
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}
	if err := loopdev.Detach(pod); err != nil {
		t.Fatal(err)
	}
	err := e.m.Publish(ctx, PublishRequest{Volume: "vol-rb", StagingPath: req.StagingPath, TargetPath: target, Block: true})
	if err == nil {
		t.Fatalf("a publish with the pod device %s detached succeeded", pod)
	}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("the repeated stage: %v", err)
	}
	c, err := e.m.store.Get("vol-rb")
	if err != nil || c == nil || c.PodDevice == "" || loopAttr(c.PodDevice, "backing_file") != mapping {
		t.Fatalf("after the repeated stage the claim names pod device %q (%v), over %q; want one over the data mapping %s", c.PodDevice, err, loopAttr(c.PodDevice, "backing_file"), mapping)
	}
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-rb", StagingPath: req.StagingPath, TargetPath: target, Block: true}); err != nil {
		t.Fatal(err)
	}
	stagedPodDevice(t, e, dev, target)
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}
