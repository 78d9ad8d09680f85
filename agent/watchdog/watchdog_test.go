package watchdog

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeDevice stands in for /dev/watchdogN: this machine's watchdog (the
// team's host) must never be armed by a test. Real devices are armed only
// in QEMU guests (integration/scenarios TestWatchdogResetsAStoppedHolder).
type fakeDevice struct {
	mu       sync.Mutex
	maxT     time.Duration // the longest timeout it takes
	timeout  time.Duration
	feeds    int
	disarmed bool
	closed   bool
	feedErr  error
}

func (d *fakeDevice) SetTimeout(t time.Duration) (time.Duration, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.timeout = min(t, d.maxT)
	return d.timeout, nil
}

func (d *fakeDevice) Feed() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.disarmed || d.closed {
		return errors.New("fed after close")
	}
	if d.feedErr != nil {
		return d.feedErr
	}
	d.feeds++
	return nil
}

func (d *fakeDevice) Disarm() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.disarmed = true
	return nil
}

func (d *fakeDevice) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	return nil
}

func (d *fakeDevice) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.feeds
}

// rig is a Watchdog on fake devices with a settable lease list.
type rig struct {
	t      *testing.T
	w      *Watchdog
	info   Info
	opened []*fakeDevice
	maxT   time.Duration
	mu     sync.Mutex
	leases []Lease
}

func newRig(t *testing.T, cfg Config) *rig {
	r := &rig{t: t, info: Info{Path: "/dev/watchdog0", Identity: "fake", MagicClose: true}, maxT: time.Hour}
	cfg.Leases = func() []Lease {
		r.mu.Lock()
		defer r.mu.Unlock()
		return append([]Lease(nil), r.leases...)
	}
	cfg.Find = func(string) (Info, error) { return r.info, nil }
	cfg.Open = func(in Info) (Device, Info, error) {
		d := &fakeDevice{maxT: r.maxT}
		r.opened = append(r.opened, d)
		return d, in, nil
	}
	if cfg.Device == "" {
		cfg.Device = Auto
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 60 * time.Second
	}
	r.w = New(cfg)
	return r
}

func (r *rig) set(ls ...Lease) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.leases = ls
}

func (r *rig) dev() *fakeDevice {
	r.t.Helper()
	if len(r.opened) == 0 {
		r.t.Fatal("no device was opened")
	}
	return r.opened[len(r.opened)-1]
}

func fresh(vol string) Lease {
	return Lease{Volume: vol, Renewed: time.Now(), Fail: 4 * time.Second, IOTimeout: 500 * time.Millisecond}
}

func TestArmedOnFirstLeaseFedWhileFreshDisarmedOnLastRelease(t *testing.T) {
	r := newRig(t, Config{})
	r.w.Tick()
	if len(r.opened) != 0 || r.w.Status().Armed {
		t.Fatal("armed with no lease held")
	}
	r.set(fresh("vol-a"))
	r.w.Tick()
	d := r.dev()
	// The device gets half of W (60 s): a close without the magic
	// character pings it once more, so two device timeouts fit in W.
	if st := r.w.Status(); !st.Armed || st.Timeout != 30*time.Second || st.Device != "/dev/watchdog0" || st.Leases != 1 {
		t.Fatalf("after the first lease: %+v", st)
	}
	if d.timeout != 30*time.Second {
		t.Fatalf("device timeout %s, want W/2", d.timeout)
	}
	before := d.count()
	for range 3 {
		r.set(fresh("vol-a"), fresh("vol-b"))
		r.w.Tick()
	}
	if d.count() != before+3 {
		t.Fatalf("fresh leases: %d feeds, want %d", d.count(), before+3)
	}
	// The last lease goes: disarmed by the magic close (no linger set).
	r.set()
	r.w.Tick()
	if !d.disarmed || r.w.Status().Armed {
		t.Fatalf("not disarmed after the last lease went: %+v", r.w.Status())
	}
}

func TestFeedingStopsWhenARenewalIsLateAndResumesWhenFenced(t *testing.T) {
	r := newRig(t, Config{})
	stale := fresh("vol-late")
	r.set(fresh("vol-ok"), stale)
	r.w.Tick()
	d := r.dev()
	n := d.count()
	// Its last renewal is F-d old: no more feeds, whatever the process
	// itself is doing.
	stale.Renewed = time.Now().Add(-(stale.Fail - stale.IOTimeout))
	r.set(fresh("vol-ok"), stale)
	for range 3 {
		r.w.Tick()
	}
	if d.count() != n {
		t.Fatalf("fed %d times while a lease's renewal was late", d.count()-n)
	}
	st := r.w.Status()
	if len(st.Withheld) != 1 || !strings.Contains(st.Withheld[0], "vol-late") || st.Misses < 3 {
		t.Fatalf("status while withheld: %+v", st)
	}
	// Just inside F-d it is fed.
	stale.Renewed = time.Now().Add(-(stale.Fail - stale.IOTimeout) + time.Second)
	r.set(stale)
	r.w.Tick()
	if d.count() != n+1 {
		t.Fatal("not fed for a lease renewed within F-d")
	}
	// The lease is lost and its I/O stopped (fenced): it no longer stops
	// the feeding, however old its renewal.
	stale.Renewed = time.Now().Add(-time.Hour)
	stale.Fenced = true
	r.set(fresh("vol-ok"), stale)
	r.w.Tick()
	if d.count() != n+2 || len(r.w.Status().Withheld) != 0 {
		t.Fatalf("a fenced lease stopped the feeding: %+v", r.w.Status())
	}
	if d.disarmed {
		t.Fatal("disarmed while leases are listed")
	}
}

// A lease held before an agent restart that the new process could not
// resume yet has no renewal to count from: it stops the feeding, armed,
// until it is resumed (then it is an ordinary held lease).
func TestAnUnresumedLeaseStopsTheFeedingUntilResumed(t *testing.T) {
	r := newRig(t, Config{})
	r.set(fresh("vol-ok"))
	r.w.Tick()
	d := r.dev()
	n := d.count()
	r.set(fresh("vol-ok"), Lease{Volume: "vol-restarted", Unresumed: true})
	for range 3 {
		r.w.Tick()
	}
	if d.count() != n {
		t.Fatalf("fed %d times while a lease was not resumed", d.count()-n)
	}
	st := r.w.Status()
	if !st.Armed || d.disarmed || len(st.Withheld) != 1 || !strings.Contains(st.Withheld[0], "vol-restarted") || !strings.Contains(st.Withheld[0], "not resumed") {
		t.Fatalf("status while an unresumed lease withholds the feeding: %+v", st)
	}
	r.set(fresh("vol-ok"), fresh("vol-restarted"))
	r.w.Tick()
	if d.count() != n+1 || len(r.w.Status().Withheld) != 0 {
		t.Fatalf("not fed once the lease was resumed: %+v", r.w.Status())
	}
}

func TestRunFeedsOnlyOnAFreshLook(t *testing.T) {
	// Run's goroutine asks for the leases before each feed: once they go
	// stale it stops feeding although it keeps running.
	r := newRig(t, Config{Timeout: 2 * time.Second})
	r.maxT = time.Second
	l := fresh("vol")
	l.Fail, l.IOTimeout = 3*time.Second, 500*time.Millisecond
	r.set(l)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	// A tick is 250 ms; the lease is stale 2.5 s after its renewal.
	time.Sleep(time.Until(l.feedDeadline()) + time.Second)
	st := r.w.Status()
	if !st.Armed || st.Feeds < 3 {
		t.Fatalf("not armed and fed while the lease was fresh: %+v", st)
	}
	if !st.LastFeed.Before(l.feedDeadline()) || len(st.Withheld) != 1 || st.Misses < 2 {
		t.Fatalf("fed %s after the renewal, past F-d (%s): %+v", st.LastFeed.Sub(l.Renewed), l.Fail-l.IOTimeout, st)
	}
}

func TestDeviceThatCannotResetWithinWIsRefused(t *testing.T) {
	r := newRig(t, Config{Timeout: 30 * time.Second})
	r.maxT = time.Hour
	r.info.Identity = "slowdog"
	// A device that rounds the timeout up past W.
	r.w.cfg.Open = func(in Info) (Device, Info, error) {
		d := &fakeDevice{maxT: time.Hour}
		r.opened = append(r.opened, d)
		return &roundUp{d}, in, nil
	}
	err := r.w.Ready(context.Background())
	if err == nil || !strings.Contains(err.Error(), "30s") || !strings.Contains(err.Error(), "W=30s") || !strings.Contains(err.Error(), "slowdog") {
		t.Fatalf("Ready with a device that resets after 30s, W=30s (more than W/2): %v", err)
	}
	if !r.dev().disarmed || r.w.Status().Armed || r.w.Status().Error == "" {
		t.Fatalf("the refused device is not stopped, or the status hides it: %+v", r.w.Status())
	}
}

type roundUp struct{ *fakeDevice }

func (d *roundUp) SetTimeout(t time.Duration) (time.Duration, error) {
	d.fakeDevice.SetTimeout(t)
	return t + 15*time.Second, nil
}

func TestDeviceWithoutMagicCloseIsRefused(t *testing.T) {
	r := newRig(t, Config{})
	r.info.MagicClose = false
	r.set(fresh("vol"))
	err := r.w.Ready(context.Background())
	if err == nil || !strings.Contains(err.Error(), "magic close") {
		t.Fatalf("Ready: %v", err)
	}
	if r.w.Status().Armed || !r.dev().closed {
		t.Fatal("a device that stops on close is kept")
	}
}

func TestStopLeavesTheDeviceArmedWhileALeaseIsHeld(t *testing.T) {
	r := newRig(t, Config{})
	r.set(fresh("vol"))
	r.w.Tick()
	d := r.dev()
	r.w.Stop()
	if d.disarmed || !d.closed {
		t.Fatalf("agent stop with a lease held: disarmed=%v closed=%v; want closed without the magic close", d.disarmed, d.closed)
	}

	// A fenced lease needs no reset: stop disarms.
	r2 := newRig(t, Config{})
	l := fresh("vol")
	r2.set(l)
	r2.w.Tick()
	l.Fenced = true
	r2.set(l)
	r2.w.Stop()
	if !r2.dev().disarmed {
		t.Fatal("agent stop with only a fenced lease did not disarm")
	}
}

func TestNowayoutDeviceIsFedWhileTheAgentRuns(t *testing.T) {
	r := newRig(t, Config{})
	r.info.Nowayout = true
	r.set(fresh("vol"))
	r.w.Tick()
	d := r.dev()
	r.set()
	n := d.count()
	r.w.Tick()
	r.w.Tick()
	if d.disarmed || d.count() != n+2 || !r.w.Status().Armed || !r.w.Status().Nowayout {
		t.Fatalf("nowayout device without leases: disarmed=%v feeds=%d status %+v", d.disarmed, d.count()-n, r.w.Status())
	}
	r.w.Stop()
	if d.disarmed || !d.closed {
		t.Fatal("a nowayout device was given the magic close")
	}
}

func TestLingerKeepsAnAcquisitionArmed(t *testing.T) {
	r := newRig(t, Config{Linger: time.Hour})
	if err := r.w.Ready(context.Background()); err != nil {
		t.Fatal(err)
	}
	d := r.dev()
	r.w.Tick() // no lease yet: the stage is still acquiring
	if d.disarmed || d.count() != 2 {
		t.Fatalf("disarmed or unfed during an acquisition: disarmed=%v feeds=%d", d.disarmed, d.count())
	}
}

func TestUnsafeNeverOpensADevice(t *testing.T) {
	r := newRig(t, Config{Device: Unsafe})
	r.set(fresh("vol"))
	if err := r.w.Ready(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.w.Tick()
	r.w.Stop()
	if len(r.opened) != 0 {
		t.Fatal("the unsafe setting opened a device")
	}
	if st := r.w.Status(); !st.Unsafe || st.Armed || st.Leases != 1 {
		t.Fatalf("status: %+v", st)
	}
}

func TestWIsWholeSeconds(t *testing.T) {
	r := newRig(t, Config{Timeout: 500 * time.Millisecond})
	if err := r.w.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "whole seconds") {
		t.Fatalf("W=500ms: %v", err)
	}
}

// sysfsTree writes a watchdog class with the given devices.
func sysfsTree(t *testing.T, devs map[string][2]string) string {
	root := t.TempDir()
	for name, attrs := range devs {
		d := filepath.Join(root, "class/watchdog", name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, "identity"), []byte(attrs[0]+"\n"), 0o644)
		os.WriteFile(filepath.Join(d, "nowayout"), []byte(attrs[1]+"\n"), 0o644)
		os.WriteFile(filepath.Join(d, "state"), []byte("inactive\n"), 0o644)
	}
	return root
}

func noModprobe(t *testing.T, f func(context.Context) ([]byte, error)) {
	old := loadSoftdog
	loadSoftdog = f
	t.Cleanup(func() { loadSoftdog = old })
}

func TestFindPrefersHardwareAndChecksSoftdog(t *testing.T) {
	noModprobe(t, func(context.Context) ([]byte, error) {
		t.Fatal("modprobe run with devices present")
		return nil, nil
	})
	root := sysfsTree(t, map[string][2]string{"watchdog0": {softIdentity, "0"}, "watchdog1": {"i6300ESB timer", "1"}})
	in, err := Find(root, "/dev", Auto)
	if err != nil || in.Path != "/dev/watchdog1" || in.Soft || !in.Nowayout {
		t.Fatalf("auto: %+v %v", in, err)
	}
	// The legacy node is watchdog0's alias.
	if in, err := Find(root, "/dev", "/dev/watchdog"); err != nil || in.Path != "/dev/watchdog0" || !in.Soft {
		t.Fatalf("/dev/watchdog: %+v %v", in, err)
	}
	if _, err := Find(root, "/dev", "/dev/watchdog7"); err == nil || !strings.Contains(err.Error(), "/dev/watchdog0, /dev/watchdog1") {
		t.Fatalf("a device the host lacks: %v", err)
	}
	// softdog that only logs is refused.
	os.MkdirAll(filepath.Join(root, "module/softdog/parameters"), 0o755)
	os.WriteFile(filepath.Join(root, "module/softdog/parameters/soft_noboot"), []byte("1\n"), 0o644)
	if _, err := Find(root, "/dev", "/dev/watchdog0"); err == nil || !strings.Contains(err.Error(), "soft_noboot=1") {
		t.Fatalf("softdog with soft_noboot=1: %v", err)
	}
}

func TestFindLoadsSoftdogWhenNoDeviceExists(t *testing.T) {
	root := t.TempDir()
	loaded := false
	noModprobe(t, func(context.Context) ([]byte, error) {
		loaded = true
		d := filepath.Join(root, "class/watchdog/watchdog0")
		os.MkdirAll(d, 0o755)
		return nil, os.WriteFile(filepath.Join(d, "identity"), []byte(softIdentity+"\n"), 0o644)
	})
	in, err := Find(root, "/dev", Auto)
	if err != nil || !loaded || in.Path != "/dev/watchdog0" || !in.Soft {
		t.Fatalf("no device: loaded=%v %+v %v", loaded, in, err)
	}
	noModprobe(t, func(context.Context) ([]byte, error) {
		return []byte("modprobe: FATAL: Module softdog not found"), errors.New("exit status 1")
	})
	if _, err := Find(t.TempDir(), "/dev", Auto); !errors.Is(err, ErrNone) || !strings.Contains(err.Error(), "Module softdog not found") {
		t.Fatalf("modprobe fails: %v", err)
	}
}

// An agent that died while the device was armed left it counting down.
// The next agent must not restart that countdown (opening the device and
// setting its timeout both do) while a lease it has not resumed yet stops
// the feeding: if it then hangs or dies too, the host would live past
// the taker's bound. It takes the device over at the first tick whose
// leases allow a feed, and stops it once none is held.
func TestAdoptLeavesTheCountdownAloneUntilAFeedIsAllowed(t *testing.T) {
	active := false
	r := newRig(t, Config{Linger: time.Hour})
	r.w.cfg.Active = func(string) (Info, bool) { return r.info, active }
	r.w.Adopt()
	r.set(Lease{Volume: "vol", Unresumed: true})
	r.w.Tick()
	if len(r.opened) != 1 {
		t.Fatal("a lease held and no device counting down: not armed")
	}
	r.opened = nil
	r.w.Stop()

	// The earlier process left it counting down; the recorded lease is not
	// resumed yet.
	r = newRig(t, Config{Linger: time.Hour})
	active, r.info.Active = true, true
	r.w.cfg.Active = func(string) (Info, bool) { return r.info, active }
	r.set(Lease{Volume: "vol", Unresumed: true})
	r.w.Adopt()
	for range 3 {
		r.w.Tick()
		// No new lease either, until the device is taken over.
		if err := r.w.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "not resumed yet") {
			t.Fatalf("Ready with a device left counting down and a lease not resumed: %v", err)
		}
	}
	if len(r.opened) != 0 {
		t.Fatal("a device left counting down was opened (which restarts its countdown) while a lease not resumed stops the feeding")
	}
	st := r.w.Status()
	if st.Feeds != 0 || len(st.Withheld) != 1 || !strings.Contains(st.Error, "earlier agent") {
		t.Fatalf("status while the countdown runs: %+v", st)
	}
	// Resumed and renewing: taken over, its timeout set (W/2) and fed.
	r.set(fresh("vol"))
	r.w.Tick()
	d := r.dev()
	if st := r.w.Status(); !st.Armed || d.timeout != 30*time.Second || d.count() != 1 || st.Error != "" {
		t.Fatalf("not taken over once a feed was allowed: %+v, timeout %s", st, d.timeout)
	}
	r.w.Tick()
	if d.count() != 2 {
		t.Fatal("an adopted device is not fed for a resumed lease")
	}

	// No lease recorded at all: taken over, fed through the linger, then
	// stopped.
	u := newRig(t, Config{Linger: time.Hour})
	u.info.Active = true
	u.w.cfg.Active = func(string) (Info, bool) { return u.info, true }
	u.w.Adopt()
	u.w.Tick()
	d = u.dev()
	if d.disarmed || d.count() != 2 {
		t.Fatalf("within the linger: disarmed=%v feeds=%d", d.disarmed, d.count())
	}
	u.w.cfg.Linger = 0
	u.w.Tick()
	if !d.disarmed || u.w.Status().Armed {
		t.Fatal("an adopted device no lease needs was not stopped")
	}

	// A lease stale since before the restart keeps it untouched too.
	v := newRig(t, Config{Linger: time.Hour})
	v.info.Active = true
	v.w.cfg.Active = func(string) (Info, bool) { return v.info, true }
	stale := fresh("vol")
	stale.Renewed = time.Now().Add(-time.Minute)
	v.set(stale)
	v.w.Adopt()
	v.w.Tick()
	v.w.Stop()
	if len(v.opened) != 0 {
		t.Fatal("a device left counting down was opened for a stale lease")
	}

	// The unsafe setting adopts nothing.
	x := newRig(t, Config{Device: Unsafe})
	x.w.cfg.Active = func(string) (Info, bool) { return x.info, true }
	x.w.Adopt()
	x.w.Tick()
	if len(x.opened) != 0 {
		t.Fatal("the unsafe setting adopted a device")
	}
}

func TestFindActiveReadsTheDeviceState(t *testing.T) {
	noModprobe(t, func(context.Context) ([]byte, error) {
		t.Fatal("FindActive loaded a module")
		return nil, nil
	})
	if _, ok := FindActive(t.TempDir(), "/dev", Auto); ok {
		t.Fatal("an active device on a host without any")
	}
	root := sysfsTree(t, map[string][2]string{"watchdog0": {softIdentity, "0"}, "watchdog1": {"i6300ESB timer", "0"}})
	if _, ok := FindActive(root, "/dev", Auto); ok {
		t.Fatal("inactive devices reported active")
	}
	os.WriteFile(filepath.Join(root, "class/watchdog/watchdog1/state"), []byte("active\n"), 0o644)
	if in, ok := FindActive(root, "/dev", Auto); !ok || in.Path != "/dev/watchdog1" {
		t.Fatalf("the active hardware device: %+v %v", in, ok)
	}
	if _, ok := FindActive(root, "/dev", "/dev/watchdog0"); ok {
		t.Fatal("watchdog0 is not active")
	}
}
