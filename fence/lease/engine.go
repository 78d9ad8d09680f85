package lease

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sync"
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

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// errRetry asks Acquire to start over with a fresh read.
var errRetry = errors.New("retry")

// Acquire implements fence.Fencer; docs/fencing.md ("The on-disk lease")
// states the algorithm and its waits.
func (e *Engine) Acquire(ctx context.Context, grant *fence.Grant) (fence.Claim, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.acquireTries(ctx, grant, false)
}

// acquireTries is Acquire with e.mu held. first allows the fast first
// claim (AcquireFirst).
func (e *Engine) acquireTries(ctx context.Context, grant *fence.Grant, first bool) (fence.Claim, error) {
	if e.lost != nil {
		return fence.Claim{}, e.lost
	}
	if grant != nil {
		if err := grant.ForNode(e.cfg.Node, e.cfg.Disk); err != nil {
			return fence.Claim{}, fmt.Errorf("%s: takeover grant rejected: %w", e.dev.name, err)
		}
	}
	if err := e.verify(ctx); err != nil {
		return fence.Claim{}, err
	}
	start := time.Now()
	for attempt := 0; ; attempt++ {
		c, err := e.acquire(ctx, grant, first)
		if errors.Is(err, errRetry) && attempt < 4 {
			continue
		}
		if errors.Is(err, errRetry) {
			err = fmt.Errorf("%s: the lease kept changing while it was being acquired; try again", e.dev.name)
		}
		e.stats.AcquireWaited = time.Since(start)
		return c, err
	}
}

// AcquireFirst implements fence.FirstClaimer. The lease lives on the disk,
// so a clone of a disk in use, or a volume restored from a snapshot of
// one, starts with the source's held slots: claims on another disk, whose
// writers never renew here. Acquire would wait the expiry bound for each.
// Told that no node was given this disk before (the controller's word),
// the engine treats a held slot whose serial is set and is not this
// disk's as a copy at once, and any other held slot as a copy once it has
// stayed unchanged for its writer's renewal interval plus 2d, which a
// live holder's renewal cannot outlast. A slot that changes is a live
// holder: the disk is refused, as ever. The copies are then cleared and
// the disk acquired as usual.
//
// On a lease area whose slots are all empty from its first read (a new
// disk; not a clone whose copies it cleared, which may have been claims
// of hosts sharing the disk after all) the claim is the fast first claim:
// written to FastSlot, it is held as soon as it has landed within
// FastClaimWithin of the read it was based on, without the settle wait
// and second read. No
// other node was given the disk, so the only hosts that can race it are
// VMs a faulty platform attached the disk to besides ours, acquiring
// without the flag: none of them writes an empty FastSlot, and each checks
// its own claim after its settle wait, which our claim has landed before
// (docs/fencing.md, "The never-published fast path"). A claim that took
// longer settles and is checked as any other.
func (e *Engine) AcquireFirst(ctx context.Context) (fence.Claim, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost != nil || e.held {
		return e.acquireTries(ctx, nil, false)
	}
	cleared, err := e.clearCopies(ctx)
	if testHookFirstRead != nil {
		testHookFirstRead(e)
	}
	if err != nil {
		return fence.Claim{}, err
	}
	// Only a lease area that was blank from the start gets the fast
	// claim: the copies cleared may have been claims of hosts that share
	// the disk after all (docs/fencing.md).
	return e.acquireTries(ctx, nil, !cleared)
}

// clearCopies is AcquireFirst's part before the acquisition. It reports
// whether it found held slots to clear. Called with e.mu held.
func (e *Engine) clearCopies(ctx context.Context) (bool, error) {
	if err := e.verify(ctx); err != nil {
		return false, err
	}
	a, err := e.read(ctx)
	if err != nil {
		return false, err
	}
	ours := SlotSerial(e.cfg.Serial)
	var copies, watch []int
	bound := time.Duration(0)
	for i, s := range a.Slots {
		if !s.Live() || a.Corrupt[i] {
			continue
		}
		copies = append(copies, i)
		if ours != "" && s.Serial != "" && s.Serial != ours {
			continue
		}
		watch = append(watch, i)
		bound = max(bound, s.Timing.Renew+2*s.Timing.IOTimeout)
	}
	if len(copies) == 0 {
		return false, nil
	}
	if len(watch) > 0 {
		e.log.Info("the disk was given to no node before, yet carries held lease slots: watching them for a renewal",
			"slots", fmt.Sprint(watch), "bound", bound.String())
		if err := sleep(ctx, bound); err != nil {
			return true, fmt.Errorf("%s: watching lease slots copied from another disk: %w", e.dev.name, err)
		}
		a2, err := e.read(ctx)
		if err != nil {
			return true, err
		}
		for _, i := range watch {
			if !bytes.Equal(a2.Raw[i], a.Raw[i]) {
				s := a2.Slots[i]
				he := e.refusal(a2, s.Key, &s, nil)
				return true, fmt.Errorf("%w (the controller says no node was given this disk before, yet this holder renews its lease on it)", he)
			}
		}
		for i := range a2.Slots {
			if !bytes.Equal(a2.Raw[i], a.Raw[i]) {
				// Another host is claiming at the same time: the usual
				// acquisition sorts it out, with the copies left alone
				// (and waited for).
				e.log.Warn("the lease area changed while copied slots were watched; acquiring without clearing them", "slot", i)
				return true, nil
			}
		}
	}
	zero := make([]byte, BlockSize)
	for _, i := range copies {
		s := a.Slots[i]
		if err := e.dev.writeSlot(ctx, i, zero, e.cfg.Timing.IOTimeout); err != nil {
			return true, fmt.Errorf("%s: clearing lease slot %d copied from another disk: %w", e.dev.name, i, err)
		}
		e.log.Warn("cleared a lease slot copied from another disk", "slot", i, "key", s.Key.String(), "node", s.Node, "serial", s.Serial)
	}
	return true, nil
}

func (e *Engine) claim() fence.Claim {
	return fence.Claim{Method: fence.MethodLease, Key: e.cfg.Key}
}

// attempt is one acquisition attempt: the read its claim is based on, the
// holder it takes over and the claim it writes.
type attempt struct {
	grant *fence.Grant
	// fast: the fast first claim (AcquireFirst on a blank lease area).
	fast bool
	// a is the read the claim is based on, begun at readAt.
	a      *Area
	readAt time.Time
	// victim is the holder taken over, or -1; victimRaw and victimSlot
	// are its slot as first read, granted that the grant names it.
	victim     int
	victimRaw  []byte
	victimSlot Slot
	granted    bool
	// watch are the slots waited out before the claim.
	watch []int
	// The claim: slot idx, written as blk, its write issued at issued.
	idx    int
	s      Slot
	blk    []byte
	issued time.Time
}

// acquire is one attempt at the lease, in the steps of docs/fencing.md
// ("The on-disk lease"): read, settle a claim of ours still in flight,
// keep or resume our own claim, wait out the holders, write the claim,
// and hold it at once (the fast first claim) or after the settle wait and
// race check. errRetry starts it over.
func (e *Engine) acquire(ctx context.Context, grant *fence.Grant, first bool) (fence.Claim, error) {
	// A claim of ours still in flight, or a slot our late claim may have
	// erased, is settled the usual way.
	first = first && e.unconfirmed == nil && e.erased < 0
	at := &attempt{grant: grant, readAt: time.Now(), victim: -1}
	a, err := e.read(ctx)
	if err != nil {
		return fence.Claim{}, err
	}
	at.a = a
	at.fast = first && a.blank()
	if err := e.settleUnconfirmed(ctx, a); err != nil {
		return fence.Claim{}, err
	}
	if c, done, err := e.holdsAlready(ctx, a, at.readAt); done || err != nil {
		return c, err
	}
	e.findHolders(at)
	reclaim := e.pickSlot(a, at.victim, false) < 0
	if len(at.watch) > 0 {
		if at.a, at.readAt, err = e.awaitExpiry(ctx, a, at.watch, at.victim, grant); err != nil {
			return fence.Claim{}, err
		}
		e.erased = -1
	}
	if err := e.writeClaim(ctx, at, reclaim); err != nil {
		return fence.Claim{}, err
	}
	if at.fast {
		held, err := e.holdFast(ctx, at)
		if err != nil {
			return fence.Claim{}, err
		}
		if held {
			return e.claim(), nil
		}
	}
	a2, err := e.raceCheck(ctx, at)
	if err != nil {
		return fence.Claim{}, err
	}
	if err := e.holdAfterRacers(ctx, at, a2); err != nil {
		return fence.Claim{}, err
	}
	e.clearGone(ctx, a2, at.watch, at.idx)
	e.startRenewer()
	e.log.Info("lease acquired", "slot", at.idx, "epoch", at.s.Epoch)
	c := e.claim()
	if at.victim >= 0 {
		c.Preempted = []fence.Key{at.s.Supersedes}
	}
	return c, nil
}

// settleUnconfirmed settles a claim of ours whose write timed out by the
// read a: a claim that landed is withdrawn and the attempt starts over
// (errRetry).
func (e *Engine) settleUnconfirmed(ctx context.Context, a *Area) error {
	p := e.unconfirmed
	if p == nil {
		return nil
	}
	if !bytes.Equal(a.Raw[p.idx], p.blk) {
		e.unconfirmed = nil
		return nil
	}
	e.log.Warn("withdrawing our lease claim that landed after the I/O timeout", "slot", p.idx)
	if p.foreign {
		e.erased = p.idx
	}
	if e.withdraw(ctx, p.idx, p.slot, p.blk) {
		e.unconfirmed = nil
	}
	return errRetry
}

// holdsAlready answers an acquisition of a lease we hold, or whose record
// of ours, from an earlier run of the agent on this node, can be resumed;
// done is false when the lease is to be acquired anew.
func (e *Engine) holdsAlready(ctx context.Context, a *Area, readAt time.Time) (c fence.Claim, done bool, err error) {
	owner := a.Owner()
	if e.held {
		if lerr := e.verifyOwn(a); lerr != nil {
			return fence.Claim{}, true, lerr
		}
		c := e.claim()
		c.Already = true
		return c, true, nil
	}
	if owner < 0 || a.Slots[owner].Key != e.cfg.Key {
		return fence.Claim{}, false, nil
	}
	// Our own record, from an earlier run of the agent on this node.
	// It is resumed only while it cannot have expired in anyone's
	// eyes; both times come from this host's clock.
	s := a.Slots[owner]
	age := time.Since(time.Unix(0, s.Written))
	// Another held slot below ours may be a host our record
	// superseded that has not yet let go (an acquisition of ours,
	// cut short, that never waited for it): then the record is
	// not resumed but acquired again, waiting for that host.
	others := a.ownerExcept(e.cfg.Key) >= 0
	for i := range a.Corrupt {
		others = others || a.Corrupt[i]
	}
	if age >= 0 && age < e.cfg.Timing.Fail && !others {
		if err := e.resume(ctx, owner, a, readAt); err != nil {
			return fence.Claim{}, true, err
		}
		e.log.Info("lease resumed from an earlier run", "slot", owner, "epoch", s.Epoch, "age", age.String())
		c := e.claim()
		c.Already = true
		return c, true, nil
	}
	e.log.Info("own lease record is not resumed (too old, or another host's slot is held); acquiring anew", "age", age.String(), "others_held", others)
	return fence.Claim{}, false, nil
}

// findHolders sets the attempt's victim and the slots to wait out from
// its read.
func (e *Engine) findHolders(at *attempt) {
	a, mine := at.a, e.cfg.Key
	// The holder to take over is the highest held slot of another key,
	// even below a record of ours too old to resume: a host keeps writing
	// until its own renewal sees a claim above it.
	if v := a.ownerExcept(mine); v >= 0 {
		at.victim = v
		at.victimRaw, at.victimSlot = a.Raw[v], a.Slots[v]
		at.granted = at.grant.Names(a.Slots[v].Key)
	}
	victim := at.victim
	// Slots that do not decode may be a host's torn write; they are
	// waited for as a holder would be.
	if victim >= 0 && !at.granted {
		at.watch = append(at.watch, victim)
	}
	for i := range a.Corrupt {
		if a.Corrupt[i] || (i == e.erased && i != victim) {
			at.watch = append(at.watch, i)
		}
	}
	// Every other held slot may be a host that has not yet seen the claim
	// above it and still writes: it is waited out as the victim is (a
	// grant names the victim only). Slots waited out are cleared once we
	// hold the lease, so the next acquirer does not wait for them again.
	// With no free slot, one of them is reclaimed for our claim.
	for i := range a.Slots {
		if i != victim && a.Slots[i].Key != mine && a.Slots[i].Live() && !a.Corrupt[i] {
			at.watch = append(at.watch, i)
		}
	}
}

// writeClaim picks the slot for our claim (reclaiming a waited-out one
// when reclaim says none was free) and writes the claim there. A write
// that timed out may still land: it is settled by the next attempt
// (errRetry).
func (e *Engine) writeClaim(ctx context.Context, at *attempt, reclaim bool) error {
	t, mine, a, victim := e.cfg.Timing, e.cfg.Key, at.a, at.victim
	idx := e.pickSlot(a, victim, at.fast)
	if idx < 0 && reclaim {
		idx = e.reclaimSlot(a, victim)
	}
	if idx < 0 {
		return fmt.Errorf("%s: all %d lease slots are held by other hosts (see 'vco-agent lease show'); none can be used", e.dev.name, Slots)
	}
	if m := a.MaxEpoch(); m >= MaxSlotEpoch {
		// Only a slot written by something else than this agent's lease
		// code gets there; a claim above it would not decode.
		d := &DamagedError{Slot: -1, Field: "epoch", Detail: fmt.Sprintf("%d is the bound: no claim can be written above it", m)}
		for i, sl := range a.Slots {
			if sl.Epoch == m {
				d.Slot = i
			}
		}
		return fmt.Errorf("%s: %w", e.dev.name, d)
	}
	s := Slot{Key: mine, Epoch: a.MaxEpoch() + 1, Counter: a.Slots[idx].Counter + 1, State: StateHeld,
		Timing: t, Node: e.cfg.NodeName, Serial: SlotSerial(e.cfg.Serial)}
	if a.Slots[idx].Key != mine {
		s.Counter = 1
	}
	if victim >= 0 {
		s.Supersedes = a.Slots[victim].Key
		if at.granted {
			e.log.Warn("taking the lease over with a grant", "holder", s.Supersedes.String(), "holder_node", e.resolve(s.Supersedes, &a.Slots[victim]), "disk", at.grant.Disk)
		} else {
			e.log.Warn("taking over an expired lease", "holder", s.Supersedes.String(), "holder_node", e.resolve(s.Supersedes, &a.Slots[victim]))
		}
	}
	s.Written = time.Now().UnixNano()
	blk := EncodeSlot(s)
	issued := time.Now()
	if testHookClaimWrite != nil {
		testHookClaimWrite(e, idx, blk)
	}
	if err := e.dev.writeSlot(ctx, idx, blk, t.IOTimeout); err != nil {
		if errors.Is(err, errIOTimeout) {
			e.unconfirmed = &claimWrite{idx: idx, slot: s, blk: blk, foreign: a.Slots[idx].Key != mine}
			e.log.Warn("lease claim write timed out; starting over", "error", err)
			return errRetry
		}
		return err
	}
	at.idx, at.s, at.blk, at.issued = idx, s, blk, issued
	return nil
}

// holdFast holds the fast first claim (AcquireFirst) without the settle
// wait when it landed within FastClaimWithin of its read and is still the
// only claim; held is false when it is to settle as usual.
func (e *Engine) holdFast(ctx context.Context, at *attempt) (held bool, err error) {
	t, idx, s, blk := e.cfg.Timing, at.idx, at.s, at.blk
	// One more read, at once: this host's clock does not count a pause
	// of its VM between its read and its write, during which another
	// host may have written its claim and checked it before ours
	// landed. Any claim written before ours is seen here; any written
	// after is checked by its writer after ours landed.
	el := time.Since(at.readAt)
	var a1 *Area
	if el <= min(FastClaimWithin, t.IOTimeout) {
		if a1, err = e.read(ctx); err != nil {
			e.withdraw(ctx, idx, s, blk)
			return false, err
		}
	}
	if a1 != nil && a1.onlyClaim(idx, blk) {
		e.held, e.slot, e.mine, e.lastRaw, e.lastOK = true, idx, s, blk, at.issued
		e.storeHealth()
		e.stats.FastClaims++
		e.startRenewer()
		e.log.Info("lease acquired without the settle wait: a disk given to no node before, with a blank lease area", "slot", idx, "epoch", s.Epoch, "elapsed", el.String())
		return true, nil
	}
	e.log.Info("first claim of a blank lease area took longer than the fast path allows, or another claim appeared beside it; settling as usual",
		"elapsed", el.String(), "within", min(FastClaimWithin, t.IOTimeout).String())
	return false, nil
}

// raceCheck waits the settle time after our claim landed and reads the
// area again: the claim stands only if no other host won the slot, the
// lease or the victim's life meanwhile. A claim that does not stand is
// withdrawn. It returns the read.
func (e *Engine) raceCheck(ctx context.Context, at *attempt) (*Area, error) {
	t, idx, s, blk := e.cfg.Timing, at.idx, at.s, at.blk
	// The race check below holds only if our write landed within d of
	// the read it was based on.
	if el := time.Since(at.readAt); el > t.IOTimeout {
		e.withdraw(ctx, idx, s, blk)
		e.log.Warn("lease read and write took longer than the I/O timeout; starting over", "elapsed", el.String())
		return nil, errRetry
	}
	if err := sleep(ctx, t.Settle()); err != nil {
		e.withdraw(ctx, idx, s, blk)
		return nil, err
	}
	a2, err := e.read(ctx)
	if err != nil {
		e.withdraw(ctx, idx, s, blk)
		return nil, err
	}
	if !bytes.Equal(a2.Raw[idx], blk) {
		// Another host wrote the same slot after us: it won the slot.
		other := a2.Slots[idx]
		return nil, e.refusal(a2, other.Key, &other, at.grant)
	}
	if o := a2.Owner(); o != idx {
		e.withdraw(ctx, idx, s, blk)
		if o < 0 {
			// Our claim reads back as written, yet owns nothing: it
			// does not decode. Not reachable with the bounds the
			// claim's epoch keeps; a disk that gets here is refused.
			return nil, fmt.Errorf("%s: our claim in lease slot %d reads back as written but is not a claim; not holding the lease", e.dev.name, idx)
		}
		return nil, e.refusal(a2, a2.Slots[o].Key, &a2.Slots[o], at.grant)
	}
	if at.victim >= 0 && !at.granted && !bytes.Equal(a2.Raw[at.victim], at.victimRaw) && a2.alive(at.victim) {
		// The holder we found expired wrote again: it is alive after all
		// (a slot that changed and does not decode is a write in flight).
		e.withdraw(ctx, idx, s, blk)
		return nil, e.refusal(a2, at.victimSlot.Key, &at.victimSlot, at.grant)
	}
	if i := at.tornSince(a2); i >= 0 {
		// A slot caught half written: a racing claim may be landing
		// there, and who won cannot be told from this read.
		e.withdraw(ctx, idx, s, blk)
		e.log.Warn("a lease slot was being written during our race check; starting over", "slot", i)
		return nil, errRetry
	}
	return a2, nil
}

// tornSince is the first slot besides our claim and a granted victim
// that does not decode in a2 and changed since the attempt's read, or -1.
func (at *attempt) tornSince(a2 *Area) int {
	for i := range a2.Slots {
		if i != at.idx && !(i == at.victim && at.granted) && a2.Corrupt[i] && !bytes.Equal(a2.Raw[i], at.a.Raw[i]) {
			return i
		}
	}
	return -1
}

// holdAfterRacers holds the claim that passed the race check and waits
// for a granted victim and for every host whose claim raced ours to let
// go. If one does not, the claim is withdrawn.
func (e *Engine) holdAfterRacers(ctx context.Context, at *attempt, a2 *Area) error {
	idx, s, blk, victim := at.idx, at.s, at.blk, at.victim
	// A claim of another host that landed after the read ours was based
	// on raced ours. Its writer may have checked it before ours landed (a
	// host with a shorter I/O timeout has a shorter settle wait) and
	// believe it holds the disk; it lets go once its next renewal sees our
	// claim above its own. Wait for that, as for a granted victim.
	var racers []int
	for i := range a2.Slots {
		if i != idx && i != victim && a2.Slots[i].Live() && !a2.Corrupt[i] && a2.Slots[i].Key != e.cfg.Key && !bytes.Equal(a2.Raw[i], at.a.Raw[i]) {
			racers = append(racers, i)
		}
	}
	e.held, e.slot, e.mine, e.lastRaw, e.lastOK = true, idx, s, blk, at.issued
	e.storeHealth()
	if victim >= 0 && at.granted {
		racers = append([]int{victim}, racers...)
	}
	for _, i := range racers {
		vs := a2.Slots[i]
		if i == victim {
			// As found expired or granted: its slot may be torn now.
			vs = at.victimSlot
		} else {
			e.log.Warn("another host's claim landed while ours settled; waiting for it to let go", "slot", i, "key", vs.Key.String())
		}
		if err := e.awaitVictim(ctx, i, vs, a2); err != nil {
			e.held = false
			e.storeHealth()
			e.withdraw(ctx, idx, s, blk)
			return err
		}
	}
	return nil
}

// awaitExpiry watches the slots in watch until each has stayed unchanged
// for the expiry bound of its writer. It returns the last read. A watched
// holder that writes again is alive: the disk is refused. A holder that
// releases ends the wait at once (errRetry starts over on the new state).
func (e *Engine) awaitExpiry(ctx context.Context, a *Area, watch []int, victim int, grant *fence.Grant) (*Area, time.Time, error) {
	bound, poll := e.expiryBound(a, watch, victim)
	e.log.Info("waiting for the lease to expire", "bound", bound.String(), "slots", fmt.Sprint(watch))
	began := time.Now()
	for {
		remain := bound - time.Since(began)
		if err := sleep(ctx, min(poll, max(remain, 0))); err != nil {
			return nil, time.Time{}, fmt.Errorf("%s: waiting for the lease to expire: %w", e.dev.name, err)
		}
		readAt := time.Now()
		a2, err := e.read(ctx)
		if err != nil {
			// A missed observation loses nothing (changes are compared
			// with the first read), but the wait cannot end on one.
			if !errors.Is(err, errIOTimeout) || time.Since(began) >= 2*bound {
				return nil, time.Time{}, err
			}
			e.log.Warn("lease read failed while waiting for expiry; continuing", "error", err)
			continue
		}
		if err := e.stillExpiring(a, a2, watch, victim, grant); err != nil {
			return nil, time.Time{}, err
		}
		if time.Since(began) >= bound {
			return a2, readAt, nil
		}
	}
}

// expiryBound is how long awaitExpiry waits for the slots in watch, and
// how often it reads.
func (e *Engine) expiryBound(a *Area, watch []int, victim int) (bound, poll time.Duration) {
	poll = e.cfg.Timing.Renew
	for _, i := range watch {
		tm := a.Slots[i].Timing
		if a.Corrupt[i] {
			tm = e.tornTiming(a.Raw[i])
		}
		if i == e.erased && tm.Expiry() < e.cfg.Timing.Expiry() {
			tm = e.cfg.Timing
		}
		bound = max(bound, tm.Expiry())
		poll = min(poll, tm.Renew)
	}
	// A slot written by this agent renews no faster than MinIOTimeout;
	// one claiming to must not make us read the disk more often. A
	// change is seen by any read after it, so a slower poll only sees it
	// later.
	poll = max(poll, MinIOTimeout)
	// A held slot below the victim may be a host that has not yet seen
	// the claim above it (its next renewal will, or its watchdog resets
	// it): wait for the longest expiry among them too.
	if victim >= 0 {
		for i, s := range a.Slots {
			if s.Live() && !a.Corrupt[i] && s.Key != e.cfg.Key {
				bound = max(bound, s.Timing.Expiry())
			}
		}
	}
	return bound, poll
}

// stillExpiring judges a read a2 of awaitExpiry against its first read a:
// a holder other than the victim is refused, a watched slot that was
// written again is refused (or released: errRetry), and any other slot
// written since starts over (errRetry).
func (e *Engine) stillExpiring(a, a2 *Area, watch []int, victim int, grant *fence.Grant) error {
	if o := a2.Owner(); o >= 0 && o != victim && a2.Slots[o].Key != e.cfg.Key {
		return e.refusal(a2, a2.Slots[o].Key, &a2.Slots[o], grant)
	}
	for _, i := range watch {
		if bytes.Equal(a2.Raw[i], a.Raw[i]) {
			continue
		}
		if !a2.Slots[i].Live() && !a2.Corrupt[i] {
			return errRetry
		}
		s := a2.Slots[i]
		return e.refusal(a2, s.Key, &s, grant)
	}
	for i := range a2.Slots {
		if i == victim || slices.Contains(watch, i) || bytes.Equal(a2.Raw[i], a.Raw[i]) || !a2.alive(i) ||
			(!a2.Corrupt[i] && a2.Slots[i].Key == e.cfg.Key) {
			continue
		}
		// A slot that was not held when the wait began (a granted
		// victim renews as it likes) has been written since: a
		// claim, or one caught half landed, which
		// owns nothing in this read and whose epoch MaxEpoch does
		// not see, yet may own the disk. Start over: the fresh read
		// waits for it.
		e.log.Warn("a lease slot was written while we waited for expiry; starting over", "slot", i)
		return errRetry
	}
	return nil
}

// tornTiming is the timing a slot that does not decode is waited for
// with: ours, or the one its bytes still carry, whichever has the longer
// expiry bound. A torn write's first sector, where the timing is, is its
// writer's (new or previous write), and that writer may be a holder with
// a longer bound than ours, frozen with its renewal half written.
func (e *Engine) tornTiming(raw []byte) Timing {
	own := e.cfg.Timing
	if len(raw) < 64 || string(raw[0:8]) != slotMagic {
		return own
	}
	be := binary.BigEndian
	t := Timing{IOTimeout: fromMS(be.Uint32(raw[48:])), Renew: fromMS(be.Uint32(raw[52:])),
		Fail: fromMS(be.Uint32(raw[56:])), Watchdog: fromMS(be.Uint32(raw[60:]))}
	if t.validate() != nil || t.Expiry() <= own.Expiry() {
		return own
	}
	return t
}

// awaitVictim waits, after a granted takeover was written, until the
// superseded holder has acknowledged (its slot says released or fenced)
// or has not written for its expiry bound. A live holder sees our higher
// epoch at its next renewal, stops I/O and acknowledges.
func (e *Engine) awaitVictim(ctx context.Context, victim int, vs Slot, a *Area) error {
	bound := vs.Timing.Expiry()
	lastRaw := a.Raw[victim]
	changed := time.Now()
	for {
		// A slot that does not decode is the holder's write caught half
		// landed, never an acknowledgement.
		if !a.alive(victim) {
			e.log.Info("superseded holder acknowledged the takeover", "holder", vs.Key.String(), "state", a.Slots[victim].State.String())
			return nil
		}
		if time.Since(changed) >= bound {
			e.log.Info("superseded holder's lease expired", "holder", vs.Key.String(), "bound", bound.String())
			return nil
		}
		// Polled faster than either renews: the holder lets go at its
		// next renewal, and each poll after that is time the taker's
		// volume waits for nothing. Never faster than the fastest
		// GrantPoll (MinIOTimeout/2), whatever a slot claims: a slot
		// renewed more often was not written by this agent.
		poll := max(min(vs.Timing.Renew, e.cfg.Timing.GrantPoll()), MinIOTimeout/2)
		if err := sleep(ctx, poll); err != nil {
			return fmt.Errorf("%s: waiting for key %s to let go of the lease: %w", e.dev.name, vs.Key, err)
		}
		a2, err := e.read(ctx)
		if errors.Is(err, errIOTimeout) {
			if l := e.deadline(); l != nil {
				return l
			}
			e.log.Warn("lease read failed while waiting for the superseded holder; continuing", "error", err)
			continue
		}
		if err != nil {
			return err
		}
		if lerr := e.verifyOwn(a2); lerr != nil {
			return e.refusalFromLoss(a2, lerr)
		}
		if !bytes.Equal(a2.Raw[victim], lastRaw) {
			lastRaw, changed = a2.Raw[victim], time.Now()
		}
		a = a2
		// Keep our own slot fresh while we wait, once a renewal interval
		// (not at every poll).
		if time.Since(e.lastOK)+poll < e.cfg.Timing.Renew {
			continue
		}
		if err := e.renewLocked(ctx, a2); err != nil {
			return err
		}
	}
}

func (e *Engine) refusalFromLoss(a *Area, l *fence.LostError) error {
	if o := a.Owner(); o >= 0 {
		return e.refusal(a, a.Slots[o].Key, &a.Slots[o], nil)
	}
	return l
}

// pickSlot chooses our slot: the one already carrying our key, else the
// first empty one in an order derived from the key, so that hosts tend
// not to compete for the same slot, else the first released or fenced one
// of another key. A slot of another key is the last choice: its host may
// be claiming it again right now (its new claim goes to the slot that
// carries its key), and of two claims written to one slot the later
// erases the earlier, which its writer may already hold. Held slots of
// other hosts are reused only through reclaimSlot, after their expiry
// bound.
//
// An empty FastSlot is written only by a fast first claim (fast): a host
// that did not see that claim in its read, and so may race it, never
// picks the same slot, where the later of two claims would erase the
// fast one unseen.
func (e *Engine) pickSlot(a *Area, victim int, fast bool) int {
	if i := a.Find(e.cfg.Key); i >= 0 {
		return i
	}
	if fast {
		return FastSlot
	}
	start := e.slotOrder()
	for _, empty := range []bool{true, false} {
		for j := range Slots {
			i := (start + j) % Slots
			if i == victim || a.Corrupt[i] || a.Slots[i].Live() || (empty && a.Slots[i].State != StateEmpty) ||
				(i == FastSlot && a.Slots[i].State == StateEmpty) {
				continue
			}
			return i
		}
	}
	return -1
}

// clearGone clears the slots of other hosts that the acquisition just
// waited out for their expiry bound (and that a is the last read of), if
// they still hold what was waited on: held slots, and slots that do not
// decode (a write torn by its host's reset). Those hosts have stopped
// their I/O or been reset; a write of theirs landing later makes the slot
// held (or torn) again, and the next acquirer waits for it as before.
// Called with the lease held; a failure only costs the next acquirer a
// wait.
//
// A slot that does not decode in a is one the race check found unchanged
// since the read the wait ended on (tornSince), and the wait found it
// unchanged since its first read: it stayed as it is for its expiry
// bound, which a live writer's next write cannot outlast.
func (e *Engine) clearGone(ctx context.Context, a *Area, gone []int, ours int) {
	zero := make([]byte, BlockSize)
	for _, i := range gone {
		if i == ours || (!a.Corrupt[i] && !a.Slots[i].Live()) {
			continue
		}
		b, err := e.dev.ReadArea(ctx, e.cfg.Timing.IOTimeout)
		if err != nil || !bytes.Equal(b[BlockSize*(1+i):BlockSize*(2+i)], a.Raw[i]) {
			continue
		}
		if err := e.dev.writeSlot(ctx, i, zero, e.cfg.Timing.IOTimeout); err != nil {
			e.log.Warn("could not clear the lease slot of a holder that is gone", "slot", i, "error", err)
			continue
		}
		if a.Corrupt[i] {
			e.log.Info("cleared a lease slot that did not decode and stayed unchanged for its expiry bound (a write torn by its host's reset)", "slot", i)
			continue
		}
		e.log.Info("cleared the lease slot of a holder gone for its expiry bound", "slot", i, "key", a.Slots[i].Key.String(), "node", a.Slots[i].Node)
	}
}

// slotOrder is where this key starts looking for a slot.
func (e *Engine) slotOrder() int {
	h := fnv.New32a()
	fmt.Fprint(h, uint64(e.cfg.Key))
	return int(h.Sum32() % Slots)
}

// reclaimSlot picks a held slot of another host, other than the victim's,
// or a slot that does not decode (a write torn by its host's reset), that
// awaitExpiry has just seen unchanged for its writer's expiry bound (a
// holder that died, on a disk whose every slot is used). A write that
// the gone holder had in flight and that lands later can only overwrite
// our claim, which we then lose: safe, if slower. Hosts racing for the
// same slot see each other's claim in the settle check.
func (e *Engine) reclaimSlot(a *Area, victim int) int {
	start := e.slotOrder()
	for j := range Slots {
		i := (start + j) % Slots
		if i == victim || (!a.Corrupt[i] && (a.Slots[i].Key == e.cfg.Key || (i == FastSlot && a.Slots[i].State == StateEmpty))) {
			continue
		}
		e.log.Warn("every lease slot is used; reclaiming the slot of a holder gone for its expiry bound", "slot", i,
			"key", a.Slots[i].Key.String(), "node", a.Slots[i].Node, "torn", a.Corrupt[i])
		return i
	}
	return -1
}

// withdraw marks a slot we wrote during a failed acquisition released, if
// it still holds what we wrote. When it cannot tell or cannot write, the
// claim is kept as unconfirmed: the next acquisition's read withdraws it
// then, and it is never resumed as ours.
func (e *Engine) withdraw(ctx context.Context, idx int, s Slot, blk []byte) bool {
	keep := &claimWrite{idx: idx, slot: s, blk: blk}
	b, err := e.dev.ReadArea(context.WithoutCancel(ctx), e.cfg.Timing.IOTimeout)
	if err != nil {
		e.unconfirmed = keep
		return false
	}
	if !bytes.Equal(b[BlockSize*(1+idx):BlockSize*(2+idx)], blk) {
		return true
	}
	s.State = StateReleased
	s.Counter++
	s.Written = time.Now().UnixNano()
	if err := e.dev.writeSlot(context.WithoutCancel(ctx), idx, EncodeSlot(s), e.cfg.Timing.IOTimeout); err != nil {
		e.log.Warn("could not withdraw our lease record after a failed acquisition", "slot", idx, "error", err)
		e.unconfirmed = keep
		return false
	}
	return true
}

// testHookClaimWrite, when set by a test, runs just before a claim is
// written to slot idx.
var testHookClaimWrite func(e *Engine, idx int, blk []byte)

// testHookFirstRead, when set by a test, runs when AcquireFirst has read
// the lease area (and cleared any copies), before it claims.
var testHookFirstRead func(e *Engine)

func (e *Engine) refusal(a *Area, holder fence.Key, s *Slot, grant *fence.Grant) *fence.HeldError {
	he := &fence.HeldError{Device: e.dev.name, Holder: holder, HolderNode: e.resolve(holder, s), Granted: grant != nil}
	for i, sl := range a.Slots {
		if sl.Live() && !a.Corrupt[i] && sl.Key != e.cfg.Key {
			he.Registered = append(he.Registered, sl.Key)
		}
	}
	e.log.Warn("disk refused", "holder", holder.String(), "holder_node", he.HolderNode)
	return he
}

// resume takes over our own record from an earlier run: rewrite it with
// the next counter and start renewing.
func (e *Engine) resume(ctx context.Context, idx int, a *Area, readAt time.Time) error {
	s := a.Slots[idx]
	e.slot, e.mine, e.lastRaw, e.lastOK = idx, s, a.Raw[idx], readAt
	e.held = true
	if err := e.renewLocked(ctx, a); err != nil {
		e.held = false
		e.storeHealth()
		return err
	}
	// The resumed record was written without an acquisition's settle
	// wait. Between our read and our write the record may have been ended
	// (the previous engine of this node lost the lease and marked the
	// slot fenced) and another host may have claimed the free disk; its
	// claim shows within 2d, as in an acquisition's race check.
	fail := func(err error) error {
		e.held = false
		e.storeHealth()
		return err
	}
	if err := sleep(ctx, e.cfg.Timing.Settle()); err != nil {
		return fail(err)
	}
	a2, err := e.read(ctx)
	if err != nil {
		return fail(err)
	}
	// Our record is left as it is, never withdrawn: the host may be
	// writing under it, and a taker is to wait for its expiry bound.
	if !e.ownRaw(a2.Raw[idx]) || a2.Owner() != idx {
		if o := a2.Owner(); o >= 0 && o != idx {
			return fail(e.refusal(a2, a2.Slots[o].Key, &a2.Slots[o], nil))
		}
		return fail(fmt.Errorf("%s: our lease record changed while it was being resumed: %w", e.dev.name, errRetry))
	}
	e.startRenewer()
	return nil
}

// ownRaw reports whether raw, our slot as just read, holds our last
// write: the last confirmed one, or a timed-out one that landed after all
// (which then becomes the last). A read waits for the device's earlier
// requests, so it settles a pending write either way. The late write does
// not move lastOK: its issue time counts as a renewal only had it
// completed within d.
func (e *Engine) ownRaw(raw []byte) bool {
	p := e.pending
	e.pending = nil
	if p != nil && bytes.Equal(raw, p.blk) {
		e.mine, e.lastRaw = p.slot, p.blk
		return true
	}
	return bytes.Equal(raw, e.lastRaw)
}

// verifyOwn checks a read against our claim.
func (e *Engine) verifyOwn(a *Area) *fence.LostError {
	if !e.ownRaw(a.Raw[e.slot]) {
		if o := a.Owner(); o >= 0 && a.Slots[o].Key != e.cfg.Key {
			// A taker that waited out our expiry bound clears our slot.
			s := a.Slots[o]
			return e.markLost(fmt.Sprintf("key %s holds the lease at epoch %d, and our slot was cleared or overwritten", s.Key, s.Epoch), s.Key, &s)
		}
		s := a.Slots[e.slot]
		if s.Key != e.cfg.Key && s.Key != 0 {
			return e.markLost(fmt.Sprintf("our lease slot was overwritten by key %s", s.Key), s.Key, &s)
		}
		return e.markLost("our lease slot changed under us (another path or host wrote it)", 0, nil)
	}
	if o := a.Owner(); o != e.slot {
		if o < 0 {
			return e.markLost("no slot holds the lease any more", 0, nil)
		}
		s := a.Slots[o]
		return e.markLost(fmt.Sprintf("key %s holds the lease at epoch %d, above ours (%d)", s.Key, s.Epoch, e.mine.Epoch), s.Key, &s)
	}
	return nil
}

// renewLocked rewrites our slot with the next counter after a read that
// verified it.
func (e *Engine) renewLocked(ctx context.Context, a *Area) error {
	if lerr := e.verifyOwn(a); lerr != nil {
		return lerr
	}
	// Never write past our own deadline: a taker may be about to
	// conclude that we expired.
	if lerr := e.deadline(); lerr != nil {
		return lerr
	}
	s := e.mine
	s.Counter++
	s.Written = time.Now().UnixNano()
	blk := EncodeSlot(s)
	issued := time.Now()
	if err := e.dev.writeSlot(ctx, e.slot, blk, e.cfg.Timing.IOTimeout); err != nil {
		e.stats.RenewFailures++
		e.renewErr = err
		// A slow or failing disk, not a lost claim: the write may
		// still land (after a timeout, or in spite of an error).
		e.pending = &claimWrite{idx: e.slot, slot: s, blk: blk}
		return err
	}
	e.mine, e.lastRaw, e.lastOK, e.renewErr = s, blk, issued, nil
	e.storeHealth()
	e.stats.Renewals++
	e.stats.LastRenewal = time.Now()
	return nil
}

// markLost records the loss (once), stops renewing and hands the loss to
// OnLost. Called with e.mu held.
func (e *Engine) markLost(reason string, holder fence.Key, s *Slot) *fence.LostError {
	if e.lost != nil {
		return e.lost
	}
	l := &fence.LostError{Device: e.dev.name, Reason: reason, Holder: holder}
	if holder != 0 {
		l.HolderNode = e.resolve(holder, s)
	}
	e.lost = l
	wasHeld := e.held
	e.held = false
	e.storeHealth()
	if e.renewer != nil {
		e.renewer.signal()
		e.renewer = nil
	}
	e.log.Error("lease lost", "reason", reason, "holder", holder.String())
	if wasHeld && e.cfg.OnLost != nil {
		go func() {
			defer close(e.handled)
			if e.cfg.OnLost(l) {
				h := e.Health()
				h.Drained = true
				e.health.Store(&h)
				e.ackFenced()
			} else {
				e.log.Warn("I/O to the disk could not be shown to have stopped; the slot is not marked fenced, so a taker waits for the expiry bound")
			}
		}()
	} else {
		close(e.handled)
	}
	return l
}

// LossHandled is closed once a loss has been handled: OnLost has returned
// and, when it reported the I/O stopped, the slot has been marked fenced
// (or that write failed). A process that exits on a loss waits for it
// first: a granted taker proceeds on the mark, and without it waits for
// the expiry bound.
func (e *Engine) LossHandled() <-chan struct{} { return e.handled }

// ackFenced marks our slot fenced after I/O was stopped and drained (the
// OnLost contract), if the slot still holds our last write. Stopping I/O
// usually sets the whole disk read-only, which refuses this write too, so
// the flag is lifted for it and set again: nothing else of this host can
// write to the disk by then.
func (e *Engine) ackFenced() {
	e.mu.Lock()
	defer e.mu.Unlock()
	ctx := context.Background()
	b, err := e.dev.ReadArea(ctx, e.cfg.Timing.IOTimeout)
	if err != nil || e.slot < 0 || !e.ownRaw(b[BlockSize*(1+e.slot):BlockSize*(2+e.slot)]) {
		return
	}
	s := e.mine
	s.State = StateFenced
	s.Counter++
	s.Written = time.Now().UnixNano()
	blk := EncodeSlot(s)
	if err := e.dev.writeSlotPastReadOnly(ctx, e.slot, blk, e.cfg.Timing.IOTimeout); err != nil {
		e.log.Warn("could not mark our lease slot fenced; a taker waits for the expiry bound", "error", err)
		return
	}
	e.mine, e.lastRaw = s, blk
	e.log.Info("lease slot marked fenced: I/O stopped, a granted taker may proceed")
}

// MarkLost records a loss found outside the engine. From then on Acquire
// and Check fail with the returned error.
func (e *Engine) MarkLost(reason string) *fence.LostError {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.markLost(reason, 0, nil)
}

// Lost returns the recorded loss, or nil.
func (e *Engine) Lost() *fence.LostError {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lost
}

// Check implements fence.Fencer: the claim is intact when the last
// successful renewal is younger than Fail, our slot holds what we last
// wrote, and no slot owns the lease above us. It does not write.
func (e *Engine) Check(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stats.Checks++
	if e.lost != nil {
		return e.lost
	}
	if !e.held {
		return fmt.Errorf("%s: this engine holds no lease; acquire first", e.dev.name)
	}
	if err := e.verify(ctx); err != nil {
		return err
	}
	// Read before looking at the deadline, so that a loss names the new
	// holder when there is one.
	a, err := e.readOnce(ctx)
	if err == nil {
		if lerr := e.verifyOwn(a); lerr != nil {
			return lerr
		}
	}
	if lerr := e.deadline(); lerr != nil {
		return lerr
	}
	return err
}

func (e *Engine) deadline() *fence.LostError {
	if since := time.Since(e.lastOK); since > e.cfg.Timing.Fail {
		reason := fmt.Sprintf("no successful lease renewal for %s (fail bound %s)", since.Round(time.Millisecond), e.cfg.Timing.Fail)
		if e.renewErr != nil {
			reason += fmt.Sprintf("; the last one failed: %v", e.renewErr)
		}
		return e.markLost(reason, 0, nil)
	}
	return nil
}

// Resume takes back, after an agent restart, the claim an earlier process
// of this node recorded and handed off (Handoff) or left when it died. The
// host still has the volume mounted and writing, so nothing is waited for
// and nothing is withdrawn: the record is resumed in place only while our
// slot still owns the lease and was renewed within the fail bound F (the
// rule of a renewal, and of the engine's claim on it); past F the host was
// to have stopped its I/O, and other nodes count their expiry bound from
// there. Anything else is a lost claim (the caller
// stops the host's I/O; our slot stays as it is, so a taker waits for the
// expiry bound or the fenced mark). A read that fails is returned as it
// is, for a retry; a record that changed while it was resumed (a write of
// the earlier process landing late) is read again a few times.
func (e *Engine) Resume(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost != nil {
		return e.lost
	}
	if e.held {
		return nil
	}
	if err := e.verify(ctx); err != nil {
		return err
	}
	for attempt := 0; ; attempt++ {
		err := e.resumeOnce(ctx)
		if errors.Is(err, ErrDamaged) {
			// Not a read to retry: the area stays as it is until
			// something rewrites it, and the record cannot be verified.
			var d *DamagedError
			errors.As(err, &d)
			return &fence.LostError{Device: e.dev.name, Reason: d.Error()}
		}
		if !errors.Is(err, errRetry) {
			var held *fence.HeldError
			if errors.As(err, &held) {
				return &fence.LostError{Device: e.dev.name, Holder: held.Holder, HolderNode: held.HolderNode, Reason: held.Error()}
			}
			return err
		}
		if attempt == 3 {
			return &fence.LostError{Device: e.dev.name, Reason: "our lease record kept changing while it was resumed"}
		}
	}
}

// resumeOnce is one attempt of Resume, with e.mu held.
func (e *Engine) resumeOnce(ctx context.Context) error {
	readAt := time.Now()
	a, err := e.read(ctx)
	if err != nil {
		return err
	}
	owner := a.Owner()
	switch {
	case owner < 0:
		return &fence.LostError{Device: e.dev.name, Reason: "the lease is no longer held by this node (released or fenced while the agent was down)"}
	case a.Slots[owner].Key != e.cfg.Key:
		s := a.Slots[owner]
		return &fence.LostError{Device: e.dev.name, Holder: s.Key, HolderNode: e.resolve(s.Key, &s),
			Reason: fmt.Sprintf("the lease was taken over by key %s while the agent was down", s.Key)}
	}
	s := a.Slots[owner]
	age := time.Since(time.Unix(0, s.Written))
	if age < 0 || age >= e.cfg.Timing.Fail {
		return &fence.LostError{Device: e.dev.name,
			Reason: fmt.Sprintf("this node's lease was last renewed %s ago, beyond the fail bound %s: other nodes may have taken it as expired", age.Round(time.Millisecond), e.cfg.Timing.Fail)}
	}
	// Slots below ours, held or torn, are what a renewal ignores too: the
	// claim being resumed was a completed one (its stage had waited them
	// out), and a claim landing above ours shows in the resume's second
	// read or at a later renewal, as for any live holder.
	if err := e.resume(ctx, owner, a, readAt); err != nil {
		return err
	}
	e.log.Info("lease resumed from an earlier run", "slot", owner, "epoch", s.Epoch, "age", age.String())
	return nil
}

// Handoff stops the renewals and renews the held lease one last time,
// leaving it held on the disk: a process that stops while its host keeps
// the volume in use (an agent restart, an upgrade) hands its record to the
// next one with its age counting from now, not from up to R before, so
// the next process has nearly the whole fail bound to resume it. It is a
// renewal like the others (read, verify, deadline, write), so a claim
// found lost here is lost as it would be a moment later. A lease not held,
// or paused, is left as it is.
func (e *Engine) Handoff(ctx context.Context) error {
	e.stopRenewer()
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.held || e.paused {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*e.cfg.Timing.IOTimeout)
	defer cancel()
	a, err := e.readOnce(ctx)
	if err == nil {
		err = e.renewLocked(ctx, a)
	}
	if err != nil {
		return fmt.Errorf("%s: the last renewal before the agent stops: %w", e.dev.name, err)
	}
	return nil
}

// Release implements fence.Fencer: stop renewing and mark our slot
// released, so the next holder need not wait. A disk without our record
// is released without error.
func (e *Engine) Release(ctx context.Context) error {
	e.stopRenewer()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.held = false
	e.storeHealth()
	if err := e.verify(ctx); err != nil {
		return err
	}
	a, err := e.read(ctx)
	if err != nil {
		return err
	}
	// The read settled any claim write that timed out; a claim of ours
	// that landed is released below like any other.
	e.unconfirmed = nil
	i := a.Find(e.cfg.Key)
	if i < 0 || !a.Slots[i].Live() {
		return nil
	}
	s := a.Slots[i]
	s.State = StateReleased
	s.Counter++
	s.Written = time.Now().UnixNano()
	blk := EncodeSlot(s)
	if err := e.writeReleased(ctx, i, blk); err != nil {
		return fmt.Errorf("%s: releasing the lease: %w", e.dev.name, err)
	}
	if i == e.slot {
		e.mine, e.lastRaw = s, blk
	}
	e.log.Info("lease released", "slot", i)
	return nil
}

// writeReleased writes a released slot. No deadline runs against a
// release, and until its write lands the next holder waits out our whole
// expiry bound, so a write that timed out (a slow disk, a loaded host) is
// tried again. The same block written twice is harmless: the device lock
// keeps the two in order.
func (e *Engine) writeReleased(ctx context.Context, i int, blk []byte) error {
	err := e.dev.writeSlot(ctx, i, blk, e.cfg.Timing.IOTimeout)
	for try := 1; try < 3 && errors.Is(err, errIOTimeout); try++ {
		e.log.Warn("lease release write timed out; writing again", "error", err)
		err = e.dev.writeSlot(ctx, i, blk, e.cfg.Timing.IOTimeout)
	}
	return err
}

// chanLock is a mutex made of a channel. The engine holds its lock across
// lease I/O and the waits of an acquisition; a goroutine waiting for it is
// then blocked on a channel, which the schedule simulator's fake clock
// (testing/synctest, sim_test.go) can tell from a running one.
type chanLock chan struct{}

func (l chanLock) Lock()   { l <- struct{}{} }
func (l chanLock) Unlock() { <-l }

// renewer is the goroutine that renews a held lease.
type renewer struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

func (r *renewer) signal()      { r.once.Do(func() { close(r.stop) }) }
func (r *renewer) stopAndWait() { r.signal(); <-r.done }

// stopRenewer stops the renewer, if one runs, and waits for it to end;
// called without e.mu, which a renewal in progress holds.
func (e *Engine) stopRenewer() {
	e.mu.Lock()
	r := e.renewer
	e.renewer = nil
	e.mu.Unlock()
	if r != nil {
		r.stopAndWait()
	}
}

func (e *Engine) startRenewer() {
	r := &renewer{stop: make(chan struct{}), done: make(chan struct{})}
	e.renewer = r
	go e.renew(r)
}

// renew rewrites our slot every Renew and declares the claim lost when no
// renewal succeeded for Fail; the timer fires at that deadline even when
// renewals keep failing or hang.
func (e *Engine) renew(r *renewer) {
	defer close(r.done)
	t := time.NewTimer(e.cfg.Timing.Renew)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
		}
		e.mu.Lock()
		if e.renewer != r {
			e.mu.Unlock()
			return
		}
		next := e.cfg.Timing.Renew
		if !e.paused {
			ctx, cancel := context.WithTimeout(context.Background(), 2*e.cfg.Timing.IOTimeout)
			a, err := e.readOnce(ctx)
			if err == nil {
				err = e.renewLocked(ctx, a)
			} else {
				e.stats.RenewFailures++
				e.renewErr = err
				if l := e.deadline(); l != nil {
					err = l
				}
			}
			cancel()
			var lost *fence.LostError
			if errors.As(err, &lost) {
				e.mu.Unlock()
				return
			}
			if err != nil {
				e.log.Warn("lease renewal failed", "error", err, "deadline_in", (e.cfg.Timing.Fail - time.Since(e.lastOK)).String())
			}
			next = min(next, max(e.cfg.Timing.Fail-time.Since(e.lastOK), 0)+time.Millisecond)
		}
		e.mu.Unlock()
		t.Reset(next)
	}
}

// Status is the lease state of a disk, for display.
type Status struct {
	Device   string     `json:"device"`
	OwnKey   fence.Key  `json:"own_key"`
	Owner    *Slot      `json:"owner,omitempty"`
	Slots    []SlotInfo `json:"slots"`
	VolumeID string     `json:"volume_id"`
}

// SlotInfo is one used slot.
type SlotInfo struct {
	Index int `json:"index"`
	Slot
	Corrupt bool `json:"corrupt,omitempty"`
}

// ReadStatus reads the lease area once.
func ReadStatus(ctx context.Context, d *Device, own fence.Key, timeout time.Duration) (Status, *Area, error) {
	b, err := d.ReadArea(ctx, timeout)
	if err != nil {
		return Status{}, nil, err
	}
	a, err := DecodeArea(b)
	if err != nil {
		return Status{}, nil, fmt.Errorf("%s: %w", d.name, err)
	}
	st := Status{Device: d.name, OwnKey: own, VolumeID: fmt.Sprintf("%x", a.Header.VolumeID)}
	if o := a.Owner(); o >= 0 {
		s := a.Slots[o]
		st.Owner = &s
	}
	for i, s := range a.Slots {
		if s.State != StateEmpty || a.Corrupt[i] {
			st.Slots = append(st.Slots, SlotInfo{Index: i, Slot: s, Corrupt: a.Corrupt[i]})
		}
	}
	return st, a, nil
}

// Inspect reads the lease area of path once, through its own O_DIRECT
// descriptor, and returns the owning slot: nil when nobody holds the
// lease, an error wrapping ErrNoLease when the disk has no lease area.
// It is the quick look a hot-plug refusal needs: one read, no waiting. An
// owner found here may have expired; refusing it is still right, since
// only a stage request (Acquire, which waits) may take the disk.
func Inspect(ctx context.Context, path string, timeout time.Duration) (*Slot, error) {
	d, err := OpenDeviceReadOnly(path)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	b, err := d.ReadArea(ctx, timeout)
	if err != nil {
		return nil, err
	}
	a, err := DecodeArea(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if o := a.Owner(); o >= 0 {
		s := a.Slots[o]
		return &s, nil
	}
	return nil, nil
}
