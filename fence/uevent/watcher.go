package uevent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// Decision is what the Watcher did about one event.
type Decision struct {
	Event Event
	// Received is when the triggering uevent was read from the socket.
	Received time.Time
	Verdict  Verdict
	// ReadOnly: the device was set read-only and read back so.
	ReadOnly bool
	// Err is a classification or refusal failure.
	Err error
	// Done is when the decision (and the refusal, if any) was complete.
	Done time.Time
}

// Watcher classifies every disk that appears and refuses those held
// elsewhere, without being asked: on the first add or change event at
// which the disk has a size (a hot-plugged virtio or SCSI disk has one at
// add; a loop device only once its backing file is attached), the
// classifier runs, bounded by Timeout, and a refusal sets the device
// read-only before OnDecision hears of it. A remove event drops the
// device's state and is passed to OnRemove.
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
	Timeout    time.Duration
	OnDecision func(Decision)
	OnRemove   func(Event)
	Logger     *slog.Logger

	// setReadOnly is SetReadOnly; tests may wrap it.
	setReadOnly func(path string, major, minor uint32, ro bool) error

	ready chan struct{}
	once  sync.Once
}

type devnum struct{ major, minor uint32 }

// Ready is closed once the socket listens: events after it are seen.
func (w *Watcher) Ready() <-chan struct{} {
	w.once.Do(func() { w.ready = make(chan struct{}) })
	return w.ready
}

// Run listens until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	w.Ready()
	if w.Classify == nil {
		return errors.New("uevent watcher: no classifier")
	}
	groups := w.Groups
	if groups == 0 {
		groups = GroupKernel | GroupUdev
	}
	timeout := w.Timeout
	if timeout <= 0 {
		timeout = time.Second
	}
	log := w.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	setRO := w.setReadOnly
	if setRO == nil {
		setRO = SetReadOnly
	}
	match := w.Match
	if match == nil {
		match = func(ev Event) bool { return ev.Disk() }
	}
	c, err := Dial(groups)
	if err != nil {
		return err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	close(w.ready)

	decided := map[devnum]bool{}
	for {
		ev, at, err := c.Read()
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrOverrun) {
			// Events were lost; the agent's periodic rescan catches
			// what they announced.
			log.Warn("uevent queue overrun; some device events were lost")
			continue
		}
		if err != nil {
			return err
		}
		if !ev.HasDevnum || !match(ev) {
			continue
		}
		dn := devnum{ev.Major, ev.Minor}
		switch ev.Action {
		case "remove":
			delete(decided, dn)
			if w.OnRemove != nil {
				w.OnRemove(ev)
			}
		case "add", "change":
			if decided[dn] {
				continue
			}
			d, ok := w.decide(ctx, ev, at, timeout, setRO, log)
			if !ok {
				continue
			}
			decided[dn] = true
			if w.OnDecision != nil {
				w.OnDecision(d)
			}
		}
	}
}

// decide classifies one device; ok is false when there is nothing to
// decide yet (the device has no size).
func (w *Watcher) decide(ctx context.Context, ev Event, at time.Time, timeout time.Duration,
	setRO func(string, uint32, uint32, bool) error, log *slog.Logger) (Decision, bool) {
	d := Decision{Event: ev, Received: at}
	node := ev.Node()
	if node == "" {
		return d, false
	}
	size, err := deviceSize(node)
	if err != nil || size == 0 {
		return d, false
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	d.Verdict, d.Err = w.Classify(cctx, ev)
	cancel()
	if d.Err != nil {
		d.Err = fmt.Errorf("classifying %s (%d:%d): %w", node, ev.Major, ev.Minor, d.Err)
		log.Warn("could not classify a new disk", "device", node, "error", d.Err)
	} else if d.Verdict.Refuse {
		if err := setRO(node, ev.Major, ev.Minor, true); err != nil {
			d.Err = fmt.Errorf("refusing %s: %w", node, err)
			log.Error("could not set a refused disk read-only", "device", node, "error", err)
		} else {
			d.ReadOnly = true
			log.Warn("disk refused", "device", node, "holder", d.Verdict.Holder.String(), "holder_node", d.Verdict.HolderNode, "reason", d.Verdict.Reason)
		}
	}
	d.Done = time.Now()
	return d, true
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
