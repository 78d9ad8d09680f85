package watchdog

// Review tests for e2539af. Each states the property the host watchdog
// should have and fails on the code as it is, showing a hole; the comment
// above each gives the schedule. Nothing here opens a real device.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// failSet is a device whose WDIOC_SETTIMEOUT fails (EINVAL: the new
// W/2 is outside the driver's range, or an IPMI/BMC-backed driver's
// transient EIO). The kernel does not ping on a failed SETTIMEOUT, so the
// countdown the earlier process left is still running when it fails.
type failSet struct{ *fakeDevice }

func (d *failSet) SetTimeout(time.Duration) (time.Duration, error) {
	return 0, errors.New("setting its timeout to 15 s: invalid argument")
}

// Schedule (W = 30 s, device 15 s): t=0 agent A, holding vol, is
// restarted (its close pings the device: it now resets at t=15). t=3 B
// starts, notes the device left counting down. t=8 B resumes vol (fresh).
// t=9 B's tick takes the device over: open, SETTIMEOUT fails. release()
// writes the magic 'V' and closes: the countdown A left is STOPPED. B keeps
// renewing vol with no device armed (every later arm fails the same way,
// each tick only counts a miss). t=100 B hangs (or is SIGSTOPped): nothing
// resets the host, renewals stop, a taker holds vol at about 100+56 s and
// writes while this host's filesystem still writes: two writers.
func TestReviewFailedTakeOverMustNotStopTheCountdownALeaseNeeds(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second, Linger: time.Hour})
	r.info.Active = true
	r.w.cfg.Active = func(string) (Info, bool) { return r.info, true }
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		d := &fakeDevice{maxT: r.maxT}
		r.opened = append(r.opened, d)
		return &failSet{d}, in, nil
	}
	r.w.Adopt()
	r.set(fresh("vol")) // resumed and renewing: a feed is allowed
	r.w.Tick()
	d := r.dev()
	if d.disarmed {
		t.Errorf("a failed take-over wrote the magic close on a device an earlier process left counting down for a lease that is still held (vol): the host now holds vol with no watchdog running; status %+v", r.w.Status())
	}
}

// Schedule: a nowayout device that takes a longer timeout than W/2 (a
// driver that rounds up, or whose min_timeout is above W/2 so SETTIMEOUT
// fails and it keeps its own). Stage 1's Ready: arm fails (got 30 s > 15
// s), release() keeps the nowayout device as w.dev with w.timeout = 15 s.
// Stage 1 fails FAILED_PRECONDITION; kubelet retries NodeStage: Ready sees
// w.dev != nil and returns nil, the lease is taken, and the host resets
// only 30 s (60 s with the close ping of a killed agent) after the last
// feed, against a taker bound of F + W + 3d = 56 s: two writers.
func TestReviewNowayoutDeviceRefusedOnceIsRefusedOnRetry(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.info.Nowayout = true
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		d := &fakeDevice{maxT: r.maxT}
		r.opened = append(r.opened, d)
		return &roundUp{d}, in, nil // takes 15 s + 15 s = 30 s
	}
	if err := r.w.Ready(context.Background()); err == nil {
		t.Fatal("first Ready accepted a device that takes 30 s for W/2 = 15 s")
	}
	if err := r.w.Ready(context.Background()); err == nil {
		t.Errorf("the retried stage's Ready passed on the same device (timeout 30 s > W/2): a lease is taken on it; status says timeout %s", r.w.Status().Timeout)
	}
}

// Schedule: the host's systemd holds the watchdog Find picks
// (RuntimeWatchdogSec=, or wdmd/watchdog(8)): sysfs says active, and
// opening it gives EBUSY, so every stage used to fail. With one lease
// withheld (vol-a not resumed after a restart, or its disk unreadable),
// Ready of vol-b finds the device active and the leases not allowing a
// feed: errCountingDown, Ready returns nil without opening anything. vol-b
// is taken and mounted; PID 1 keeps the device fed for ever, so when the
// agent hangs vol-b's host is never reset: two writers after the taker's
// bound.
func TestReviewReadyDoesNotPassOnADeviceItNeverHeld(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.info.Active = true // counting down, fed by another program
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		return nil, in, unix.EBUSY
	}
	// Adopt would set left as well (it cannot tell who holds the device);
	// here it is not even called: Ready relies on sysfs "active" alone.
	r.set(Lease{Volume: "vol-a", Unresumed: true})
	if err := r.w.Ready(context.Background()); err == nil {
		t.Errorf("Ready for vol-b passed on a device this agent never opened (another program holds it): vol-b would be taken with no watchdog of the agent's; status %+v", r.w.Status())
	}
}

// Schedule: a kernel built without CONFIG_WATCHDOG_SYSFS (its default is
// n) has /sys/class/watchdog/watchdogN without state, identity or nowayout.
// FindActive then says "not active" for a device the earlier process left
// counting down, Adopt notes nothing, and the first tick opens it, sets its
// timeout (a ping) and feeds it while vol is not resumed: the countdown is
// restarted at a moment no feed is allowed, as before e2539af, and a crash
// loop of agents that never resume vol keeps the host alive (each start
// pings via SETTIMEOUT, each death via the close).
func TestReviewUnknownDeviceStateIsNotTakenForStopped(t *testing.T) {
	sys, dev := t.TempDir(), t.TempDir()
	d0 := filepath.Join(sys, "class/watchdog/watchdog0")
	if err := os.MkdirAll(d0, 0o755); err != nil {
		t.Fatal(err)
	}
	// Only what the class device has without CONFIG_WATCHDOG_SYSFS.
	if err := os.WriteFile(filepath.Join(d0, "dev"), []byte("250:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.w.cfg.Find = func(want string) (Info, error) { return Find(sys, dev, want) }
	r.w.cfg.Active = func(want string) (Info, bool) { return FindActive(sys, dev, want) }
	base := r.w.cfg.Open
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		d, in, err := base(in)
		in.MagicClose = true // from WDIOC_GETSUPPORT, as the kernel's Open fills it
		return d, in, err
	}
	r.w.Adopt()
	r.set(Lease{Volume: "vol", Unresumed: true})
	r.w.Tick()
	if len(r.opened) != 0 {
		t.Errorf("a device whose state sysfs does not show was opened and its timeout set (a ping) while vol is not resumed: feeds=%d timeout=%s", r.dev().count(), r.dev().timeout)
	}
}
