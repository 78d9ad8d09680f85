// Package watchdog arms the host's watchdog device while the agent holds
// an on-disk lease, and feeds it only while every held lease renews in
// time. A host whose agent hangs, is stopped or is killed while it holds a
// lease is then reset within W (the lease timing's watchdog figure) of the
// last feed, which a taker's expiry bound waits out (docs/fencing.md,
// "Host watchdog").
package watchdog

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Unsafe is the device setting that runs leases without a host watchdog.
const Unsafe = "none-unsafe"

// Auto picks a hardware watchdog when the host has one, else softdog.
const Auto = "auto"

// Device is an open watchdog device. Opening one starts its countdown.
type Device interface {
	// SetTimeout asks for timeout d and returns the timeout the device
	// took (it may round, or refuse and keep its own).
	SetTimeout(d time.Duration) (time.Duration, error)
	// Feed restarts the countdown.
	Feed() error
	// Disarm stops the device (the magic close) and closes it. A device
	// that cannot be stopped (nowayout) keeps counting down.
	Disarm() error
	// Close closes the device without stopping it: the host resets when
	// the countdown runs out.
	Close() error
}

// Info describes a device found on the host.
type Info struct {
	Path     string
	Identity string
	// Nowayout: once opened, the driver cannot be stopped.
	Nowayout bool
	// MagicClose: closing without the magic character leaves it running.
	// A device without it stops whenever its descriptor closes, even when
	// the agent dies, which is no protection.
	MagicClose bool
	// Soft is the kernel's software watchdog (softdog).
	Soft bool
	// Active: the device is counting down (opened and not stopped).
	Active bool
	// StateUnknown: sysfs does not say whether it is counting down (a
	// kernel without CONFIG_WATCHDOG_SYSFS); it is treated as if it were.
	StateUnknown bool
}

// Lease is one lease the agent holds, as the watchdog sees it.
type Lease struct {
	Volume string
	// Renewed is when the last successful renewal was issued; the
	// lease's fail bound counts from it.
	Renewed time.Time
	// Fail is the lease's fail bound F, IOTimeout its d.
	Fail, IOTimeout time.Duration
	// Fenced: the lease was lost and its I/O stopped and drained; the
	// host no longer needs resetting for it.
	Fenced bool
	// Unresumed: a lease an earlier agent process held for a volume still
	// mounted, which this one could not resume yet (its read failed). It
	// has no renewal to count from, so it stops the feeding until it is
	// resumed, or found lost and its I/O stopped.
	Unresumed bool
	// Running: a lease lost before the agent restarted whose I/O could not
	// be shown stopped; it stops the feeding until a stop succeeds.
	Running bool
}

// feedDeadline is the last instant a feed is allowed for l: F minus d
// after its last renewal. d is the margin for the time between the check
// and the feed; the taker's expiry bound adds W and another d.
func (l Lease) feedDeadline() time.Time { return l.Renewed.Add(l.Fail - l.IOTimeout) }

// Config configures a Watchdog.
type Config struct {
	// Device is Auto, a device path (/dev/watchdog1), or Unsafe.
	Device string
	// Timeout is W: the device must reset the host within it of the
	// last feed.
	Timeout time.Duration
	// Leases lists the leases the agent holds now. It is called before
	// every feed.
	Leases func() []Lease
	// Linger is how long the device stays armed after Ready while no
	// lease is held yet (an acquisition waiting for an expiry).
	Linger time.Duration
	// Find locates the device for Auto or a path; Open opens it. Tests
	// give fakes (no host here has a watchdog to spare); nil means the
	// kernel's (Find and Open in device_linux.go).
	Find func(want string) (Info, error)
	Open func(Info) (Device, Info, error)
	// Active finds the device when it is counting down already (Adopt);
	// nil adopts nothing.
	Active func(want string) (Info, bool)
	Log    *slog.Logger
}

// Status is what `vco-agent status` and the metrics show.
type Status struct {
	Unsafe   bool
	Armed    bool
	Device   string
	Identity string
	Nowayout bool
	// Timeout is the device's actual timeout.
	Timeout  time.Duration
	LastFeed time.Time
	Leases   int
	// Withheld names the leases that stop the feeding, when any do.
	Withheld []string
	// Error is the last failure to arm or feed.
	Error  string
	Feeds  uint64
	Misses uint64
}

// Watchdog arms, feeds and disarms one device.
type Watchdog struct {
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	dev      Device
	info     Info
	timeout  time.Duration
	lastFeed time.Time
	readyAt  time.Time
	// left: an earlier agent process left the device counting down, and
	// this one has not opened it yet (Adopt).
	left bool
	// unfit: the device is kept (it cannot be stopped) though it cannot
	// reset the host within W; Ready refuses every lease with it.
	unfit    error
	withheld []string
	err      string
	feeds    uint64
	misses   uint64
}

// New returns a watchdog; nothing is opened until a lease needs it.
func New(cfg Config) *Watchdog {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Find == nil {
		cfg.Find = func(want string) (Info, error) { return Find("/sys", "/dev", want) }
	}
	if cfg.Open == nil {
		cfg.Open = Open
	}
	if cfg.Leases == nil {
		cfg.Leases = func() []Lease { return nil }
	}
	return &Watchdog{cfg: cfg, log: cfg.Log}
}

// Unsafe reports whether leases run without a watchdog.
func (w *Watchdog) Unsafe() bool { return w.cfg.Device == Unsafe }

// Ready arms the device, if it is not armed, before a lease is taken; it
// fails, naming the figure, when the device cannot reset the host within
// W. A device an earlier agent process left counting down is not opened
// while a lease stops the feeding (see arm). With the Unsafe setting it
// does nothing.
func (w *Watchdog) Ready(ctx context.Context) error {
	if w.Unsafe() {
		return nil
	}
	leases := w.cfg.Leases()
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	w.readyAt = now
	if w.dev != nil {
		// A device kept only because it cannot be stopped, though it
		// cannot reset the host within W, guards no new lease.
		return w.unfit
	}
	err := w.arm(len(withheldOf(leases, now)) == 0)
	if errors.Is(err, errCountingDown) {
		return fmt.Errorf("%w: no lease is taken until it is: a lease recorded before the agent restarted is not resumed yet, or another program holds the device", err)
	}
	return err
}

// DeviceTimeout is the timeout the device is given: half of W, in whole
// seconds. The kernel's watchdog core pings a device once more whenever
// its descriptor is closed without stopping it (an agent that exits or is
// killed while it holds leases), so a host may live up to two device
// timeouts past the agent's last feed, and both fit in W.
func DeviceTimeout(W time.Duration) time.Duration { return (W / 2).Truncate(time.Second) }

// errCountingDown says the device was left counting down and the leases do
// not allow a feed now, so it was not opened.
var errCountingDown = errors.New("the host watchdog is counting down (left armed by an earlier agent process, or held by another program) and the agent has not taken it over")

// arm opens and sets up the device. Setting its timeout restarts its
// countdown, as a feed does, so a device that is counting down already
// (left by an earlier agent process) is opened only when feedOK says a
// feed is allowed now; else arm returns errCountingDown and leaves it to
// run out. A device that is not counting down is started either way: that
// starts a countdown, it extends none. Called with w.mu held.
func (w *Watchdog) arm(feedOK bool) error {
	err := w.armLocked(feedOK)
	if errors.Is(err, errCountingDown) {
		return err
	}
	if err != nil {
		w.err = err.Error()
		return err
	}
	w.err = ""
	w.left = false
	return nil
}

func (w *Watchdog) armLocked(feedOK bool) error {
	W := w.cfg.Timeout
	Wd := DeviceTimeout(W)
	if Wd < time.Second {
		return fmt.Errorf("the lease's watchdog time W is %s, but the device gets half of it in whole seconds: set volumes.lease.watchdog to 2s or more, or volumes.lease.watchdog_device to %s (unsafe)", W, Unsafe)
	}
	info, err := w.cfg.Find(w.cfg.Device)
	if err != nil {
		return fmt.Errorf("no host watchdog to arm: %w; a lease is held only with one (or with volumes.lease.watchdog_device: %s, unsafe)", err, Unsafe)
	}
	if (info.Active || info.StateUnknown) && !feedOK {
		return errCountingDown
	}
	dev, info, err := w.cfg.Open(info)
	if err != nil {
		return fmt.Errorf("opening the host watchdog %s (%s): %w", info.Path, info.Identity, err)
	}
	if !info.MagicClose && !info.Nowayout {
		// Closing it stops it, which is all that can be done here.
		_ = dev.Close()
		return fmt.Errorf("the host watchdog %s (%s) stops whenever its descriptor closes (no magic close), so a killed agent would stop it too: load its driver with nowayout=1, or use another device (volumes.lease.watchdog_device)", info.Path, info.Identity)
	}
	got, err := dev.SetTimeout(Wd)
	if err == nil && (got <= 0 || got > Wd) {
		err = fmt.Errorf("it took a timeout of %s, and it must reset within half the lease's watchdog time W=%s: set volumes.lease.watchdog to at least %s, or use another device", got, W, 2*got)
	}
	if err == nil {
		err = dev.Feed()
	}
	if err != nil {
		err = fmt.Errorf("the host watchdog %s (%s) cannot reset the host within W/2=%s: %w", info.Path, info.Identity, Wd, err)
		w.release(dev, info, got, err)
		return err
	}
	w.dev, w.info, w.timeout, w.lastFeed, w.unfit = dev, info, got, time.Now(), nil
	w.feeds++
	w.log.Info("host watchdog armed: the host resets if the agent stops renewing its leases", "device", info.Path,
		"identity", info.Identity, "timeout", got.String(), "nowayout", info.Nowayout, "taken_over", info.Active)
	return nil
}

// release lets go of a device after a failed arm (why). One that cannot
// be stopped is kept, fed by the next ticks, and marked unfit, so that no
// new lease is taken on it. One that was counting down before it was
// opened (left armed by an earlier agent process, whose leases this one
// may hold now) is closed without the magic character, so it keeps
// counting: closing pings it once, and arm opens such a device only when
// a feed is allowed. Only a device this process started is stopped.
func (w *Watchdog) release(dev Device, info Info, got time.Duration, why error) {
	switch {
	case info.Nowayout:
		if got <= 0 {
			got = DeviceTimeout(w.cfg.Timeout)
		}
		w.dev, w.info, w.timeout, w.lastFeed, w.unfit = dev, info, got, time.Now(), why
	case info.Active || info.StateUnknown:
		if err := dev.Close(); err != nil {
			w.log.Error("closing the host watchdog after a failed take-over", "device", info.Path, "err", err)
		}
		w.left = true
	default:
		if err := dev.Disarm(); err != nil {
			w.log.Error("could not stop the host watchdog after a failed arm; the host resets when it runs out", "device", info.Path, "err", err)
		}
	}
}

// Adopt notes that an earlier agent process left the device counting down
// (it died, or stopped while it held leases). The device is not opened
// here: opening it and setting its timeout would restart the countdown,
// and an agent that then dies or hangs before it resumes the earlier
// leases would have bought the host a countdown nobody allowed. The first
// tick whose leases allow a feed takes it over (a lease resumed and
// renewing, or none held, when it is stopped after the linger); until
// then it runs out as the earlier process left it. A device another
// program holds is left alone.
func (w *Watchdog) Adopt() {
	if w.Unsafe() || w.cfg.Active == nil {
		return
	}
	info, active := w.cfg.Active(w.cfg.Device)
	if !active {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dev != nil {
		return
	}
	w.readyAt = time.Now()
	w.left = true
	w.log.Warn("an earlier agent process left the host watchdog counting down: it is taken over at the first feed the leases allow, and resets the host if none comes in time",
		"device", info.Path)
}

// Interval is how often Run looks at the leases and feeds: a quarter of
// the device's timeout, at most a second.
func (w *Watchdog) Interval() time.Duration {
	w.mu.Lock()
	t := w.timeout
	w.mu.Unlock()
	if t <= 0 {
		t = w.cfg.Timeout
	}
	return min(max(t/4, 10*time.Millisecond), time.Second)
}

// Run ticks until ctx ends. It does not disarm: Stop decides that.
func (w *Watchdog) Run(ctx context.Context) {
	if w.Unsafe() {
		w.log.Warn("leases run WITHOUT a host watchdog (volumes.lease.watchdog_device: " + Unsafe + "): a host whose agent hangs or dies keeps writing to its lease disks after other nodes take them over")
		return
	}
	for {
		t := time.NewTimer(w.Interval())
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		w.Tick()
	}
}

// Tick is one look at the leases: arm when one is held, feed only while
// each is renewed within its fail bound less d (or fenced), disarm when
// none has been held for the linger time.
func (w *Watchdog) Tick() {
	if w.Unsafe() {
		return
	}
	leases := w.cfg.Leases()
	w.mu.Lock()
	defer w.mu.Unlock()
	// The leases are read before every feed, and the time after: a feed
	// follows a fresh look, never the process merely being alive.
	now := time.Now()
	if len(leases) == 0 {
		w.withheld = nil
		if w.dev == nil {
			// A device an earlier process left counting down, with no
			// lease held now: taken over, then stopped after the linger.
			if !w.left || w.arm(true) != nil {
				return
			}
			w.log.Warn("took over the host watchdog an earlier agent left armed; no lease is held", "device", w.info.Path)
		}
		if time.Since(w.readyAt) < w.cfg.Linger || w.info.Nowayout {
			w.feed()
			return
		}
		w.disarm()
		return
	}
	withheld := withheldOf(leases, now)
	if w.dev == nil {
		prev := w.err
		err := w.arm(len(withheld) == 0)
		switch {
		case errors.Is(err, errCountingDown):
			w.withhold(withheld, now)
			return
		case err != nil:
			if err.Error() != prev {
				w.log.Error("a lease is held but the host watchdog could not be armed: a hung or killed agent would not reset this host", "err", err)
			}
			w.misses++
			return
		case len(withheld) == 0:
			// arm fed it.
			w.withheld = nil
			return
		}
	}
	if len(withheld) > 0 {
		w.withhold(withheld, now)
		return
	}
	if w.withheld != nil {
		w.log.Info("feeding the host watchdog again: every lease is renewed or fenced")
	}
	w.withheld = nil
	w.feed()
}

// withheldOf names the leases that stop the feeding at now.
func withheldOf(leases []Lease, now time.Time) []string {
	var withheld []string
	for _, l := range leases {
		switch {
		case l.Fenced:
		case l.Unresumed:
			withheld = append(withheld, l.Volume+" (held before the agent restarted, not resumed yet)")
		case l.Running:
			withheld = append(withheld, l.Volume+" (lost, and its I/O could not be stopped)")
		case !now.Before(l.feedDeadline()):
			withheld = append(withheld, fmt.Sprintf("%s (renewed %s ago, fail bound %s)", l.Volume, now.Sub(l.Renewed).Round(time.Millisecond), l.Fail))
		}
	}
	return withheld
}

// withhold records a tick that did not feed. Called with w.mu held.
func (w *Watchdog) withhold(withheld []string, now time.Time) {
	if w.withheld == nil {
		resetIn := "unknown (left counting down by an earlier agent process)"
		if w.dev != nil {
			resetIn = (w.timeout - now.Sub(w.lastFeed)).Round(time.Millisecond).String()
		}
		w.log.Error("not feeding the host watchdog: a lease is not renewed in time and its I/O is not stopped; the host resets unless it renews or fences",
			"leases", strings.Join(withheld, ", "), "reset_in", resetIn)
	}
	w.withheld = withheld
	w.misses++
}

// feed restarts the countdown. Called with w.mu held.
func (w *Watchdog) feed() {
	if err := w.dev.Feed(); err != nil {
		w.err = fmt.Sprintf("feeding %s: %v", w.info.Path, err)
		w.misses++
		w.log.Error("feeding the host watchdog failed; the host resets when it runs out", "device", w.info.Path, "err", err)
		return
	}
	w.err = ""
	w.lastFeed = time.Now()
	w.feeds++
}

// disarm stops the device. Called with w.mu held.
func (w *Watchdog) disarm() {
	if err := w.dev.Disarm(); err != nil {
		w.log.Error("could not stop the host watchdog; the host resets when it runs out", "device", w.info.Path, "err", err)
	} else {
		w.log.Info("host watchdog disarmed: no lease is held", "device", w.info.Path)
	}
	w.dev = nil
	w.timeout = 0
}

// Stop is the agent's exit. With no lease held the device is disarmed;
// while a lease is held it stays armed (its volume stays mounted and
// nothing renews it any more), so the host resets within W unless the
// agent comes back and resumes the lease first. A nowayout device keeps
// counting down either way.
func (w *Watchdog) Stop() {
	if w.Unsafe() {
		return
	}
	leases := w.cfg.Leases()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dev == nil {
		return
	}
	var held []string
	for _, l := range leases {
		if !l.Fenced {
			held = append(held, l.Volume)
		}
	}
	switch {
	case len(held) > 0:
		w.log.Error("the agent stops while it holds leases: the host watchdog stays armed and resets the host unless the agent is back within its timeout; unstage these volumes before stopping the agent",
			"volumes", strings.Join(held, ", "), "device", w.info.Path, "timeout", w.timeout.String())
		if err := w.dev.Close(); err != nil {
			w.log.Error("closing the host watchdog", "err", err)
		}
		w.dev = nil
	case w.info.Nowayout:
		w.log.Warn("the host watchdog cannot be stopped (nowayout): the host resets unless the agent is back within its timeout",
			"device", w.info.Path, "timeout", w.timeout.String())
		if err := w.dev.Close(); err != nil {
			w.log.Error("closing the host watchdog", "err", err)
		}
		w.dev = nil
	default:
		w.disarm()
	}
}

// Status reports the watchdog's state.
func (w *Watchdog) Status() Status {
	n := len(w.cfg.Leases())
	w.mu.Lock()
	defer w.mu.Unlock()
	st := Status{Unsafe: w.Unsafe(), Armed: w.dev != nil, Leases: n, Error: w.err, Feeds: w.feeds, Misses: w.misses,
		LastFeed: w.lastFeed, Withheld: append([]string(nil), w.withheld...)}
	if w.dev != nil {
		st.Device, st.Identity, st.Nowayout, st.Timeout = w.info.Path, w.info.Identity, w.info.Nowayout, w.timeout
	}
	if w.left && st.Error == "" {
		st.Error = "an earlier agent process left the device counting down; it is taken over at the first feed the leases allow"
	}
	return st
}

// ErrNone says the host has no watchdog device.
var ErrNone = errors.New("the host has no watchdog device")
