package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// countingDevice stands in for a watchdog device: the host the tests run
// on is the team's machine, whose own watchdog must never be armed. The
// real device is armed in a QEMU guest (integration/scenarios).
type countingDevice struct {
	mu             sync.Mutex
	feeds          int
	disarmed, shut bool
}

func (d *countingDevice) SetTimeout(t time.Duration) (time.Duration, error) { return t, nil }
func (d *countingDevice) Feed() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.feeds++
	return nil
}
func (d *countingDevice) Disarm() error { d.mu.Lock(); d.disarmed = true; d.mu.Unlock(); return nil }
func (d *countingDevice) Close() error  { d.mu.Lock(); d.shut = true; d.mu.Unlock(); return nil }
func (d *countingDevice) count() int    { d.mu.Lock(); defer d.mu.Unlock(); return d.feeds }

// The host watchdog reads the real lease engines: armed once a lease is
// held, fed while it renews, not fed once its renewals stop landing (the
// disk refuses them, as a hung renewal path would look), fed again once
// the lease is lost and its I/O stopped, and disarmed after the unstage.
func TestHostWatchdogFollowsTheLeaseEngines(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, devA := loop(t, 64)
	t.Cleanup(func() { clearRO(devA) })

	dev := &countingDevice{}
	wd := watchdog.New(watchdog.Config{Device: watchdog.Auto, Timeout: 10 * time.Second, Leases: a.m.Leases,
		Find: func(string) (watchdog.Info, error) {
			return watchdog.Info{Path: "/dev/fake-watchdog", MagicClose: true}, nil
		},
		Open: func(in watchdog.Info) (watchdog.Device, watchdog.Info, error) { return dev, in, nil }})
	wd.Tick()
	if wd.Status().Armed {
		t.Fatal("armed before any lease is held")
	}
	req := a.stageReq("vol-w", img, "w")
	req.AllowUnfenced = false
	a.leaseStageArmsAndFeedsTheWatchdog(ctx, req, wd, dev)

	// The disk refuses the renewals from now on.
	f, err := os.Open(devA)
	if err != nil {
		t.Fatal(err)
	}
	err = unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 1)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	a.withheldThenFedOnceFenced(wd, dev)

	clearRO(devA)
	// The loss is recorded by its own goroutine; until it is done an
	// unstage answers Aborted, which the kubelet retries, as here.
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := a.m.Unstage(ctx, "vol-w", a.staging("w"))
		if err == nil {
			break
		}
		if agenterr.KindOf(err) != agenterr.Aborted || time.Now().After(end) {
			t.Fatal(err)
		}
	}
	if ls := a.m.Leases(); len(ls) != 0 {
		t.Fatalf("leases after the unstage: %+v", ls)
	}
	wd.Tick()
	if wd.Status().Armed || !dev.disarmed {
		t.Fatalf("not disarmed after the last lease went: %+v", wd.Status())
	}
}

// leaseStageArmsAndFeedsTheWatchdog stages vol-w on the lease: its lease
// engine is listed, fresh and with the configured timing; the watchdog is
// armed with a feed and fed, and renewals keep it fresh: fed at every tick
// for two fail bounds.
func (e *env) leaseStageArmsAndFeedsTheWatchdog(ctx context.Context, req StageRequest, wd *watchdog.Watchdog, dev *countingDevice) {
	t := e.t
	t.Helper()
	if res, err := e.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage: %+v %v", res, err)
	}
	ls := e.m.Leases()
	if len(ls) != 1 || ls[0].Volume != "vol-w" || ls[0].Fenced || ls[0].Fail != testTiming.Fail || ls[0].IOTimeout != testTiming.IOTimeout ||
		time.Since(ls[0].Renewed) > testTiming.Renew+testTiming.Settle()+testTiming.IOTimeout {
		t.Fatalf("leases after the stage: %+v", ls)
	}
	wd.Tick()
	if !wd.Status().Armed || dev.count() != 1 { // armed, which feeds it
		t.Fatalf("not armed and fed with a lease held: %+v", wd.Status())
	}
	// Renewals keep it fresh: fed at every tick for two fail bounds.
	for end := time.Now().Add(2 * testTiming.Fail); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		n := dev.count()
		wd.Tick()
		if dev.count() != n+1 {
			t.Fatalf("not fed while the lease renews: %+v %+v", wd.Status(), e.m.Leases())
		}
	}
}

// withheldThenFedOnceFenced: with the renewals refused, the watchdog is
// fed only while the renewal is younger than F-d, then withheld (not fed)
// until the lease is lost and fenced, and fed again once the lost lease's
// I/O was stopped.
func (e *env) withheldThenFedOnceFenced(wd *watchdog.Watchdog, dev *countingDevice) {
	t := e.t
	t.Helper()
	stopped := time.Now()
	withheld, fenced := false, false
	for !fenced && time.Since(stopped) < testTiming.Fail+10*time.Second {
		time.Sleep(50 * time.Millisecond)
		n := dev.count()
		wd.Tick()
		fenced, withheld = e.checkOneWatchdogTick(wd, dev, n, withheld)
	}
	if !withheld || !fenced {
		t.Fatalf("after the renewals stopped: withheld=%v fenced=%v; status %+v; log:\n%s", withheld, fenced, wd.Status(), e.logs)
	}
	n := dev.count()
	wd.Tick()
	if dev.count() != n+1 || len(wd.Status().Withheld) != 0 {
		t.Fatalf("not fed again once the lost lease's I/O was stopped: %+v", wd.Status())
	}
}

// checkOneWatchdogTick judges the tick that found n feeds: the lease is
// fenced; or withheld, and then not fed and not before F-d; or fed, and
// then with a renewal younger than F-d. It returns whether the lease is
// fenced and whether a tick has withheld the feed (so far, with withheld).
func (e *env) checkOneWatchdogTick(wd *watchdog.Watchdog, dev *countingDevice, n int, withheld bool) (bool, bool) {
	t := e.t
	t.Helper()
	ls := e.m.Leases()
	st := wd.Status()
	switch {
	case len(ls) == 1 && ls[0].Fenced:
		return true, withheld
	case len(st.Withheld) == 1:
		if dev.count() != n {
			t.Fatalf("fed while a lease was withheld: %+v %+v %d->%d", ls, st, n, dev.count())
		}
		if age := time.Since(ls[0].Renewed); age < testTiming.Fail-testTiming.IOTimeout {
			t.Fatalf("withheld at a renewal age of %s, before F-d", age)
		}
		return false, true
	default:
		if len(ls) == 1 && time.Since(ls[0].Renewed) >= testTiming.Fail-testTiming.IOTimeout+100*time.Millisecond {
			t.Fatalf("fed with a renewal %s old: %+v", time.Since(ls[0].Renewed), st)
		}
		return false, withheld
	}
}

// resumeFailsOnce is the agent's fencer factory, except that the first
// lease fencer it makes fails to resume, as a lease read that fails once
// at an agent's start would; with choose, making that fencer fails (the
// read of the disk's signatures failed).
type resumeFailsOnce struct {
	FencerFactory
	choose, failed bool
}

type resumeFails struct{ *leaseFencer }

func (resumeFails) Resume(context.Context) error {
	return errors.New("reading the lease area: input/output error")
}

func (f *resumeFailsOnce) Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	ch, err := f.FencerFactory.Choose(ctx, dev, volume, onLost)
	if lf, ok := ch.Fencer.(*leaseFencer); ok && err == nil && !f.failed {
		f.failed = true
		if f.choose {
			closeChoice(ch)
			return Choice{}, errors.New("reading the disk's signatures: input/output error")
		}
		ch.Fencer = resumeFails{lf}
	}
	return ch, err
}

// An agent that stops renews its leases a last time (the hand-off); the
// next one, when it cannot resume a lease of a volume still mounted (its
// read failed), lists it as unresumed so that the host watchdog is not fed
// for it, and the periodic check resumes it, from then on an ordinary
// held lease.
func TestAnUnresumedLeaseIsListedUntilTheCheckResumesIt(t *testing.T) {
	t.Run("resumed at start", func(t *testing.T) { unresumedUntilTheCheck(t, nil) })
	t.Run("the resume's read failed", func(t *testing.T) { unresumedUntilTheCheck(t, &resumeFailsOnce{}) })
	t.Run("the fencer could not be made", func(t *testing.T) { unresumedUntilTheCheck(t, &resumeFailsOnce{choose: true}) })
}

// unresumedUntilTheCheck stages a lease volume and restarts the agent with
// fail (nil: none) wrapping its fencer factory. From before the start-up
// check, the recorded lease is listed as not resumed.
func unresumedUntilTheCheck(t *testing.T, fail *resumeFailsOnce) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, devA := loop(t, 64)
	req := a.stageReq("vol-u", img, "u")
	req.AllowUnfenced = false
	if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage: %+v %v", res, err)
	}
	time.Sleep(testTiming.Renew / 2)
	stopped := time.Now()
	if fail != nil {
		fail.FencerFactory = a.fencers
		a.fencers = fail
	}
	a.start() // the agent stops (its fencers close) and starts again
	handedOff(t, devA, stopped)

	if ls := a.m.Leases(); len(ls) != 0 {
		t.Fatalf("leases listed before the agent looked at its records: %+v", ls)
	}
	a.m.ExpectRecordedLeases()
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Volume != "vol-u" || !ls[0].Unresumed {
		t.Fatalf("leases before the start-up check: %+v", ls)
	}
	a.m.Reconcile(ctx)
	if fail != nil {
		if ls := a.m.Leases(); len(ls) != 1 || ls[0].Volume != "vol-u" || !ls[0].Unresumed {
			t.Fatalf("leases after a failed resume: %+v", ls)
		}
		a.m.CheckAll(ctx)
	}
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Unresumed || ls[0].Fenced || time.Since(ls[0].Renewed) > testTiming.Fail {
		t.Fatalf("leases after the check resumed it: %+v", ls)
	}
	if err := a.m.Unstage(ctx, "vol-u", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// handedOff checks that the agent that stopped at stopped renewed its
// lease on dev a last time as it went.
func handedOff(t *testing.T, dev string, stopped time.Time) {
	t.Helper()
	ld, err := lease.OpenDevice(dev)
	if err != nil {
		t.Fatal(err)
	}
	st, _, err := lease.ReadStatus(context.Background(), ld, keyA, testTiming.IOTimeout)
	ld.Close()
	if err != nil {
		t.Fatal(err)
	}
	if st.Owner == nil || st.Owner.Key != keyA || st.Owner.Written < stopped.UnixNano() {
		t.Fatalf("the stopping agent did not renew its lease a last time (stopped at %d): %+v", stopped.UnixNano(), st.Owner)
	}
}

// A restarted agent that finds its lease record too old to resume stops
// the volume's I/O; when that stop fails (here another filesystem is
// mounted over the staging path, so the agent leaves it alone), the lease
// stays listed as lost and not stopped, which keeps the host watchdog
// unfed; when it succeeds, as fenced.
func TestAResumeLossKeepsTheWatchdogUnfedUnlessItsIOStopped(t *testing.T) {
	for _, stopFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("stop fails %v", stopFails), func(t *testing.T) {
			a := fencedLeaseEnv(t, nodeA, "node-a")
			ctx := context.Background()
			img, devA := loop(t, 64)
			t.Cleanup(func() { clearRO(devA) })
			req := a.stageReq("vol-l", img, "l")
			req.AllowUnfenced = false
			if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
				t.Fatalf("stage: %+v %v", res, err)
			}
			a.start() // the agent stops, and is down past the fail bound
			time.Sleep(testTiming.Fail + testTiming.IOTimeout)
			if stopFails {
				if err := unix.Mount("tmpfs", req.StagingPath, "tmpfs", 0, ""); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = unix.Unmount(req.StagingPath, unix.MNT_DETACH) })
			}
			a.m.ExpectRecordedLeases()
			a.m.Reconcile(ctx)
			if c, _ := a.m.Store().Get("vol-l"); c == nil || c.State != StateLost {
				t.Fatalf("claim after a resume past the fail bound: %+v", c)
			}
			ls := a.m.Leases()
			if len(ls) != 1 || ls[0].Volume != "vol-l" || ls[0].Fenced == stopFails {
				t.Fatalf("leases after the loss (the stop failed: %v): %+v", stopFails, ls)
			}
			if !stopFails {
				return
			}
			// The agent restarts again: the loss whose stop failed is
			// still listed, until a check's stop succeeds.
			a.start()
			a.m.ExpectRecordedLeases()
			a.m.Reconcile(ctx)
			a.m.CheckAll(ctx)
			if ls := a.m.Leases(); len(ls) != 1 || !ls[0].Running || ls[0].Fenced {
				t.Fatalf("after another restart, a loss whose stop failed: leases %+v", ls)
			}
			if err := unix.Unmount(req.StagingPath, unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
			a.m.CheckAll(ctx)
			if ls := a.m.Leases(); len(ls) != 0 {
				t.Fatalf("the check stopped the I/O, yet: leases %+v", ls)
			}
			if c, _ := a.m.Store().Get("vol-l"); c == nil || c.IONotStopped {
				t.Fatalf("claim after the stop succeeded: %+v", c)
			}
		})
	}
}

// The recorded leases stop the feeding after an agent restart, but not on
// the first start after the host booted: the boot took every mount of the
// earlier process, and listing them would arm the watchdog for the
// start-up check's length. An unknown boot id lists them.
func TestRecordedLeasesAreNotWaitedForAfterABoot(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	req := stagedLease(t, a, "vol-b", "b")
	expect := func(boot string, bootErr error, want int) {
		t.Helper()
		a.start()
		a.m.bootID = func() (string, error) { return boot, bootErr }
		a.m.ExpectRecordedLeases()
		if ls := a.m.Leases(); len(ls) != want || (want == 1 && !ls[0].Unresumed) {
			t.Fatalf("boot %q (%v): leases before the start-up check %+v, want %d not resumed", boot, bootErr, ls, want)
		}
	}
	expect("boot-1", nil, 1) // no boot id recorded yet: listed
	expect("boot-1", nil, 1) // the same boot: a restart
	expect("boot-2", nil, 0) // the host booted since
	expect("boot-2", nil, 1)
	expect("", errors.New("no /proc"), 1)
	// The process that could not read the boot id forgot the one
	// recorded: the next process cannot tell a boot from a restart of
	// the same boot, and lists them (the careful answer).
	expect("boot-3", nil, 1)
	a.m.Reconcile(ctx)
	// After a boot, a lease whose resume fails (its read) does not stop
	// the feeding either: nothing of the earlier process writes.
	a.fencers = &resumeFailsOnce{FencerFactory: a.fencers}
	expect("boot-4", nil, 0)
	a.m.Reconcile(ctx)
	if ls := a.m.Leases(); len(ls) != 0 {
		t.Fatalf("after a boot, a lease whose resume failed is listed: %+v", ls)
	}
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Unresumed || ls[0].Fenced {
		t.Fatalf("the check did not resume the lease: %+v", ls)
	}
	if err := a.m.Unstage(ctx, "vol-b", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// A lease claim whose disk the start-up check cannot tell from another (a
// scan that fails, a serial that does not match; here, loop devices no
// longer allowed) may still have a mount of the earlier process writing
// to it: it stays listed as not resumed, stopping the host watchdog's
// feeding, until a check finds its disk.
func TestALeaseClaimWhoseDiskCannotBeVerifiedStopsTheFeeding(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	req := stagedLease(t, a, "vol-v", "v")
	a.cfg.AllowLoopDevices = false
	a.start()
	a.m.bootID = func() (string, error) { return "one-boot", nil }
	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Volume != "vol-v" || !ls[0].Unresumed {
		t.Fatalf("a lease claim whose disk cannot be verified: leases %+v", ls)
	}
	if c, _ := a.m.Store().Get("vol-v"); c == nil || !c.Missing {
		t.Fatalf("claim not reported abnormal: %+v", c)
	}
	a.m.o.Config.AllowLoopDevices = true
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Unresumed || ls[0].Fenced {
		t.Fatalf("the check found the disk but did not resume the lease: %+v", ls)
	}
	if err := a.m.Unstage(ctx, "vol-v", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// barrierFencers holds every Choose until n of them have come, or the
// test's patience runs out: a start-up check that takes its claims back
// one after the other never gets there.
type barrierFencers struct {
	FencerFactory
	mu      sync.Mutex
	arrived int
	n       int
	all     chan struct{}
}

func (b *barrierFencers) Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	b.mu.Lock()
	b.arrived++
	if b.arrived == b.n {
		close(b.all)
	}
	b.mu.Unlock()
	select {
	case <-b.all:
	case <-time.After(20 * time.Second):
		return Choice{}, fmt.Errorf("volume %s: only %d of %d claims were being taken back at once", volume, b.arrived, b.n)
	}
	return b.FencerFactory.Choose(ctx, dev, volume, onLost)
}

// After a restart the host watchdog is fed again only once every recorded
// lease is resumed, within W/2 of the earlier process's exit; each resume
// waits its settle time, so the start-up check resumes them side by side.
func TestTheStartUpCheckResumesLeasesSideBySide(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	const n = 3
	var reqs []StageRequest
	for i := range n {
		img, dev := loop(t, 64)
		t.Cleanup(func() { clearRO(dev) })
		req := a.stageReq(fmt.Sprintf("vol-%d", i), img, fmt.Sprintf("%d", i))
		req.AllowUnfenced = false
		if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
			t.Fatalf("stage %d: %+v %v", i, res, err)
		}
		reqs = append(reqs, req)
	}
	b := &barrierFencers{FencerFactory: a.fencers, n: n, all: make(chan struct{})}
	a.fencers = b
	a.start()
	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	ls := a.m.Leases()
	if len(ls) != n {
		t.Fatalf("leases after the start-up check: %+v", ls)
	}
	for _, l := range ls {
		if l.Unresumed || l.Fenced || time.Since(l.Renewed) > testTiming.Fail {
			t.Fatalf("not every lease resumed: %+v", ls)
		}
	}
	for _, req := range reqs {
		if err := a.m.Unstage(ctx, req.Volume, req.StagingPath); err != nil {
			t.Fatal(err)
		}
	}
}

// lossFailedBeforeRestart stages a lease volume, restarts the agent past
// its fail bound with another filesystem over the staging path (so the
// loss's stop fails), and restarts it once more: the claim is lost with
// its I/O not shown stopped.
func lossFailedBeforeRestart(t *testing.T, a *env, vol string) StageRequest {
	t.Helper()
	ctx := context.Background()
	img, devA := loop(t, 64)
	t.Cleanup(func() { clearRO(devA) })
	req := a.stageReq(vol, img, vol)
	req.AllowUnfenced = false
	if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage: %+v %v", res, err)
	}
	a.start()
	time.Sleep(testTiming.Fail + testTiming.IOTimeout)
	if err := unix.Mount("tmpfs", req.StagingPath, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(req.StagingPath, unix.MNT_DETACH) })
	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	if c, _ := a.m.Store().Get(vol); c == nil || c.State != StateLost || !c.IONotStopped {
		t.Fatalf("claim after a loss whose stop failed: %+v", c)
	}
	return req
}

// A loss whose stop failed is listed for the host watchdog from before the
// start-up check of the next agent process (which would otherwise take a
// device left counting down over and feed it), also while its disk cannot
// be verified; once a check's stop succeeds it is not, and its device
// stays open.
func TestALossWhoseStopFailedIsListedFromBeforeTheStartUpCheck(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	req := lossFailedBeforeRestart(t, a, "vol-r")
	a.cfg.AllowLoopDevices = false
	a.start()
	a.m.ExpectRecordedLeases()
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Volume != "vol-r" {
		t.Fatalf("before the start-up check: leases %+v", ls)
	}
	a.m.Reconcile(ctx)
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 1 || ls[0].Volume != "vol-r" {
		t.Fatalf("its disk not verified: leases %+v", ls)
	}
	a.m.o.Config.AllowLoopDevices = true
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 1 || !ls[0].Running {
		t.Fatalf("its disk found, the stop failing still: leases %+v", ls)
	}
	if err := unix.Unmount(req.StagingPath, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	a.m.CheckAll(ctx)
	if ls := a.m.Leases(); len(ls) != 0 {
		t.Fatalf("the stop succeeded: leases %+v", ls)
	}
	l := a.m.getLive("vol-r")
	if l == nil {
		t.Fatal("no live entry")
	}
	if _, err := readOnly(l.dev.File); err != nil {
		t.Fatalf("the live entry's device was closed: %v", err)
	}
}

// lossSnoop records the watchdog's lease list at each DiskFenced event.
type lossSnoop struct {
	mu  sync.Mutex
	m   func() *Manager
	got [][]watchdog.Lease
}

func (s *lossSnoop) Name() string { return "snoop" }
func (s *lossSnoop) Emit(e events.Event) error {
	if e.Type == events.DiskFenced && s.m() != nil {
		ls := s.m().Leases()
		s.mu.Lock()
		s.got = append(s.got, ls)
		s.mu.Unlock()
	}
	return nil
}

// While the start-up check stops the I/O of a lease its resume found lost,
// the lease is listed (the feeding withheld) until the stop's outcome.
func TestAResumeLossIsListedWhileItsStopRuns(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	stagedLease(t, a, "vol-w", "w")
	a.start()
	time.Sleep(testTiming.Fail + testTiming.IOTimeout)
	snoop := &lossSnoop{m: func() *Manager { return a.m }}
	a.bus.AddSink(snoop)
	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	snoop.mu.Lock()
	defer snoop.mu.Unlock()
	if len(snoop.got) != 1 || len(snoop.got[0]) != 1 || snoop.got[0][0].Fenced {
		t.Fatalf("leases listed while the loss was stopped: %+v", snoop.got)
	}
}

// A stage of a volume whose lease the restarted agent has not taken back
// yet waits for the check (UNAVAILABLE, retried): it would let go of what
// keeps the host watchdog unfed for the volume before holding anything.
func TestAStageWaitsForTheCheckToTakeBackAnUnresumedLease(t *testing.T) {
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	req := stagedLease(t, a, "vol-s", "s")
	a.fencers = &resumeFailsOnce{FencerFactory: a.fencers}
	a.start()
	a.m.ExpectRecordedLeases()
	a.m.Reconcile(ctx)
	if _, err := a.m.Stage(ctx, req); agenterr.KindOf(err) != agenterr.Unavailable {
		t.Fatalf("stage of a volume whose lease is not taken back: %v", err)
	}
	if ls := a.m.Leases(); len(ls) != 1 || !ls[0].Unresumed {
		t.Fatalf("leases after the refused stage: %+v", ls)
	}
	a.m.CheckAll(ctx)
	if res, err := a.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage once the check resumed the lease: %+v %v", res, err)
	}
	if err := a.m.Unstage(ctx, "vol-s", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// stagedLease stages vol, a new lease-fenced loop disk, at staging.
func stagedLease(t *testing.T, a *env, vol, staging string) StageRequest {
	t.Helper()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	req := a.stageReq(vol, img, staging)
	req.AllowUnfenced = false
	if res, err := a.m.Stage(context.Background(), req); err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage of %s: %+v %v", vol, res, err)
	}
	return req
}

// The start-up check takes the lease claims first, in their recorded
// order, then the rest: a restarted agent must resume every lease within
// W/2, and a reservation or unfenced claim must not hold a worker then.
func TestStartUpOrderTakesLeasesFirst(t *testing.T) {
	var claims []*Claim
	for i, m := range []fence.Method{fence.MethodPR, fence.MethodLease, fence.MethodNone, fence.MethodLease, fence.MethodPR, fence.MethodLease} {
		claims = append(claims, &Claim{Volume: fmt.Sprintf("vol-%d", i), Method: m})
	}
	startUpOrder(claims)
	var got []string
	for _, c := range claims {
		got = append(got, c.Volume)
	}
	if want := "vol-1 vol-3 vol-5 vol-0 vol-2 vol-4"; strings.Join(got, " ") != want {
		t.Fatalf("start-up order %v; want %s", got, want)
	}
}
