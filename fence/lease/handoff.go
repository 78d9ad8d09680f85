package lease

// Letting the lease go on purpose: the resume after a restart, the
// hand-off to a new agent process, the release.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

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

// ErrNotRetakable is Retake's answer for a lease it leaves as it is.
var ErrNotRetakable = errors.New("the lease is not this node's alone to take back")

// Retake acquires anew the lease whose record of ours still owns it but
// was renewed too long ago to be resumed (Resume's loss past the fail
// bound F), for a caller that knows nothing of the volume is in use on
// this host (it rebooted since, and proved it). Past F other nodes may
// count their expiry bound from our last renewal; what makes this safe is
// that nothing of ours writes, and that the retake is an acquisition as
// any other (the claim written above every slot, the settle wait, the
// race check), which a taker's claim landing meanwhile wins or refuses.
// Only a lease whose every held slot is ours, none torn, is retaken, so
// nothing is waited for: another host's held or torn slot answers
// ErrNotRetakable, as does an engine that holds or lost its claim. So
// does another host's claim above our record, released or fenced since:
// that host claimed the lease after us (a granted takeover leaves the
// victim's record held below its claim), so the volume moved, and only
// the controller's grant gives it back.
func (e *Engine) Retake(ctx context.Context) (fence.Acquired, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.held || e.lost != nil {
		return fence.Acquired{}, fmt.Errorf("%s: %w (the engine already holds or lost its claim)", e.dev.name, ErrNotRetakable)
	}
	if err := e.verify(ctx); err != nil {
		return fence.Acquired{}, err
	}
	a, err := e.read(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	owner := a.Owner()
	switch {
	case owner < 0 || a.Slots[owner].Key != e.cfg.Key:
		return fence.Acquired{}, fmt.Errorf("%s: %w (no held record of ours owns it)", e.dev.name, ErrNotRetakable)
	case a.ownerExcept(e.cfg.Key) >= 0:
		return fence.Acquired{}, fmt.Errorf("%s: %w (another host's slot is held)", e.dev.name, ErrNotRetakable)
	}
	if i := a.claimedAbove(owner); i >= 0 {
		return fence.Acquired{}, fmt.Errorf("%s: %w (key %s claimed the lease after our record, slot %d, now %s: the volume moved)",
			e.dev.name, ErrNotRetakable, a.Slots[i].Key, i, a.Slots[i].State)
	}
	for i := range a.Corrupt {
		if a.Corrupt[i] {
			return fence.Acquired{}, fmt.Errorf("%s: %w (slot %d does not decode: a torn write is waited for as a holder)", e.dev.name, ErrNotRetakable, i)
		}
	}
	return e.acquireTries(ctx, nil, false)
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

// claimedAbove is a slot of another key whose claim has a higher epoch
// than slot own's, whatever its state now (held, released, fenced), or -1:
// a host that claimed the lease after own's claim.
func (a *Area) claimedAbove(own int) int {
	for i, s := range a.Slots {
		if i != own && !a.Corrupt[i] && s.State != StateEmpty && s.Key != a.Slots[own].Key && s.Epoch > a.Slots[own].Epoch {
			return i
		}
	}
	return -1
}
