package uevent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Verdict is a classifier's answer for a disk that appeared.
type Verdict struct {
	// Refuse: another live holder has the disk; it is set read-only.
	Refuse bool `json:"refuse"`
	// Method is how the disk is fenced (for the event), when known.
	Method     fence.Method `json:"method,omitempty"`
	Holder     fence.Key    `json:"holder,omitempty"`
	HolderNode string       `json:"holder_node,omitempty"`
	// Reason is the sentence the DiskRefused event carries.
	Reason string `json:"reason,omitempty"`
}

// Classifier decides about a disk; the agent's classifier probes the
// reservation engine and the lease. It must honour ctx.
type Classifier func(ctx context.Context, ev Event) (Verdict, error)

// Cause says what made the Watcher classify a disk.
type Cause string

const (
	// CauseEvent: a kernel or udev uevent (add, or change to a new
	// medium) announced the disk.
	CauseEvent Cause = "uevent"
	// CauseStart: the scan at start found the disk already attached.
	CauseStart Cause = "start-up scan"
	// CauseOverrun: the rescan after the kernel dropped uevents.
	CauseOverrun Cause = "rescan after a uevent queue overrun"
	// CausePeriodic: the periodic rescan.
	CausePeriodic Cause = "periodic rescan"
)

// Decision is what the Watcher did about one disk.
type Decision struct {
	Event Event
	// Cause is what made the Watcher look at the disk.
	Cause Cause
	// Received is when the triggering uevent was read from the socket, or
	// when a scan found the disk.
	Received time.Time
	Verdict  Verdict
	// ReadOnly: the device was set read-only and read back so.
	ReadOnly bool
	// Err is a classification or refusal failure.
	Err error
	// Done is when the decision (and the refusal, if any) was complete.
	Done time.Time
}

// DefaultRescan is how often the Watcher classifies every present disk
// again when Rescan is zero.
const DefaultRescan = 30 * time.Second

// Watcher classifies every disk on the node and refuses those held
// elsewhere, without being asked. Every path goes through one routine:
//
//   - at start, after the socket listens and before Ready, every disk
//     already attached (SysfsRoot/class/block) is classified: a disk
//     attached while the agent was down, or at boot, is treated exactly
//     as a new one;
//   - on the first add or change event at which a disk has a size (a
//     hot-plugged virtio or SCSI disk has one at add; a loop device only
//     once its backing file is attached) for a new medium (the kernel's
//     DISKSEQ), the disk is classified;
//   - after the kernel reports lost events (ENOBUFS), and every Rescan,
//     every disk is classified again, and a disk that is no longer there
//     is passed to OnRemove.
//
// A classification is bounded by Timeout; a refusal sets the device
// read-only before OnDecision hears of it. OnDecision hears of a disk
// once per appearance and again only when the outcome changes (refused,
// by whom; accepted; failed), so a rescan repeats nothing; a disk that is
// still refused is set read-only again quietly at each rescan. A remove
// event drops the device's state and is passed to OnRemove.
type Watcher struct {
	// Groups to listen to; zero means kernel and udev. The kernel's event
	// comes first, so it is the one that triggers the decision; udev's
	// duplicate of a decided device is ignored.
	Groups   Group
	Classify Classifier
	// Match selects the devices to classify; nil means every whole block
	// device (subsystem block, devtype disk).
	Match func(Event) bool
	// Timeout bounds one classification; zero means one second.
	Timeout time.Duration
	// SysfsRoot is where the scans list the block devices; "" means /sys.
	SysfsRoot string
	// Rescan is the interval of the periodic rescan; zero means
	// DefaultRescan, negative turns it off (the scan at start and after
	// an overrun still run).
	Rescan time.Duration
	// Serialize, when set, is held around each classification and the
	// refusal that follows it, so that the caller can change what its
	// classifier reads (the agent records a stage of the disk) without a
	// refusal decided on the old state landing after the change.
	Serialize  sync.Locker
	OnDecision func(Decision)
	OnRemove   func(Event)
	Logger     *slog.Logger

	// setReadOnly is SetReadOnly; tests may wrap it.
	setReadOnly func(path string, major, minor uint32, ro bool) error
	// dial opens the event source (Dial); size reads a device's size
	// (BLKGETSIZE64). Tests replace them with fakes where the kernel
	// cannot be made to do what they need (drop events).
	dial func(Group) (source, error)
	size func(node string) (uint64, error)

	ready chan struct{}
	once  sync.Once
}

// source is what the Watcher reads events from: a Conn.
type source interface {
	Read() (Event, time.Time, error)
	SetReadDeadline(time.Time) error
	Close() error
}

type devnum struct{ major, minor uint32 }

// outcome is what OnDecision is told again only when it changes.
type outcome struct {
	refuse, failed bool
	holder         fence.Key
}

// known is the Watcher's state of one decided disk.
type known struct {
	ev  Event
	seq string // the kernel's DISKSEQ; "" on kernels without it
	out outcome
}

// Ready is closed once the socket listens and the disks present at start
// are decided: events after it are seen, and a disk attached before it is
// refused if it is held elsewhere.
func (w *Watcher) Ready() <-chan struct{} {
	w.once.Do(func() { w.ready = make(chan struct{}) })
	return w.ready
}

// run is one Run's settings and state.
type run struct {
	w       *Watcher
	timeout time.Duration
	log     *slog.Logger
	setRO   func(string, uint32, uint32, bool) error
	size    func(string) (uint64, error)
	match   func(Event) bool
	root    string
	known   map[devnum]*known
}

// Run listens until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	w.Ready()
	if w.Classify == nil {
		return errors.New("uevent watcher: no classifier")
	}
	r := w.newRun()
	// The socket listens before the scan, so that a disk attached during
	// the scan is heard of afterwards.
	c, err := w.dialSource()
	if err != nil {
		return err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	r.scan(ctx, CauseStart)
	if ctx.Err() != nil {
		return nil
	}
	close(w.ready)

	rescan := w.Rescan
	if rescan == 0 {
		rescan = DefaultRescan
	}
	var next time.Time
	if rescan > 0 {
		next = time.Now().Add(rescan)
	}
	for {
		if !next.IsZero() {
			if err := c.SetReadDeadline(next); err != nil {
				if ctx.Err() != nil {
					// Stopped: the context closed the socket.
					return nil
				}
				return fmt.Errorf("uevent watcher: setting the rescan deadline: %w", err)
			}
		}
		ev, at, err := c.Read()
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			r.scan(ctx, CausePeriodic)
			next = time.Now().Add(rescan)
		case errors.Is(err, ErrOverrun):
			// Events were lost: what they announced (a disk added,
			// changed or removed) is found by scanning every disk.
			r.log.Warn("uevent queue overrun; some device events were lost; classifying every disk again")
			r.scan(ctx, CauseOverrun)
		case err != nil:
			return err
		default:
			r.event(ctx, ev, at)
		}
	}
}

// newRun is a Run's settings, the watcher's with defaults filled in.
func (w *Watcher) newRun() *run {
	r := &run{w: w, timeout: w.Timeout, log: w.Logger, setRO: w.setReadOnly, size: w.size, match: w.Match,
		root: w.SysfsRoot, known: map[devnum]*known{}}
	if r.timeout <= 0 {
		r.timeout = time.Second
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if r.setRO == nil {
		r.setRO = SetReadOnly
	}
	if r.size == nil {
		r.size = deviceSize
	}
	if r.match == nil {
		r.match = func(ev Event) bool { return ev.Disk() }
	}
	if r.root == "" {
		r.root = "/sys"
	}
	return r
}

// dialSource opens the uevent socket for the watcher's groups (default:
// the kernel's and udev's).
func (w *Watcher) dialSource() (source, error) {
	groups := w.Groups
	if groups == 0 {
		groups = GroupKernel | GroupUdev
	}
	if w.dial != nil {
		return w.dial(groups)
	}
	return Dial(groups)
}

// event acts on one uevent heard at at: a disk removed is forgotten, a
// disk added or changed decided, unless its medium was decided already.
func (r *run) event(ctx context.Context, ev Event, at time.Time) {
	if !ev.HasDevnum || !r.match(ev) {
		return
	}
	dn := devnum{ev.Major, ev.Minor}
	switch ev.Action {
	case "remove":
		r.forget(dn, ev)
	case "add", "change":
		if k := r.known[dn]; k != nil && k.seq == ev.Env["DISKSEQ"] {
			// Decided for this medium already (udev's duplicate, a
			// resize, the agent's own change trigger); the rescans
			// look at it again.
			return
		}
		r.decide(ctx, ev, at, CauseEvent)
	}
}

// forget drops a disk that went away and tells OnRemove.
func (r *run) forget(dn devnum, ev Event) {
	delete(r.known, dn)
	if r.w.OnRemove != nil {
		r.w.OnRemove(ev)
	}
}

// scan classifies every matching disk under SysfsRoot/class/block, and
// forgets (OnRemove) a decided disk that is no longer listed.
func (r *run) scan(ctx context.Context, why Cause) {
	evs, err := scanBlock(r.root)
	if err != nil {
		r.log.Error("could not list the block devices; disks already attached are not checked until the next rescan",
			"cause", string(why), "err", err)
		return
	}
	present := map[devnum]bool{}
	for _, ev := range evs {
		if ctx.Err() != nil {
			return
		}
		if !ev.HasDevnum || !r.match(ev) {
			continue
		}
		present[devnum{ev.Major, ev.Minor}] = true
		r.decide(ctx, ev, time.Now(), why)
	}
	for dn, k := range r.known {
		if !present[dn] {
			gone := k.ev
			gone.Action = "remove"
			r.log.Info("a decided disk is gone without its remove event", "device", gone.Node(), "cause", string(why))
			r.forget(dn, gone)
		}
	}
}

// decide is the one classification routine of every path: a disk with a
// size is classified (under Serialize), refused if held elsewhere, and
// OnDecision hears of it when the disk is new or its outcome changed.
func (r *run) decide(ctx context.Context, ev Event, at time.Time, why Cause) {
	dn := devnum{ev.Major, ev.Minor}
	node := ev.Node()
	if node == "" {
		return
	}
	if size, err := r.size(node); err != nil || size == 0 {
		// No medium (a loop device without its file): nothing to decide
		// until one appears, and then it is new.
		delete(r.known, dn)
		return
	}
	d := Decision{Event: ev, Cause: why, Received: at}
	if r.w.Serialize != nil {
		r.w.Serialize.Lock()
	}
	cctx, cancel := context.WithTimeout(ctx, r.timeout)
	d.Verdict, d.Err = r.w.Classify(cctx, ev)
	cancel()
	if d.Err != nil {
		d.Err = fmt.Errorf("classifying %s (%d:%d): %w", node, ev.Major, ev.Minor, d.Err)
	} else if d.Verdict.Refuse {
		if err := r.setRO(node, ev.Major, ev.Minor, true); err != nil {
			d.Err = fmt.Errorf("refusing %s: %w", node, err)
		} else {
			d.ReadOnly = true
		}
	}
	if r.w.Serialize != nil {
		r.w.Serialize.Unlock()
	}
	d.Done = time.Now()
	if ctx.Err() != nil {
		return
	}
	out := outcome{refuse: d.Verdict.Refuse, failed: d.Err != nil}
	if out.refuse {
		out.holder = d.Verdict.Holder
	}
	k := &known{ev: ev, seq: ev.Env["DISKSEQ"], out: out}
	prev := r.known[dn]
	r.known[dn] = k
	if prev != nil && prev.seq == k.seq && prev.out == out {
		return
	}
	switch {
	case d.Err != nil && d.Verdict.Refuse:
		r.log.Error("could not set a refused disk read-only", "device", node, "cause", string(why), "error", d.Err)
	case d.Err != nil:
		r.log.Warn("could not classify a disk", "device", node, "cause", string(why), "error", d.Err)
	case d.Verdict.Refuse:
		r.log.Warn("disk refused", "device", node, "cause", string(why), "holder", d.Verdict.Holder.String(),
			"holder_node", d.Verdict.HolderNode, "reason", d.Verdict.Reason)
	}
	if r.w.OnDecision != nil {
		r.w.OnDecision(d)
	}
}

// scanBlock lists the block devices under root/class/block as the add
// events that announced them: the attributes of each device's uevent
// file (MAJOR, MINOR, DEVNAME, DEVTYPE, DISKSEQ), its DEVPATH, subsystem
// block and Source Scan.
func scanBlock(root string) ([]Event, error) {
	dir := filepath.Join(root, "class", "block")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", dir, err)
	}
	var evs []Event
	for _, e := range ents {
		link := filepath.Join(dir, e.Name())
		target, err := os.Readlink(link)
		if err != nil {
			continue
		}
		// The link is relative (../../devices/...) under /sys; a test's
		// tree may point into another sysfs: DEVPATH starts at /devices.
		devpath := filepath.Clean(filepath.Join("/class/block", target))
		if i := strings.Index(devpath, "/devices/"); i >= 0 {
			devpath = devpath[i:]
		} else {
			continue
		}
		b, err := os.ReadFile(filepath.Join(link, "uevent"))
		if err != nil {
			continue // gone meanwhile
		}
		msg := []byte("ACTION=add\x00DEVPATH=" + devpath + "\x00SUBSYSTEM=block\x00")
		msg = append(msg, bytes.ReplaceAll(b, []byte("\n"), []byte{0})...)
		ev, err := parseEnv(msg, Scan)
		if err != nil {
			continue
		}
		evs = append(evs, ev)
	}
	return evs, nil
}

func deviceSize(node string) (uint64, error) {
	fd, err := unix.Open(node, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	var sz uint64
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&sz))); e != 0 {
		return 0, e
	}
	return sz, nil
}
