package volume

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// TestAStopCountsOnlyOnceDrained: a lost claim's I/O counts as stopped,
// which lets the lease slot tell the taker so, only when every layer
// below the pod was drained (drainData). A data mapping that cannot be
// opened to drain leaves the stop not done, the disk read-only all the
// same, and the loss recorded with IONotStopped for stopAgain; with the
// mapping there, the stop is done and the mapping, the top layer, is
// read-only too.
func TestAStopCountsOnlyOnceDrained(t *testing.T) {
	e := newEnv(t)
	_, disk := loop(t, 16)
	// The data mapping: a loop device over the disk past the lease area
	// (the drain leaves alone a recorded name that maps something else).
	mapping, err := loopdev.Attach(disk, 1<<20, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { clearRO(mapping); _ = loopdev.Detach(mapping) })
	f, err := os.Open(disk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); clearRO(disk); clearRO(mapping) })
	dev := &Device{Path: disk, Name: filepath.Base(disk), File: f}
	gone := filepath.Join(t.TempDir(), "loop-gone")
	c := &Claim{Volume: "vol-d", Block: true, Phase: PhaseStaged, State: StateHeld, Device: disk, DataDevice: gone}

	if e.m.stopIO(c, dev) {
		t.Fatal("the stop counted as done with a data mapping that could not be drained")
	}
	if !deviceReadOnly(t, disk) {
		t.Fatal("the disk is writable after a stop whose drain failed")
	}

	clearRO(disk)
	c.DataDevice = mapping
	if !e.m.stopIO(c, dev) {
		t.Fatal("the stop did not count as done with every layer drained")
	}
	if !deviceReadOnly(t, disk) || !deviceReadOnly(t, mapping) {
		t.Fatal("the disk or its data mapping is writable after the stop")
	}

	clearRO(disk)
	clearRO(mapping)
	c.DataDevice = gone
	if err := e.m.Store().Put(c); err != nil {
		t.Fatal(err)
	}
	lost := &fence.LostError{Device: disk, Reason: "lease taken by key " + keyB.String(), Holder: keyB, HolderNode: "node-b"}
	if e.m.lose(c, dev, lost) {
		t.Fatal("lose reported the I/O stopped with a layer not drained")
	}
	got, err := e.m.Store().Get("vol-d")
	if err != nil || got == nil || got.State != StateLost || !got.IONotStopped {
		t.Fatalf("the loss of a claim whose stop failed is recorded as %+v (%v)", got, err)
	}
}

// TestAClaimWhoseDiskLostItsFencingIsStoppedAtStart: a restarted agent
// whose lease claim's disk no longer offers the lease (its header
// overwritten while the agent was down) stops the volume's I/O. When that
// stop fails (another filesystem mounted over the staging path) the claim
// is recorded lost with its I/O not stopped and stays listed for the host
// watchdog, unfed; once a check's stop succeeds it is not.
func TestAClaimWhoseDiskLostItsFencingIsStoppedAtStart(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, devA := loop(t, 64)
	t.Cleanup(func() { clearRO(devA) })
	req := a.stageReq("vol-f", img, "f")
	req.AllowUnfenced = false
	if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage: %+v %v", res, err)
	}
	// The stop sets the data mapping read-only, a flag a loop device
	// keeps for its next user.
	if c, _ := a.m.Store().Get("vol-f"); c != nil && c.DataDevice != "" {
		t.Cleanup(func() { clearRO(c.DataDevice) })
	}
	a.start() // the agent stops; the lease header is overwritten meanwhile
	overwriteStart(t, devA)
	if err := unix.Mount("tmpfs", req.StagingPath, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(req.StagingPath, unix.MNT_DETACH) })

	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	a.lostWithItsStopFailed(devA, "vol-f")

	if err := unix.Unmount(req.StagingPath, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 0 {
		t.Fatalf("the check's stop succeeded, yet: leases %+v", ls)
	}
	if c, _ := a.m.Store().Get("vol-f"); c == nil || c.State != StateLost || c.IONotStopped {
		t.Fatalf("claim after the stop succeeded: %+v", c)
	}
}

// overwriteStart writes something that is not a lease header at the
// start of dev.
func overwriteStart(t *testing.T, dev string) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_WRONLY|os.O_SYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("not a lease header any more"), 0); err != nil {
		t.Fatal(err)
	}
}

// lostWithItsStopFailed: volume's claim is recorded lost because its disk
// no longer offers its fencing, with its I/O not stopped; it is listed for
// the host watchdog as running and not fenced; its disk is read-only.
func (e *env) lostWithItsStopFailed(dev, volume string) {
	t := e.t
	t.Helper()
	c, _ := e.m.Store().Get(volume)
	if c == nil || c.State != StateLost || !c.IONotStopped || !strings.Contains(c.Detail, "no longer offers the fencing") {
		t.Fatalf("a claim whose disk lost its lease, the stop failing: %+v", c)
	}
	if ls := e.m.Leases(); len(ls) != 1 || ls[0].Volume != volume || !ls[0].Running || ls[0].Fenced {
		t.Fatalf("a loss whose stop failed is not listed as running: leases %+v", ls)
	}
	if !deviceReadOnly(t, dev) {
		t.Fatal("the disk is writable after the loss")
	}
}
