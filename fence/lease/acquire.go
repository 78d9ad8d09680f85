package lease

// Taking the lease: the acquisition (a claim written, then the race check
// that makes two writers see each other, and the wait that settles it).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

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
func (e *Engine) Acquire(ctx context.Context, grant *fence.Grant) (fence.Acquired, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.acquireTries(ctx, grant, false)
}

// acquireTries is Acquire with e.mu held. first allows the fast first
// claim (AcquireFirst).
func (e *Engine) acquireTries(ctx context.Context, grant *fence.Grant, first bool) (fence.Acquired, error) {
	if e.lost != nil {
		return fence.Acquired{}, e.lost
	}
	if grant != nil {
		if err := grant.ForNode(e.cfg.Node, e.cfg.Disk); err != nil {
			return fence.Acquired{}, fmt.Errorf("%s: takeover grant rejected: %w", e.dev.name, err)
		}
	}
	if err := e.verify(ctx); err != nil {
		return fence.Acquired{}, err
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
func (e *Engine) AcquireFirst(ctx context.Context) (fence.Acquired, error) {
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
		return fence.Acquired{}, err
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

func (e *Engine) claim() fence.Acquired {
	return fence.Acquired{Method: fence.MethodLease, Key: e.cfg.Key}
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
func (e *Engine) acquire(ctx context.Context, grant *fence.Grant, first bool) (fence.Acquired, error) {
	// A claim of ours still in flight, or a slot our late claim may have
	// erased, is settled the usual way.
	first = first && e.unconfirmed == nil && e.erased < 0
	at := &attempt{grant: grant, readAt: time.Now(), victim: -1}
	a, err := e.read(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	at.a = a
	at.fast = first && a.blank()
	if err := e.settleUnconfirmed(ctx, a); err != nil {
		return fence.Acquired{}, err
	}
	if c, done, err := e.holdsAlready(ctx, a, at.readAt); done || err != nil {
		return c, err
	}
	e.findHolders(at)
	reclaim := e.pickSlot(a, at.victim, false) < 0
	if len(at.watch) > 0 {
		if at.a, at.readAt, err = e.awaitExpiry(ctx, a, at.watch, at.victim, grant); err != nil {
			return fence.Acquired{}, err
		}
		e.erased = -1
	}
	if err := e.writeClaim(ctx, at, reclaim); err != nil {
		return fence.Acquired{}, err
	}
	if at.fast {
		held, err := e.holdFast(ctx, at)
		if err != nil {
			return fence.Acquired{}, err
		}
		if held {
			return e.claim(), nil
		}
	}
	a2, err := e.raceCheck(ctx, at)
	if err != nil {
		return fence.Acquired{}, err
	}
	if err := e.holdAfterRacers(ctx, at, a2); err != nil {
		return fence.Acquired{}, err
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
func (e *Engine) holdsAlready(ctx context.Context, a *Area, readAt time.Time) (c fence.Acquired, done bool, err error) {
	owner := a.Owner()
	if e.held {
		if lerr := e.verifyOwn(a); lerr != nil {
			return fence.Acquired{}, true, lerr
		}
		c := e.claim()
		c.Already = true
		return c, true, nil
	}
	if owner < 0 || a.Slots[owner].Key != e.cfg.Key {
		return fence.Acquired{}, false, nil
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
			return fence.Acquired{}, true, err
		}
		e.log.Info("lease resumed from an earlier run", "slot", owner, "epoch", s.Epoch, "age", age.String())
		c := e.claim()
		c.Already = true
		return c, true, nil
	}
	e.log.Info("own lease record is not resumed (too old, or another host's slot is held); acquiring anew", "age", age.String(), "others_held", others)
	return fence.Acquired{}, false, nil
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
