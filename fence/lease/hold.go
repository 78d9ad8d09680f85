package lease

// Holding the lease: resuming and renewing our own slot, the checks that
// find it lost, and what a loss does (the claim is never re-taken).

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

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
