package volume

import (
	"context"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// A node with a staged lease volume reboots and stays down longer than the
// lease's fail bound. The first agent process after the boot finds its
// record too old to resume; nothing of the volume is in use (the boot took
// the mount and the data mapping), so it acquires the lease anew rather
// than record a loss that only the controller's grant would lift: the
// claim is held, DiskClaimed says lease-retaken, and the kubelet's stage
// after the boot repairs the volume. An agent stopped past F while the
// host ran, its volume still mounted, keeps the loss (with or without a
// boot id that says otherwise); one whose volume nothing uses any more
// (the mount and mapping gone meanwhile) takes the lease back too.
func TestLeasePastTheFailBoundIsRetakenWhenNothingUsesIt(t *testing.T) {
	for _, tc := range []struct {
		name     string
		boot     string // the boot id of the process after the down time
		reboot   bool   // the mount and the data mapping went
		retaken  bool
		wantLost string
	}{
		{"after a boot, nothing in use: retaken", "boot-2", true, true, ""},
		{"the same boot (the agent stopped past F), still mounted: lost", "boot-1", false, false, "beyond the fail bound"},
		{"after a boot, the volume still mounted: lost", "boot-2", false, false, "beyond the fail bound"},
		{"the same boot, nothing in use any more: retaken", "boot-1", true, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			a := fencedLeaseEnv(t, nodeA, "node-a")
			a.m.bootID = func() (string, error) { return "boot-1", nil }
			a.m.ExpectRecordedLeases()
			req := stagedLease(t, a, "vol-r", "r")
			c, err := a.m.store.Get("vol-r")
			if err != nil || c == nil || c.DataDevice == "" {
				t.Fatalf("the staged claim: %+v %v", c, err)
			}
			a.m.Close()
			if tc.reboot {
				if err := unix.Unmount(req.StagingPath, 0); err != nil {
					t.Fatal(err)
				}
				if err := loopdev.Detach(c.DataDevice); err != nil {
					t.Fatal(err)
				}
			}
			time.Sleep(testTiming.Fail + testTiming.Renew)
			a.start()
			a.m.bootID = func() (string, error) { return tc.boot, nil }
			a.m.ExpectRecordedLeases()
			a.m.Reconcile(ctx)
			now, err := a.m.store.Get("vol-r")
			if err != nil || now == nil {
				t.Fatalf("the claim after the start-up check: %+v %v", now, err)
			}
			if !tc.retaken {
				lostPastF(t, now, tc.wantLost)
				return
			}
			a.retakenAndRepaired(ctx, now, req)
		})
	}
}

// lostPastF: the claim was recorded lost past the fail bound.
func lostPastF(t *testing.T, c *Claim, want string) {
	t.Helper()
	if c.State != StateLost || !strings.Contains(c.Detail, want) {
		t.Fatalf("the claim after the start-up check: state %s (%s), want lost %q", c.State, c.Detail, want)
	}
}

// retakenAndRepaired: the claim c is held again, DiskClaimed said
// lease-retaken, the lease is renewed, and the kubelet's stage repairs
// the volume, which then unstages.
func (e *env) retakenAndRepaired(ctx context.Context, c *Claim, req StageRequest) {
	t := e.t
	t.Helper()
	if c.State != StateHeld {
		t.Fatalf("the claim after the start-up check: state %s (%s), want held", c.State, c.Detail)
	}
	ev := e.event(events.DiskClaimed)
	if ev.Reason == "staged" { // the stage before the down time's
		ev = e.event(events.DiskClaimed)
	}
	if ev.Reason != "lease-retaken" || ev.Volume != c.Volume || !strings.Contains(ev.Message, "fail bound") {
		t.Fatalf("event %+v, want DiskClaimed lease-retaken for %s", ev, c.Volume)
	}
	if ls := e.m.Leases(); len(ls) != 1 || ls[0].Unresumed || ls[0].Fenced {
		t.Fatalf("leases after the retake: %+v, want one held and renewed", ls)
	}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("the kubelet's stage after the retake: %v", err)
	}
	if !isMounted(t, req.StagingPath) {
		t.Fatalf("the staging path %s is not mounted after the stage", req.StagingPath)
	}
	if err := e.m.Unstage(ctx, c.Volume, req.StagingPath); err != nil {
		t.Fatal(err)
	}
}
