package watchdog

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// failSet is a device whose WDIOC_SETTIMEOUT fails (the timeout is out of
// the driver's range, or a transient error). The kernel does not ping a
// device whose SETTIMEOUT fails, so a countdown left running is still the
// one it was.
type failSet struct{ *fakeDevice }

func (d *failSet) SetTimeout(time.Duration) (time.Duration, error) {
	return 0, errors.New("setting its timeout to 15 s: invalid argument")
}

// A take-over that fails must not stop a countdown an earlier process
// left: the leases this process resumed are guarded by it. Stopping it
// (the magic close) would leave the host holding them with no watchdog at
// all, and a later hang of the agent would never reset it.
func TestAFailedTakeOverLeavesTheCountdownRunning(t *testing.T) {
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
	if d.disarmed || !d.closed {
		t.Fatalf("a failed take-over: disarmed %v (must not be), closed %v (must be); status %+v", d.disarmed, d.closed, r.w.Status())
	}
	if err := r.w.Ready(context.Background()); err == nil {
		t.Fatal("a new lease was allowed on a device the agent could not take over")
	}
	// It is tried again at the next tick.
	r.w.Tick()
	if len(r.opened) != 3 { // the tick, Ready, the tick
		t.Fatalf("the take-over was not retried: %d opens", len(r.opened))
	}
}

// A nowayout device that cannot reset the host within W/2 is refused for
// the first lease, kept (it cannot be stopped) and fed, and refused again
// for every retried stage.
func TestAnUnfitNowayoutDeviceIsRefusedOnEveryRetry(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.info.Nowayout = true
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		d := &fakeDevice{maxT: r.maxT}
		r.opened = append(r.opened, d)
		return &roundUp{d}, in, nil // takes 15 s + 15 s = 30 s
	}
	for try := range 3 {
		if err := r.w.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "30s") {
			t.Fatalf("Ready, try %d, with a device that takes 30 s for W/2 = 15 s: %v", try, err)
		}
	}
	if st := r.w.Status(); !st.Armed || st.Timeout != 30*time.Second {
		t.Fatalf("the kept device's status: %+v (its timeout is 30 s)", st)
	}
	n := r.dev().count()
	r.w.Tick()
	if r.dev().count() != n+1 {
		t.Fatal("a nowayout device the agent cannot stop is not fed")
	}
}

// A device another program holds (systemd's RuntimeWatchdogSec=, a
// watchdog daemon) is counting down and cannot be opened: while a lease
// stops the feeding, Ready must not take that for a device of the
// agent's.
func TestReadyRefusesADeviceCountingDownThatItDidNotTakeOver(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.info.Active = true
	r.w.cfg.Open = func(in Info) (Device, Info, error) { return nil, in, unix.EBUSY }
	r.set(Lease{Volume: "vol-a", Unresumed: true})
	if err := r.w.Ready(context.Background()); err == nil {
		t.Fatalf("Ready passed on a device this agent never opened: %+v", r.w.Status())
	}
	// With every lease fresh it is opened, and the program holding it
	// is named.
	r.set(fresh("vol-a"))
	if err := r.w.Ready(context.Background()); err == nil || !errors.Is(err, unix.EBUSY) {
		t.Fatalf("Ready on a device another program holds: %v", err)
	}
}

// A kernel without CONFIG_WATCHDOG_SYSFS does not say whether a device is
// counting down: it is treated as if it were, so a lease not resumed yet
// does not get it opened and its timeout set (a ping).
func TestADeviceOfUnknownStateIsTreatedAsCountingDown(t *testing.T) {
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
		in.MagicClose = true // WDIOC_GETSUPPORT says so on the kernel's Open
		return d, in, err
	}
	r.w.Adopt()
	r.set(Lease{Volume: "vol", Unresumed: true})
	r.w.Tick()
	if len(r.opened) != 0 {
		t.Fatalf("a device of unknown state was opened and its timeout set while vol is not resumed: timeout %s", r.dev().timeout)
	}
	r.set(fresh("vol"))
	r.w.Tick()
	if d := r.dev(); d.timeout != 15*time.Second || d.count() != 1 {
		t.Fatalf("not taken over once a feed was allowed: timeout %s, feeds %d", d.timeout, d.count())
	}
}

// Adopt notes a device of unknown state as left counting down, so that
// with no lease held it is taken over and stopped rather than left to
// reset the host.
func TestADeviceOfUnknownStateIsAdopted(t *testing.T) {
	sys := t.TempDir()
	d0 := filepath.Join(sys, "class/watchdog/watchdog0")
	if err := os.MkdirAll(d0, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d0, "identity"), []byte("iTCO_wdt\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if in, ok := FindActive(sys, "/dev", Auto); !ok || !in.StateUnknown {
		t.Fatalf("FindActive on a device of unknown state: %+v %v", in, ok)
	}
	r := newRig(t, Config{Timeout: 30 * time.Second, Linger: 0})
	r.info.StateUnknown = true
	r.w.cfg.Active = func(want string) (Info, bool) { return r.info, true }
	r.w.Adopt()
	r.w.Tick()
	if d := r.dev(); !d.disarmed {
		t.Fatal("a device of unknown state, left with no lease held, was not taken over and stopped")
	}
}
