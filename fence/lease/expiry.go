package lease

// The waits of an acquisition: another holder's slot is taken only once
// it has gone unrenewed past its expiry bound (or a grant names it).

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

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
