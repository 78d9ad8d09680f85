package uevent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// The kernel cannot be made to drop uevents on demand, so these tests
// run the Watcher on fakes: a fake event source (fakeSource), a sysfs
// tree in a temporary directory (fakeSysfs), sizes and verdicts from
// tables, and a recording setReadOnly. The real socket, sysfs and BLKROSET
// are covered by the loop device tests in watcher_test.go.

type readResult struct {
	ev  Event
	err error
}

// fakeSource delivers what the test pushes, and honours the read
// deadline as a Conn does.
type fakeSource struct {
	ch       chan readResult
	mu       sync.Mutex
	deadline time.Time
	closed   chan struct{}
	once     sync.Once
}

func newFakeSource() *fakeSource {
	return &fakeSource{ch: make(chan readResult), closed: make(chan struct{})}
}

func (s *fakeSource) Read() (Event, time.Time, error) {
	s.mu.Lock()
	dl := s.deadline
	s.mu.Unlock()
	var timeout <-chan time.Time
	if !dl.IsZero() {
		t := time.NewTimer(time.Until(dl))
		defer t.Stop()
		timeout = t.C
	}
	select {
	case r := <-s.ch:
		return r.ev, time.Now(), r.err
	case <-timeout:
		return Event{}, time.Now(), os.ErrDeadlineExceeded
	case <-s.closed:
		return Event{}, time.Now(), os.ErrClosed
	}
}

func (s *fakeSource) SetReadDeadline(t time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deadline = t
	return nil
}

func (s *fakeSource) Close() error {
	s.once.Do(func() { close(s.closed) })
	return nil
}

// fakeSysfs is root/class/block/<name> -> ../../devices/virtual/block/<name>,
// each with a uevent file as the kernel writes it.
type fakeSysfs struct{ root string }

func (f fakeSysfs) add(t *testing.T, name string, minor int, seq int) {
	t.Helper()
	dev := filepath.Join(f.root, "devices/virtual/block", name)
	if err := os.MkdirAll(dev, 0o755); err != nil {
		t.Fatal(err)
	}
	ue := fmt.Sprintf("MAJOR=254\nMINOR=%d\nDEVNAME=%s\nDEVTYPE=disk\nDISKSEQ=%d\n", minor, name, seq)
	if err := os.WriteFile(filepath.Join(dev, "uevent"), []byte(ue), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(f.root, "class/block", name)
	os.Remove(link)
	if err := os.Symlink("../../devices/virtual/block/"+name, link); err != nil {
		t.Fatal(err)
	}
}

func (f fakeSysfs) remove(t *testing.T, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(f.root, "class/block", name)); err != nil {
		t.Fatal(err)
	}
}

// fakeNode is a watcher on fakes: verdicts by device name, every disk
// 1 GiB, refusals recorded.
type fakeNode struct {
	sys       fakeSysfs
	src       *fakeSource
	mu        sync.Mutex
	held      map[string]fence.Key // device node -> foreign holder
	ro        map[string]int       // device node -> BLKROSET calls
	decisions chan Decision
	removals  chan Event
}

var keyForeign = fence.Key(0xa11ce)

func startFake(t *testing.T, rescan time.Duration, setup func(*fakeNode)) *fakeNode {
	t.Helper()
	n := &fakeNode{sys: fakeSysfs{root: t.TempDir()}, src: newFakeSource(), held: map[string]fence.Key{}, ro: map[string]int{},
		decisions: make(chan Decision, 64), removals: make(chan Event, 64)}
	if err := os.MkdirAll(filepath.Join(n.sys.root, "class/block"), 0o755); err != nil {
		t.Fatal(err)
	}
	if setup != nil {
		setup(n)
	}
	w := &Watcher{
		SysfsRoot: n.sys.root,
		Rescan:    rescan,
		Classify: func(ctx context.Context, ev Event) (Verdict, error) {
			n.mu.Lock()
			defer n.mu.Unlock()
			if k, ok := n.held[ev.Node()]; ok {
				return Verdict{Refuse: true, Method: fence.MethodLease, Holder: k, Reason: "held by " + k.String()}, nil
			}
			return Verdict{Method: fence.MethodLease}, nil
		},
		OnDecision: func(d Decision) { n.decisions <- d },
		OnRemove:   func(ev Event) { n.removals <- ev },
		setReadOnly: func(path string, _, _ uint32, ro bool) error {
			n.mu.Lock()
			defer n.mu.Unlock()
			if ro {
				n.ro[path]++
			}
			return nil
		},
		dial: func(Group) (source, error) { return n.src, nil },
		size: func(string) (uint64, error) { return 1 << 30, nil },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("watcher: %v", err)
		}
	})
	select {
	case <-w.Ready():
	case err := <-done:
		t.Fatalf("watcher stopped: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("watcher not ready")
	}
	return n
}

func (n *fakeNode) hold(node string, k fence.Key) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.held[node] = k
}

func (n *fakeNode) roCalls(node string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ro[node]
}

func (n *fakeNode) next(t *testing.T) Decision {
	t.Helper()
	select {
	case d := <-n.decisions:
		return d
	case <-time.After(5 * time.Second):
		t.Fatal("no decision")
		return Decision{}
	}
}

func (n *fakeNode) none(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case d := <-n.decisions:
		t.Fatalf("unexpected decision about %s (%s): %+v", d.Event.Node(), d.Cause, d.Verdict)
	case <-time.After(within):
	}
}

// The scan at start decides the disks already attached before Ready: the
// held one is refused (read-only first), the free one accepted.
func TestStartScanDecidesPresentDisks(t *testing.T) {
	n := startFake(t, -1, func(n *fakeNode) {
		n.sys.add(t, "vdb", 16, 5)
		n.sys.add(t, "vdc", 32, 6)
		n.hold("/dev/vdb", keyForeign)
	})
	// Ready has closed: both decisions are already made.
	if len(n.decisions) != 2 {
		t.Fatalf("%d decisions at Ready, want 2", len(n.decisions))
	}
	got := map[string]Decision{}
	for range 2 {
		d := n.next(t)
		got[d.Event.Node()] = d
	}
	b, c := got["/dev/vdb"], got["/dev/vdc"]
	if !b.Verdict.Refuse || !b.ReadOnly || b.Cause != CauseStart || b.Event.Source != Scan || b.Event.DevPath != "/devices/virtual/block/vdb" ||
		b.Event.Major != 254 || b.Event.Minor != 16 || b.Verdict.Holder != keyForeign {
		t.Fatalf("held disk: %+v", b)
	}
	if c.Verdict.Refuse || c.ReadOnly || c.Cause != CauseStart || n.roCalls("/dev/vdc") != 0 {
		t.Fatalf("free disk: %+v", c)
	}
	if n.roCalls("/dev/vdb") != 1 {
		t.Fatalf("BLKROSET calls on the held disk: %d", n.roCalls("/dev/vdb"))
	}
	// The kernel's and udev's events for the same medium (same DISKSEQ)
	// decide nothing again.
	n.src.ch <- readResult{ev: Event{Source: Udev, Action: "change", Subsystem: "block", DevType: "disk", DevName: "vdb",
		Major: 254, Minor: 16, HasDevnum: true, Env: map[string]string{"DISKSEQ": "5"}}}
	n.none(t, 100*time.Millisecond)
}

// Events lost to a queue overrun: the disk they announced is found by the
// rescan the overrun starts, and refused; a disk whose remove event was
// lost is passed to OnRemove.
func TestOverrunRescans(t *testing.T) {
	n := startFake(t, -1, func(n *fakeNode) { n.sys.add(t, "vdc", 32, 6) })
	if d := n.next(t); d.Event.DevName != "vdc" || d.Verdict.Refuse {
		t.Fatalf("start: %+v", d)
	}
	// vdb is attached and vdc detached; their events are lost.
	n.sys.add(t, "vdb", 16, 7)
	n.hold("/dev/vdb", keyForeign)
	n.sys.remove(t, "vdc")
	n.none(t, 100*time.Millisecond) // no periodic rescan: nothing happens yet
	n.src.ch <- readResult{err: ErrOverrun}
	d := n.next(t)
	if d.Event.DevName != "vdb" || !d.Verdict.Refuse || !d.ReadOnly || d.Cause != CauseOverrun || n.roCalls("/dev/vdb") != 1 {
		t.Fatalf("after the overrun: %+v", d)
	}
	select {
	case ev := <-n.removals:
		if ev.DevName != "vdc" || ev.Action != "remove" || ev.Minor != 32 {
			t.Fatalf("removal %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the disk gone during the overrun was not passed to OnRemove")
	}
}

// The periodic rescan catches a disk whose holder changed without any
// uevent (another node took the lease of a disk accepted as free): it is
// refused once, then kept read-only quietly; a new medium on the same
// device number is decided as new.
func TestPeriodicRescanCatchesChangedDisk(t *testing.T) {
	const every = 50 * time.Millisecond
	n := startFake(t, every, func(n *fakeNode) { n.sys.add(t, "vdb", 16, 5) })
	if d := n.next(t); d.Verdict.Refuse || d.Cause != CauseStart {
		t.Fatalf("start: %+v", d)
	}
	n.none(t, 3*every) // rescans of an unchanged disk say nothing
	n.hold("/dev/vdb", keyForeign)
	d := n.next(t)
	if !d.Verdict.Refuse || !d.ReadOnly || d.Cause != CausePeriodic || d.Event.DevName != "vdb" {
		t.Fatalf("after the holder changed: %+v", d)
	}
	before := n.roCalls("/dev/vdb")
	n.none(t, 4*every) // still refused: no second refusal
	if after := n.roCalls("/dev/vdb"); after <= before {
		t.Fatalf("the refused disk is not set read-only again by the rescans (%d then %d calls)", before, after)
	}
	// The same device number with a new medium (DISKSEQ) is new.
	n.sys.add(t, "vdb", 16, 9)
	n.src.ch <- readResult{ev: Event{Source: Kernel, Action: "change", Subsystem: "block", DevType: "disk", DevName: "vdb",
		Major: 254, Minor: 16, HasDevnum: true, Env: map[string]string{"DISKSEQ": "9"}}}
	// (A rescan may find the new medium before the event arrives; either
	// way it is decided once.)
	if d := n.next(t); !d.Verdict.Refuse || (d.Cause != CauseEvent && d.Cause != CausePeriodic) {
		t.Fatalf("new medium: %+v", d)
	}
	n.none(t, 3*every)
}

// closingSource is a fakeSource whose SetReadDeadline fails once the
// watcher's context has ended, as a Conn's does once the context's close
// has reached its socket.
type closingSource struct {
	*fakeSource
	ctx context.Context
}

func (s closingSource) SetReadDeadline(t time.Time) error {
	if s.ctx.Err() != nil {
		<-s.closed
		return os.ErrClosed
	}
	return s.fakeSource.SetReadDeadline(t)
}

// A watcher stopped while it rescans returns without error: the socket
// its context closed is not a failure, even when the next read deadline
// is set on it before a read could tell (vco-agent lease watch exited 1
// with "setting the rescan deadline: use of closed file").
func TestStopDuringRescanIsNoError(t *testing.T) {
	sys := fakeSysfs{root: t.TempDir()}
	if err := os.MkdirAll(filepath.Join(sys.root, "class/block"), 0o755); err != nil {
		t.Fatal(err)
	}
	sys.add(t, "vdb", 16, 5)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	src := closingSource{fakeSource: newFakeSource(), ctx: ctx}
	classified := 0
	w := &Watcher{
		SysfsRoot: sys.root,
		Rescan:    20 * time.Millisecond,
		Classify: func(context.Context, Event) (Verdict, error) {
			// The first is the scan at start; the second a rescan's.
			if classified++; classified == 2 {
				cancel()
			}
			return Verdict{Method: fence.MethodLease}, nil
		},
		setReadOnly: func(string, uint32, uint32, bool) error { return nil },
		dial:        func(Group) (source, error) { return src, nil },
		size:        func(string) (uint64, error) { return 1 << 30, nil },
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("watcher stopped during a rescan: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("watcher did not stop")
	}
}
