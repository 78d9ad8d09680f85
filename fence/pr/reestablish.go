package pr

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

var _ fence.Reestablisher = (*Engine)(nil)

// Reestablish implements fence.Reestablisher: after Check found the target
// empty (no registration, no reservation), it registers and reserves again
// with the claim's type, if and only if the target shows that nobody else
// registered since it started. docs/fencing.md gives the steps and why
// the result is safe. On success the engine holds the disk again
// and Check passes; otherwise the claim stays lost and the returned
// *fence.LostError says why, naming a foreign key when one appeared.
func (e *Engine) Reestablish(ctx context.Context) (fence.Acquired, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost == nil {
		return fence.Acquired{}, fmt.Errorf("%s: the claim is not lost; there is nothing to re-establish", e.name)
	}
	if !e.forgotten {
		return fence.Acquired{}, e.lost
	}
	e.reestablishing = true
	defer func() { e.reestablishing = false }()
	mine := e.cfg.Key
	typ, err := e.reestablishType(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	st, err := e.read(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	if reason := untouchedSinceStart(st, mine); reason != "" {
		return fence.Acquired{}, e.refuseReestablish(reason, st)
	}
	base := st.gen
	e.log.Warn("the target forgot every registration and reservation (restarted); re-establishing this node's claim", "type", typ.String())
	if st, err = e.registerAgain(ctx, base); err != nil {
		return fence.Acquired{}, err
	}
	if err := e.reserveAgain(ctx, typ, base, st); err != nil {
		return fence.Acquired{}, err
	}
	e.lost, e.forgotten = nil, false
	e.held, e.watch, e.typ = true, true, typ
	e.log.Warn("claim re-established after the target forgot it", "type", typ.String())
	return fence.Acquired{Method: fence.MethodPR, Key: mine, Type: typ}, nil
}

// reestablishType is the reservation type to reserve again with: the
// claim's, or the target's preferred one.
func (e *Engine) reestablishType(ctx context.Context) (fence.ReservationType, error) {
	// The probe waits out the unit attentions a restarted target queues
	// for every new I_T nexus (29/00 POWER ON, RESET); the device retries
	// them.
	sup, err := e.probePR(ctx)
	if errors.Is(err, fence.ErrNotSupported) {
		return 0, e.refuseReestablish(err.Error(), state{})
	}
	if err != nil {
		return 0, err
	}
	typ := e.typ
	if typ == 0 {
		typ = sup.Preferred
	}
	return typ, nil
}

// untouchedSinceStart says why st is not a target untouched since it
// started (no key, no reservation, generation 0), or "" when it is.
func untouchedSinceStart(st state, mine fence.Key) string {
	switch {
	case len(st.foreign(mine)) > 0 || st.res.Present:
		return fmt.Sprintf("after the target forgot this node's claim, keys %v and %s appeared before it was re-established", st.keys, describeReservation(st.res))
	case len(st.keys) > 0:
		return fmt.Sprintf("this node's key %s is registered again, but not by this engine (another path or process?); not re-establishing over it", mine)
	case st.gen != 0 || st.res.Generation != 0:
		return fmt.Sprintf("the target holds no registration, but its PR generation is %d (READ KEYS) / %d (READ RESERVATION), not 0: registrations came and went since it started, so another node may have held the disk", st.gen, st.res.Generation)
	}
	return ""
}

// registerAgain registers our key on the untouched target at generation
// base and returns the state read after it, which must show our key
// alone at base+1.
func (e *Engine) registerAgain(ctx context.Context, base uint32) (state, error) {
	mine := e.cfg.Key
	// REGISTER, not REGISTER AND IGNORE EXISTING KEY: with a reservation
	// key of 0 it succeeds only on a nexus that carries no registration.
	err := e.out(ctx, scsi.PROut{Action: scsi.Register, ServiceActionKey: uint64(mine)})
	if err != nil && !errors.Is(err, scsi.ErrReservationConflict) {
		return state{}, fmt.Errorf("%s: registering key %s again: %w", e.name, mine, err)
	}
	st, rerr := e.read(ctx)
	if rerr != nil {
		return state{}, rerr
	}
	if err != nil || !st.onlyOurs(mine, true, base+1) || st.res.Present {
		e.dropRegistration(ctx, st)
		return state{}, e.refuseReestablish(fmt.Sprintf("while this node registered again, the target changed: keys %v, %s, PR generation %d (want %d with only key %s)",
			st.keys, describeReservation(st.res), st.gen, base+1, mine), st)
	}
	return st, nil
}

// reserveAgain reserves with typ after registerAgain left st, and checks
// that the read after it shows our key alone holding that reservation.
func (e *Engine) reserveAgain(ctx context.Context, typ fence.ReservationType, base uint32, st state) error {
	mine := e.cfg.Key
	err := e.out(ctx, scsi.PROut{Action: scsi.Reserve, Type: uint8(typ), Key: uint64(mine)})
	if err != nil && !errors.Is(err, scsi.ErrReservationConflict) {
		e.dropRegistration(ctx, st)
		return fmt.Errorf("%s: reserving (%s) again: %w", e.name, typ, err)
	}
	st, rerr := e.read(ctx)
	if rerr != nil {
		return rerr
	}
	ours := st.res.Present && !st.allRegistrants() && st.holder() == mine && fence.ReservationType(st.res.Type) == typ
	if err != nil || !ours || !st.onlyOurs(mine, true, base+1) {
		// Holding the reservation, we keep it: the foreign key registered
		// against a disk that is ours, and must not get it without a
		// grant. Without it, we leave nothing behind.
		if !ours {
			e.dropRegistration(ctx, st)
		}
		return e.refuseReestablish(fmt.Sprintf("while this node reserved again, the target changed: keys %v, %s, PR generation %d (want %d with only key %s holding a %s reservation)",
			st.keys, describeReservation(st.res), st.gen, base+1, mine, typ), st)
	}
	return nil
}

// onlyOurs reports whether s is a state a re-establish may build on: only
// our own key (registered or not, as want), both reads at generation gen.
func (s state) onlyOurs(mine fence.Key, registered bool, gen uint32) bool {
	return len(s.foreign(mine)) == 0 && s.registered(mine) == registered &&
		s.gen == gen && s.res.Generation == gen
}

// refuseReestablish makes the loss final with the reason found, naming
// the first foreign key (the reservation holder when there is one).
func (e *Engine) refuseReestablish(reason string, st state) *fence.LostError {
	mine := e.cfg.Key
	l := &fence.LostError{Device: e.name, Reason: reason}
	if st.res.Present && !st.allRegistrants() && st.holder() != mine {
		l.Holder = st.holder()
	} else if f := st.foreign(mine); len(f) > 0 {
		l.Holder = f[0]
	}
	if l.Holder != 0 {
		l.HolderNode = e.resolve(l.Holder)
	}
	e.lost, e.forgotten = l, false
	e.log.Error("claim not re-established", "reason", reason, "holder", l.Holder.String())
	return l
}

// dropRegistration removes our key from this nexus after a re-establish
// that did not get the reservation, when a read showed it registered.
// Best effort: the loss is what gets reported.
func (e *Engine) dropRegistration(ctx context.Context, st state) {
	if !st.registered(e.cfg.Key) {
		return
	}
	if err := e.unregister(ctx); err != nil {
		e.log.Warn("could not remove this node's registration after a failed re-establish", "error", err)
	}
}
