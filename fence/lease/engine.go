package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Config is what an Engine needs besides the device.
type Config struct {
	// Key is this node's fence key (fence.KeyFromUUID of its SMBIOS UUID).
	Key fence.Key
	// Node is this node's SMBIOS UUID; a grant must name it.
	Node string
	// NodeName is written into the slot so that other nodes can name us
	// in refusals; optional, at most 64 bytes are kept.
	NodeName string
	// Disk is the cloud disk id, when known; a grant must then name it.
	Disk string
	// Serial is the disk's serial number as this host sees it, when
	// known. It is written into our slot, so that a copy of the slot in a
	// clone of the disk can be told from a claim on the clone itself
	// (AcquireFirst).
	Serial string
	// Resolver names the node behind a foreign key; optional.
	Resolver fence.Resolver
	// Timing; the zero value means DefaultTiming().
	Timing Timing
	// OnLost is called once, from its own goroutine, when the claim is
	// lost: it must stop I/O to the volume at once (set the disk
	// read-only, shut the filesystem down). It returns true only when,
	// besides, every write this host had issued to the disk has
	// completed or failed and nothing but the engine can write to it any
	// more. The engine then marks its slot fenced, the acknowledgement
	// that lets a granted taker proceed without waiting for the full
	// expiry; it lifts the disk's read-only flag for that one write and
	// sets it again. On false (or with no OnLost) the slot is left alone
	// and the taker waits for the expiry bound.
	OnLost func(*fence.LostError) (stopped bool)
	// Verify, if set, runs before every operation and aborts it on error
	// (discovery's Opened.Verify).
	Verify func(ctx context.Context) error
	Logger *slog.Logger
}

// Engine holds the lease on one device for one node. It implements
// fence.Fencer. It is safe for concurrent use.
type Engine struct {
	dev *Device
	cfg Config
	log *slog.Logger

	mu      chanLock
	held    bool
	slot    int
	mine    Slot
	lastRaw []byte
	// lastOK is when the last successful write of our slot was issued
	// (monotonic clock). The claim is lost Fail after it.
	lastOK time.Time
	lost   *fence.LostError
	// renewErr is why the last renewal failed, nil after one succeeded;
	// a loss to the fail bound names it.
	renewErr error
	renewer  *renewer
	// paused stops renewals without releasing: tests use it to play a
	// holder whose process is frozen.
	paused bool
	stats  Stats
	// unconfirmed is a claim whose write timed out: it may still land.
	// The next read settles it (a read waits for the device's earlier
	// requests), and a claim that landed is withdrawn, never resumed: its
	// racers' settle waits assumed it would land within the I/O timeout.
	unconfirmed *claimWrite
	// erased is the slot a claim of ours landed in late, over what the
	// read it was based on showed as empty or another key's, or -1. The
	// late write may have erased the claim of a host that picked the same
	// slot and holds the disk since its own check; that host lets go only
	// at its next renewal. The next acquisition waits out that slot, as a
	// dead holder's, before it takes the disk for free.
	erased int
	// pending is a renewal (or resume) write of our slot that timed out
	// or failed: it may still land, or have landed. Until a read settles it, our slot may hold
	// either our last confirmed write or this one; neither is a change by
	// another host.
	pending *claimWrite
	// health is what Health returns, stored at each change of held,
	// lastOK or lost, so that it is read without e.mu.
	health atomic.Pointer[Health]
	// handled is closed once a loss has been handled (LossHandled).
	handled chan struct{}
}

// Health is the engine's state as a host watchdog's feeder needs it. It
// is read without the engine's lock, which an acquisition holds for as
// long as it waits.
type Health struct {
	// Held: the engine holds the lease and renews it.
	Held bool
	// RenewedAt is when the last successful write of our slot was issued
	// (this host's monotonic clock); the claim is lost Fail after it.
	RenewedAt time.Time
	// Fail is the fail bound F.
	Fail time.Duration
	// Lost: the claim was lost; Drained: and OnLost reported that every
	// write of this host to the disk has completed or failed.
	Lost, Drained bool
}

// Health returns the engine's state without waiting for its lock.
func (e *Engine) Health() Health {
	if h := e.health.Load(); h != nil {
		return *h
	}
	return Health{Fail: e.cfg.Timing.Fail}
}

// storeHealth records the state for Health. Called with e.mu held, after
// held, lastOK or lost changed.
func (e *Engine) storeHealth() {
	old := e.Health()
	e.health.Store(&Health{Held: e.held, RenewedAt: e.lastOK, Fail: e.cfg.Timing.Fail, Lost: e.lost != nil, Drained: old.Drained})
}

type claimWrite struct {
	idx  int
	slot Slot
	blk  []byte
	// foreign: the slot did not carry our key when the claim was written.
	foreign bool
}

// Stats count what the engine did, for metrics.
type Stats struct {
	Renewals      uint64
	RenewFailures uint64
	Checks        uint64
	LastRenewal   time.Time
	AcquireWaited time.Duration
	// FastClaims counts fast first claims (AcquireFirst on a blank lease
	// area, held without the settle wait).
	FastClaims uint64
}

var _ fence.Fencer = (*Engine)(nil)

// New returns an engine on an opened device.
func New(dev *Device, cfg Config) (*Engine, error) {
	if cfg.Key == 0 {
		return nil, errors.New("lease: fence key is zero; derive it with fence.KeyFromUUID")
	}
	if cfg.Timing == (Timing{}) {
		cfg.Timing = DefaultTiming()
	}
	if err := cfg.Timing.validate(); err != nil {
		return nil, err
	}
	if cfg.Timing.IOTimeout < MinIOTimeout {
		// Not a rule of validate: a slot written by such a host still
		// decodes, and is waited for as usual.
		return nil, fmt.Errorf("lease timing %s: the I/O timeout must be at least %s", cfg.Timing, MinIOTimeout)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Engine{dev: dev, cfg: cfg, slot: -1, erased: -1, mu: make(chanLock, 1), handled: make(chan struct{}), log: log.With("device", dev.name, "key", cfg.Key.String())}, nil
}

// Device returns the engine's device.
func (e *Engine) Device() *Device { return e.dev }

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

func (e *Engine) verify(ctx context.Context) error {
	if e.cfg.Verify == nil {
		return nil
	}
	if err := e.cfg.Verify(ctx); err != nil {
		return fmt.Errorf("%s: not acting on the device: %w", e.dev.name, err)
	}
	return nil
}

// read reads the area, trying again when a read times out: nothing is
// decided on a read that did not complete. Callers that time their reads
// start the clock before calling, so a retry only makes them more
// cautious.
func (e *Engine) read(ctx context.Context) (*Area, error) {
	return e.readTries(ctx, 3)
}

// readOnce is one read, for the renewer and Check: they run against the
// fail deadline, which a retried read could overshoot by more than d.
func (e *Engine) readOnce(ctx context.Context) (*Area, error) {
	return e.readTries(ctx, 1)
}

func (e *Engine) readTries(ctx context.Context, tries int) (*Area, error) {
	b, err := e.dev.ReadArea(ctx, e.cfg.Timing.IOTimeout)
	for i := 1; i < tries && errors.Is(err, errIOTimeout); i++ {
		e.log.Warn("lease read timed out; reading again", "error", err)
		b, err = e.dev.ReadArea(ctx, e.cfg.Timing.IOTimeout)
	}
	if err != nil {
		return nil, err
	}
	a, err := DecodeArea(b)
	if errors.Is(err, ErrNoLease) {
		return nil, fmt.Errorf("%s: %w: %w (format it; blank disks only)", e.dev.name, fence.ErrNotSupported, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", e.dev.name, err)
	}
	return a, nil
}

func (e *Engine) resolve(k fence.Key, s *Slot) string {
	if e.cfg.Resolver != nil {
		if n, ok := e.cfg.Resolver.NodeForKey(k); ok {
			return n
		}
	}
	if s != nil && s.Key == k {
		return s.Node
	}
	return ""
}

// Probe implements fence.Fencer: the lease can fence any disk that
// carries our lease area or is blank (and will be formatted); a disk with
// foreign data cannot be.
func (e *Engine) Probe(ctx context.Context) (fence.Support, error) {
	if err := e.verify(ctx); err != nil {
		return fence.Support{}, err
	}
	c, err := ReadLayout(ctx, e.dev, e.cfg.Timing.IOTimeout)
	if err != nil {
		return fence.Support{}, err
	}
	switch c.Layout {
	case LayoutLease:
		return fence.Support{Method: fence.MethodLease}, nil
	case LayoutBlank:
		return fence.Support{Method: fence.MethodLease, Reason: "blank disk: the lease area is written when the volume is first staged"}, nil
	}
	return fence.Support{Method: fence.MethodNone, Reason: fmt.Sprintf("no lease area and the disk holds data (%s)", c.Signature)}, nil
}
