// Package pr fences a disk with SCSI-3 persistent reservations. Its Engine
// implements fence.Fencer for one device and one node key, following the
// flow of docs/fencing.md (modelled on ClusterLabs fence_scsi): read before
// writing, register with REGISTER AND IGNORE EXISTING KEY, reserve with a
// type under which a registered non-holder cannot write, refuse a foreign
// holder unless a grant names its key, take over with PREEMPT AND ABORT
// (falling back to PREEMPT), and re-read after every step to verify that the
// target did what was asked.
//
// A target that keeps reservations in memory only (tgt has no APTPL)
// forgets them when it restarts. Engine.Reestablish (fence.Reestablisher)
// takes such a claim back only when the target's own state proves that
// nobody else registered since it started (no key, no reservation, PR
// generation 0), and AcquireWaiting (fence.WaitingAcquirer) gives the
// holder the time to do so before another node claims a target in that
// state whose disk holds data. docs/fencing.md ("SCSI-3 persistent
// reservations") states the steps, why two nodes never both count the
// disk as theirs, and what the target cannot protect meanwhile.
//
// The engine talks to the device through scsi.Transport, so its decisions
// are unit-tested against a model of the target (fence/scsi/scsitest) and
// proven against a real target in the lab.
package pr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// Config is what an Engine needs besides the device.
type Config struct {
	// Key is this node's fence key (fence.KeyFromUUID of its SMBIOS UUID).
	Key fence.Key
	// Node is this node's SMBIOS UUID; a grant must name it.
	Node string
	// Disk is the cloud disk id, when known; a grant must then name it.
	Disk string
	// Resolver names the node behind a foreign key in refusals; optional.
	Resolver fence.Resolver
	// Prefer is the reservation type to use when the target supports it:
	// fence.WriteExclusive (the default) or fence.ExclusiveAccess. Write
	// Exclusive lets a refused node still read the disk (udev's probing,
	// blkid), which does no harm; Exclusive Access forbids that too.
	Prefer fence.ReservationType
	// Logger receives one line per decision; nil discards.
	Logger *slog.Logger
	// Timeout bounds each SCSI command; zero means scsi.DefaultTimeout.
	Timeout time.Duration
	// UnitAttentionRetries bounds reissuing a command after UNIT ATTENTION;
	// zero means scsi.DefaultUnitAttentionRetries.
	UnitAttentionRetries int
	// ReadyAttempts bounds TEST UNIT READY while the unit reports NOT READY,
	// becoming ready; ReadyDelay is the pause between attempts. Defaults 10
	// and 200ms.
	ReadyAttempts int
	ReadyDelay    time.Duration
	// Verify, if set, runs before every operation and aborts it on error:
	// wire it to discovery's Opened.Verify so the engine never acts on a
	// device node that is no longer the disk it was opened as.
	Verify func(ctx context.Context) error
}

// Engine fences one device for one node. It is safe for concurrent use;
// operations are serialized.
type Engine struct {
	name string
	dev  *scsi.Device
	cfg  Config
	log  *slog.Logger

	mu sync.Mutex
	// watch: a unit attention saying our reservation or registration was
	// preempted means the claim is lost (set while we hold the disk, and
	// during Check). Before we hold it, such a unit attention is stale news
	// about an earlier claim.
	watch bool
	held  bool
	lost  *fence.LostError
	// typ is the type of the reservation we hold or last held, for
	// re-establishing it as it was.
	typ fence.ReservationType
	// forgotten: the loss was found by Check reading a target with no
	// registration and no reservation at all (see Reestablish).
	forgotten bool
	// reestablishing: a Reestablish is running; a preemption reported now
	// stops it.
	reestablishing bool
}

var _ fence.Fencer = (*Engine)(nil)

// New returns an engine for the device called name (used in messages),
// reached through t.
func New(name string, t scsi.Transport, cfg Config) (*Engine, error) {
	if cfg.Key == 0 {
		return nil, errors.New("pr: fence key is zero; derive it with fence.KeyFromUUID")
	}
	if cfg.Prefer == 0 {
		cfg.Prefer = fence.WriteExclusive
	}
	if !cfg.Prefer.Exclusive() {
		return nil, fmt.Errorf("pr: reservation type %s lets every registrant write; use Write Exclusive or Exclusive Access", cfg.Prefer)
	}
	if cfg.ReadyAttempts <= 0 {
		cfg.ReadyAttempts = 10
	}
	if cfg.ReadyDelay <= 0 {
		cfg.ReadyDelay = 200 * time.Millisecond
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Engine{name: name, cfg: cfg, log: log.With("device", name, "key", cfg.Key.String())}
	e.dev = &scsi.Device{
		Name:                 name,
		T:                    t,
		Timeout:              cfg.Timeout,
		UnitAttentionRetries: cfg.UnitAttentionRetries,
		OnUnitAttention:      e.onUnitAttention,
	}
	return e, nil
}

// Device returns the SCSI device the engine uses (for identification
// commands such as INQUIRY, which do not change reservations).
func (e *Engine) Device() *scsi.Device { return e.dev }

// onUnitAttention runs inside a command, with e.mu held by the operation.
func (e *Engine) onUnitAttention(cmd string, s scsi.Sense) error {
	preempted := s.ASC == scsi.ASCParametersChanged &&
		(s.ASCQ == scsi.ASCQReservationsPreempted || s.ASCQ == scsi.ASCQRegistrationsPreempted)
	if preempted && e.lost != nil {
		// Another node preempted us: whatever the target reads like
		// later, the loss is not a target that forgot.
		e.forgotten = false
		if e.reestablishing {
			return fmt.Errorf("%s: target reported unit attention %s while this node re-established its claim: %w", e.name, s, e.lost)
		}
	}
	if preempted && e.watch {
		return e.markLost(fmt.Sprintf("target reported unit attention %s", s))
	}
	e.log.Info("unit attention cleared", "command", cmd, "sense", s.String())
	return nil
}

func (e *Engine) markLost(reason string) *fence.LostError {
	if e.lost == nil {
		e.lost = &fence.LostError{Device: e.name, Reason: reason}
		e.log.Error("claim lost", "reason", reason)
	}
	e.held = false
	e.watch = false
	e.forgotten = false
	return e.lost
}

// MarkLost records that the claim is lost for a reason found outside the
// engine (a write that failed with EBADE / reservation conflict). From then
// on Acquire and Check fail with the returned error.
func (e *Engine) MarkLost(reason string) *fence.LostError {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.markLost(reason)
}

// Lost returns the loss recorded by this engine, or nil.
func (e *Engine) Lost() *fence.LostError {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lost
}

func (e *Engine) resolve(k fence.Key) string {
	if k == e.cfg.Key {
		return "this node"
	}
	if e.cfg.Resolver != nil {
		if n, ok := e.cfg.Resolver.NodeForKey(k); ok {
			return n
		}
	}
	return ""
}

// waitReady issues TEST UNIT READY until the unit attentions have been
// drained (the device retries those) and the unit is ready.
func (e *Engine) waitReady(ctx context.Context) error {
	var err error
	for i := 0; i < e.cfg.ReadyAttempts; i++ {
		err = e.dev.TestUnitReady(ctx)
		switch {
		case err == nil, errors.Is(err, scsi.ErrReservationConflict):
			// A target may answer RESERVATION CONFLICT to a non-holder;
			// the unit is there and talking.
			return nil
		case errors.Is(err, scsi.ErrNotReady):
			e.log.Info("unit not ready, waiting", "error", err)
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s: waiting for the unit to become ready: %w", e.name, ctx.Err())
			case <-time.After(e.cfg.ReadyDelay):
			}
			continue
		}
		var lost *fence.LostError
		if errors.As(err, &lost) {
			return err
		}
		if errors.Is(err, scsi.ErrUnitAttention) {
			return fmt.Errorf("%s: unit attentions did not clear: %w", e.name, err)
		}
		return err
	}
	return fmt.Errorf("%s: unit still not ready after %d attempts: %w", e.name, e.cfg.ReadyAttempts, err)
}

// Probe implements fence.Fencer.
func (e *Engine) Probe(ctx context.Context) (fence.Support, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.verify(ctx); err != nil {
		return fence.Support{}, err
	}
	s, _, err := e.probe(ctx)
	return s, err
}

func (e *Engine) verify(ctx context.Context) error {
	if e.cfg.Verify == nil {
		return nil
	}
	if err := e.cfg.Verify(ctx); err != nil {
		return fmt.Errorf("%s: not acting on the device: %w", e.name, err)
	}
	return nil
}

func (e *Engine) probe(ctx context.Context) (fence.Support, scsi.Capabilities, error) {
	none := func(reason string) (fence.Support, scsi.Capabilities, error) {
		return fence.Support{Method: fence.MethodNone, Reason: reason}, scsi.Capabilities{}, nil
	}
	if err := e.waitReady(ctx); err != nil {
		if errors.Is(err, scsi.ErrNotSCSI) {
			return none("not a SCSI device: SG_IO is not accepted (virtio-blk or similar)")
		}
		return fence.Support{}, scsi.Capabilities{}, err
	}
	caps, err := e.dev.ReportCapabilities(ctx)
	if err != nil {
		if !errors.Is(err, scsi.ErrIllegalRequest) {
			return fence.Support{}, scsi.Capabilities{}, err
		}
		// Older targets implement READ KEYS but not REPORT CAPABILITIES.
		if _, kerr := e.dev.ReadKeys(ctx); kerr != nil {
			if errors.Is(kerr, scsi.ErrIllegalRequest) {
				return none("target rejects PERSISTENT RESERVE IN: " + kerr.Error())
			}
			return fence.Support{}, scsi.Capabilities{}, kerr
		}
		e.log.Info("REPORT CAPABILITIES not supported; assuming the preferred type", "type", e.cfg.Prefer.String())
		return fence.Support{Method: fence.MethodPR, Preferred: e.cfg.Prefer}, caps, nil
	}
	s := fence.Support{Method: fence.MethodPR, PersistThroughPowerLoss: caps.PTPLCapable}
	for _, t := range caps.Types() {
		s.Types = append(s.Types, fence.ReservationType(t))
	}
	switch {
	case !caps.TypeMaskValid, caps.Supports(uint8(e.cfg.Prefer)):
		s.Preferred = e.cfg.Prefer
	case caps.Supports(uint8(fence.WriteExclusive)):
		s.Preferred = fence.WriteExclusive
	case caps.Supports(uint8(fence.ExclusiveAccess)):
		s.Preferred = fence.ExclusiveAccess
	default:
		s.Method = fence.MethodNone
		s.Reason = fmt.Sprintf("target supports neither Write Exclusive nor Exclusive Access (type mask 0x%04x); the types it has let any registrant write", caps.TypeMask)
	}
	return s, caps, nil
}

// probePR verifies the device and probes it before a claim; a disk without
// usable persistent reservations fails with fence.ErrNotSupported.
func (e *Engine) probePR(ctx context.Context) (fence.Support, error) {
	if err := e.verify(ctx); err != nil {
		return fence.Support{}, err
	}
	sup, _, err := e.probe(ctx)
	if err != nil {
		return fence.Support{}, err
	}
	if sup.Method != fence.MethodPR {
		return sup, fmt.Errorf("%s: %w: %s", e.name, fence.ErrNotSupported, sup.Reason)
	}
	return sup, nil
}

// state is one read of the PR state.
type state struct {
	keys []fence.Key
	res  scsi.Reservation
	// gen is READ KEYS' PRgeneration; READ RESERVATION reports its own in
	// res.Generation, and the two differ when a registration changed
	// between the reads.
	gen uint32
}

func (s state) registered(k fence.Key) bool { return slices.Contains(s.keys, k) }

func (s state) foreign(mine fence.Key) []fence.Key {
	var out []fence.Key
	for _, k := range s.keys {
		if k != mine && !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

func (s state) holder() fence.Key { return fence.Key(s.res.Key) }

// pristine: no registration, no reservation, and both reads at PR
// generation 0, so no registration since the target started.
func (s state) pristine() bool {
	return len(s.keys) == 0 && !s.res.Present && s.gen == 0 && s.res.Generation == 0
}

func (s state) allRegistrants() bool {
	return s.res.Present && fence.ReservationType(s.res.Type).AllRegistrants()
}

func (e *Engine) read(ctx context.Context) (state, error) {
	k, err := e.dev.ReadKeys(ctx)
	if err != nil {
		return state{}, err
	}
	r, err := e.dev.ReadReservation(ctx)
	if err != nil {
		return state{}, err
	}
	st := state{res: r, gen: k.Generation}
	for _, key := range k.Keys {
		st.keys = append(st.keys, fence.Key(key))
	}
	return st, nil
}

func (e *Engine) out(ctx context.Context, p scsi.PROut) error {
	e.log.Debug("PERSISTENT RESERVE OUT", "action", p.Action.String(), "type", p.Type, "sa_key", fence.Key(p.ServiceActionKey).String())
	return e.dev.PersistentReserveOut(ctx, p)
}

func (e *Engine) verifyErr(step string, st state) error {
	return fmt.Errorf("%s: after %s the target reports keys %v and %s; it did not do what was asked, so the disk is not claimed",
		e.name, step, st.keys, describeReservation(st.res))
}

func describeReservation(r scsi.Reservation) string {
	if !r.Present {
		return "no reservation"
	}
	return fmt.Sprintf("a %s reservation by key %s", fence.ReservationType(r.Type), fence.Key(r.Key))
}

func (e *Engine) refusal(st state, grant *fence.Grant) *fence.HeldError {
	h := st.holder()
	if st.allRegistrants() {
		for _, k := range st.foreign(e.cfg.Key) {
			if !grant.Names(k) {
				h = k
				break
			}
		}
	}
	he := &fence.HeldError{
		Device:     e.name,
		Holder:     h,
		HolderNode: e.resolve(h),
		Type:       fence.ReservationType(st.res.Type),
		Registered: st.foreign(e.cfg.Key),
		Granted:    grant != nil,
	}
	e.log.Warn("disk refused", "holder", h.String(), "holder_node", he.HolderNode, "granted", grant != nil)
	return he
}

// Acquire implements fence.Fencer. It claims a disk that shows no claim at
// once; a stage uses AcquireWaiting.
func (e *Engine) Acquire(ctx context.Context, grant *fence.Grant) (fence.Acquired, error) {
	return e.AcquireWaiting(ctx, grant, fence.ReclaimWait{})
}

// AcquireWaiting implements fence.WaitingAcquirer; the package
// documentation says when it waits and why.
func (e *Engine) AcquireWaiting(ctx context.Context, grant *fence.Grant, w fence.ReclaimWait) (fence.Acquired, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost != nil {
		return fence.Acquired{}, e.lost
	}
	if grant != nil {
		if err := grant.ForNode(e.cfg.Node, e.cfg.Disk); err != nil {
			return fence.Acquired{}, fmt.Errorf("%s: takeover grant rejected: %w", e.name, err)
		}
	}
	sup, err := e.probePR(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	typ := sup.Preferred
	mine := e.cfg.Key

	st, err := e.read(ctx)
	if err != nil {
		return fence.Acquired{}, err
	}
	if grant == nil && w.Wait > 0 && st.pristine() {
		if st, err = e.awaitHolder(ctx, st, w); err != nil {
			return fence.Acquired{}, err
		}
	}
	switch {
	case st.res.Present && !st.allRegistrants() && st.holder() == mine:
		return e.holdAgain(ctx, st)
	case st.res.Present:
		var victims []fence.Key
		if st.allRegistrants() {
			victims = st.foreign(mine)
		} else {
			victims = []fence.Key{st.holder()}
		}
		for _, v := range victims {
			if !grant.Names(v) {
				return fence.Acquired{}, e.refusal(st, grant)
			}
		}
		return e.takeover(ctx, st, typ, grant)
	}
	return e.claimFree(ctx, typ, grant)
}

// holdAgain is an acquisition of a disk whose reservation, as st shows,
// our key holds already: exclusive, and moved to this I_T nexus when
// another one holds it.
func (e *Engine) holdAgain(ctx context.Context, st state) (fence.Acquired, error) {
	t := fence.ReservationType(st.res.Type)
	if !t.Exclusive() {
		return fence.Acquired{}, fmt.Errorf("%s: this node already holds a %s reservation, under which other registrants may write; run 'vco-agent fence release' and acquire again", e.name, t)
	}
	here, err := e.holdsHere(ctx, t)
	if err != nil {
		return fence.Acquired{}, err
	}
	if !here {
		if err := e.moveHere(ctx, t); err != nil {
			return fence.Acquired{}, err
		}
	}
	e.held, e.watch, e.typ = true, true, t
	e.log.Info("disk already claimed by this node", "type", t.String())
	return fence.Acquired{Method: fence.MethodPR, Key: e.cfg.Key, Type: t, Already: true}, nil
}

// holdsHere asks whether this I_T nexus (not merely our key) holds the
// reservation: a RESERVE of the same type by the holder is a no-op that
// answers GOOD, while any other nexus gets RESERVATION CONFLICT. Call it only
// when a read showed the reservation held by our key, so that it can never
// create a reservation that was not there.
func (e *Engine) holdsHere(ctx context.Context, t fence.ReservationType) (bool, error) {
	err := e.out(ctx, scsi.PROut{Action: scsi.Reserve, Type: uint8(t), Key: uint64(e.cfg.Key)})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, scsi.ErrReservationConflict):
		return false, nil
	}
	return false, fmt.Errorf("%s: checking that this path holds the reservation: %w", e.name, err)
}

// moveHere moves a reservation held by our key through another I_T nexus
// (an earlier iSCSI session of this node, e.g. before a reboot) to this one:
// register here, then PREEMPT naming our own key, which removes the other
// nexuses' registrations and makes this one the holder (SPC-4: the
// preempting nexus keeps its registration). The key is ours, so no grant is
// involved.
func (e *Engine) moveHere(ctx context.Context, t fence.ReservationType) error {
	mine := e.cfg.Key
	e.log.Warn("this node's key holds the disk through another path or session; moving the reservation here", "type", t.String())
	if _, err := e.register(ctx); err != nil {
		return err
	}
	if err := e.out(ctx, scsi.PROut{Action: scsi.Preempt, Type: uint8(t), Key: uint64(mine), ServiceActionKey: uint64(mine)}); err != nil {
		return fmt.Errorf("%s: moving this node's reservation to this path: %w", e.name, err)
	}
	st, err := e.read(ctx)
	if err != nil {
		return err
	}
	if !st.res.Present || st.allRegistrants() || st.holder() != mine || !st.registered(mine) {
		return e.verifyErr("PREEMPT of this node's own key", st)
	}
	here, err := e.holdsHere(ctx, t)
	if err != nil {
		return err
	}
	if !here {
		return e.verifyErr("PREEMPT of this node's own key (this path still does not hold the reservation)", st)
	}
	return nil
}

// register registers our key on this I_T nexus and verifies it.
func (e *Engine) register(ctx context.Context) (state, error) {
	if err := e.out(ctx, scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(e.cfg.Key)}); err != nil {
		return state{}, fmt.Errorf("%s: registering key %s: %w", e.name, e.cfg.Key, err)
	}
	st, err := e.read(ctx)
	if err != nil {
		return state{}, err
	}
	if !st.registered(e.cfg.Key) {
		return st, e.verifyErr("REGISTER AND IGNORE EXISTING KEY", st)
	}
	return st, nil
}

// unregister removes our registration (REGISTER with service action key 0)
// and verifies that our key is gone.
func (e *Engine) unregister(ctx context.Context) error {
	err := e.out(ctx, scsi.PROut{Action: scsi.Register, Key: uint64(e.cfg.Key)})
	if err != nil && !errors.Is(err, scsi.ErrReservationConflict) {
		return fmt.Errorf("%s: unregistering key %s: %w", e.name, e.cfg.Key, err)
	}
	// RESERVATION CONFLICT means this nexus is not registered with our key
	// (any more); the re-read decides.
	st, rerr := e.read(ctx)
	if rerr != nil {
		return rerr
	}
	if st.registered(e.cfg.Key) {
		return fmt.Errorf("%s: key %s is still registered after unregistering (another path to the disk registered it too?); keys %v",
			e.name, e.cfg.Key, st.keys)
	}
	return nil
}

func (e *Engine) claimFree(ctx context.Context, typ fence.ReservationType, grant *fence.Grant) (fence.Acquired, error) {
	mine := e.cfg.Key
	if _, err := e.register(ctx); err != nil {
		return fence.Acquired{}, err
	}
	err := e.out(ctx, scsi.PROut{Action: scsi.Reserve, Type: uint8(typ), Key: uint64(mine)})
	if err != nil && !errors.Is(err, scsi.ErrReservationConflict) {
		e.cleanup(ctx)
		return fence.Acquired{}, fmt.Errorf("%s: reserving (%s): %w", e.name, typ, err)
	}
	st, rerr := e.read(ctx)
	if rerr != nil {
		return fence.Acquired{}, rerr
	}
	if st.res.Present && (st.allRegistrants() || st.holder() != mine) {
		// Another node reserved between our read and our RESERVE: it won.
		e.cleanup(ctx)
		if grant != nil && !st.allRegistrants() && grant.Names(st.holder()) {
			return fence.Acquired{}, fmt.Errorf("%s: the granted holder %s reserved the disk while we claimed it; retry the acquire", e.name, st.holder())
		}
		return fence.Acquired{}, e.refusal(st, grant)
	}
	if err != nil || !st.res.Present || st.holder() != mine || fence.ReservationType(st.res.Type) != typ || !st.registered(mine) {
		e.cleanup(ctx)
		if err != nil {
			return fence.Acquired{}, fmt.Errorf("%s: reserving (%s): %w; %s", e.name, typ, err, describeReservation(st.res))
		}
		return fence.Acquired{}, e.verifyErr("RESERVE", st)
	}
	e.held, e.watch, e.typ = true, true, typ
	e.log.Info("disk claimed", "type", typ.String())
	return fence.Acquired{Method: fence.MethodPR, Key: mine, Type: typ}, nil
}

// cleanup drops the registration of a claim that failed, so a refused node
// leaves nothing behind. Best effort: the refusal is what gets reported.
func (e *Engine) cleanup(ctx context.Context) {
	if err := e.unregister(ctx); err != nil {
		e.log.Warn("could not remove our registration after a failed claim", "error", err)
	}
}

func (e *Engine) takeover(ctx context.Context, before state, typ fence.ReservationType, grant *fence.Grant) (fence.Acquired, error) {
	mine := e.cfg.Key
	victim := before.holder()
	if before.allRegistrants() {
		victim = 0 // service action key 0 preempts every other registrant
	}
	e.log.Warn("taking the disk over with a grant", "holder", victim.String(), "holder_node", e.resolve(victim), "disk", grant.Disk)
	if _, err := e.register(ctx); err != nil {
		return fence.Acquired{}, err
	}
	claim := fence.Acquired{Method: fence.MethodPR, Key: mine, Type: typ, PreemptAndAbort: true}
	p := scsi.PROut{Action: scsi.PreemptAndAbort, Type: uint8(typ), Key: uint64(mine), ServiceActionKey: uint64(victim)}
	err := e.out(ctx, p)
	if errors.Is(err, scsi.ErrIllegalRequest) {
		e.log.Info("target rejects PREEMPT AND ABORT; using PREEMPT", "error", err)
		claim.PreemptAndAbort = false
		p.Action = scsi.Preempt
		err = e.out(ctx, p)
	}
	st, rerr := e.read(ctx)
	if rerr != nil {
		return fence.Acquired{}, rerr
	}
	if err != nil {
		e.cleanup(ctx)
		if errors.Is(err, scsi.ErrReservationConflict) && st.res.Present && st.holder() != mine {
			return fence.Acquired{}, e.refusal(st, grant)
		}
		return fence.Acquired{}, fmt.Errorf("%s: preempting key %s: %w", e.name, victim, err)
	}
	if !st.res.Present || st.allRegistrants() || st.holder() != mine || fence.ReservationType(st.res.Type) != typ || !st.registered(mine) {
		e.cleanup(ctx)
		return fence.Acquired{}, e.verifyErr(p.Action.String(), st)
	}
	claim.Preempted = before.foreign(mine)
	if victim != 0 {
		claim.Preempted = []fence.Key{victim}
	}
	claim.Preempted = e.preemptSuperseded(ctx, st, typ, grant, claim.Preempted)
	if err := e.verifyPreempted(ctx, claim.Preempted); err != nil {
		return fence.Acquired{}, err
	}
	e.held, e.watch, e.typ = true, true, typ
	e.log.Warn("disk taken over", "preempted", fmt.Sprint(claim.Preempted), "preempt_and_abort", claim.PreemptAndAbort)
	return claim, nil
}

// preemptSuperseded removes the other keys the grant supersedes that st
// shows still registered (the old node's other paths), so nothing of the
// old attachment stays, and returns preempted with the keys removed.
func (e *Engine) preemptSuperseded(ctx context.Context, st state, typ fence.ReservationType, grant *fence.Grant, preempted []fence.Key) []fence.Key {
	mine := e.cfg.Key
	for _, k := range st.foreign(mine) {
		if !grant.Names(k) {
			continue
		}
		if err := e.out(ctx, scsi.PROut{Action: scsi.Preempt, Type: uint8(typ), Key: uint64(mine), ServiceActionKey: uint64(k)}); err != nil {
			e.log.Warn("could not remove a superseded registration", "superseded", k.String(), "error", err)
			continue
		}
		if !slices.Contains(preempted, k) {
			preempted = append(preempted, k)
		}
	}
	return preempted
}

// verifyPreempted reads the target after a takeover: our key holds the
// reservation and none of the preempted keys is registered.
func (e *Engine) verifyPreempted(ctx context.Context, preempted []fence.Key) error {
	st, err := e.read(ctx)
	if err != nil {
		return err
	}
	if !st.res.Present || st.holder() != e.cfg.Key {
		return e.verifyErr("removing superseded registrations", st)
	}
	for _, k := range preempted {
		if st.registered(k) {
			return e.verifyErr(fmt.Sprintf("preempting key %s", k), st)
		}
	}
	return nil
}

// Release implements fence.Fencer: RELEASE, then unregister, each verified.
// A disk this node does not hold (or no longer holds) is released without
// error; a foreign holder is left alone.
func (e *Engine) Release(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	// A loss noticed during release is already recorded; release goes on.
	e.watch = false
	mine := e.cfg.Key
	if err := e.verify(ctx); err != nil {
		return err
	}
	if err := e.waitReady(ctx); err != nil {
		return err
	}
	st, err := e.read(ctx)
	if err != nil {
		return err
	}
	if st.res.Present && !st.allRegistrants() && st.holder() == mine {
		if err := e.out(ctx, scsi.PROut{Action: scsi.Release, Type: st.res.Type, Key: uint64(mine)}); err != nil {
			return fmt.Errorf("%s: releasing the %s reservation: %w", e.name, fence.ReservationType(st.res.Type), err)
		}
		if st, err = e.read(ctx); err != nil {
			return err
		}
		if st.res.Present && st.holder() == mine {
			return e.verifyErr("RELEASE", st)
		}
	}
	e.held = false
	if st.registered(mine) {
		if err := e.unregister(ctx); err != nil {
			return err
		}
	}
	e.log.Info("disk released")
	return nil
}

// Check implements fence.Fencer. The claim is intact when our key is
// registered and the reservation is held by it, and no unit attention
// reported our reservation or registration preempted.
func (e *Engine) Check(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost != nil {
		return e.lost
	}
	e.watch = true
	mine := e.cfg.Key
	if err := e.verify(ctx); err != nil {
		return err
	}
	if err := e.waitReady(ctx); err != nil {
		return err
	}
	st, err := e.read(ctx)
	if err != nil {
		return err
	}
	lost := func(reason string) error {
		l := e.markLost(reason)
		if st.res.Present && !st.allRegistrants() && st.holder() != mine {
			l.Holder = st.holder()
			l.HolderNode = e.resolve(l.Holder)
		}
		return l
	}
	switch {
	case len(st.keys) == 0 && !st.res.Present:
		err := lost(fmt.Sprintf("the target holds no registration and no reservation at all (PR generation %d): it restarted or was reset, or every key was removed", st.gen))
		e.forgotten = true
		return err
	case !st.registered(mine):
		return lost("our key is no longer registered (preempted or cleared)")
	case !st.res.Present:
		return lost("the disk has no reservation")
	case st.allRegistrants() || st.holder() != mine:
		return lost("the reservation is held by another key")
	case !fence.ReservationType(st.res.Type).Exclusive():
		return lost(fmt.Sprintf("our reservation has type %s, which lets other registrants write", fence.ReservationType(st.res.Type)))
	}
	here, err := e.holdsHere(ctx, fence.ReservationType(st.res.Type))
	if err != nil {
		return err
	}
	if !here {
		return lost("this path to the disk does not hold the reservation (our key holds it through another path or session)")
	}
	e.held, e.typ = true, fence.ReservationType(st.res.Type)
	return nil
}

// Status is the PR state of a disk, for display.
type Status struct {
	Device       string             `json:"device"`
	OwnKey       fence.Key          `json:"own_key"`
	Support      fence.Support      `json:"support"`
	Generation   uint32             `json:"generation"`
	Keys         []KeyInfo          `json:"keys"`
	Reservation  *ReservationInfo   `json:"reservation,omitempty"`
	Capabilities *scsi.Capabilities `json:"capabilities,omitempty"`
}

// KeyInfo is one registration.
type KeyInfo struct {
	Key       fence.Key `json:"key"`
	Node      string    `json:"node,omitempty"`
	Initiator string    `json:"initiator,omitempty"`
	Holder    bool      `json:"holder"`
}

// ReservationInfo is the current reservation.
type ReservationInfo struct {
	Key  fence.Key             `json:"key"`
	Node string                `json:"node,omitempty"`
	Type fence.ReservationType `json:"type"`
}

// Status reads keys, reservation and capabilities without changing
// anything. Unit attentions are cleared as a side effect of reading
// (and, while the engine holds the disk, still checked for preemption).
func (e *Engine) Status(ctx context.Context) (Status, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := Status{Device: e.name, OwnKey: e.cfg.Key}
	if err := e.verify(ctx); err != nil {
		return s, err
	}
	sup, caps, err := e.probe(ctx)
	if err != nil {
		return s, err
	}
	s.Support = sup
	if sup.Method != fence.MethodPR && len(sup.Types) == 0 {
		return s, nil
	}
	if caps != (scsi.Capabilities{}) {
		s.Capabilities = &caps
	}
	k, err := e.dev.ReadKeys(ctx)
	if err != nil {
		return s, err
	}
	r, err := e.dev.ReadReservation(ctx)
	if err != nil {
		return s, err
	}
	s.Generation = k.Generation
	initiators := map[fence.Key][]string{}
	if fs, err := e.dev.ReadFullStatus(ctx); err == nil {
		for _, reg := range fs.Registrants {
			initiators[fence.Key(reg.Key)] = append(initiators[fence.Key(reg.Key)], reg.Initiator())
		}
	}
	seen := map[fence.Key]int{}
	for _, key := range k.Keys {
		fk := fence.Key(key)
		ki := KeyInfo{Key: fk, Node: e.resolve(fk)}
		if names := initiators[fk]; seen[fk] < len(names) {
			ki.Initiator = names[seen[fk]]
		}
		seen[fk]++
		ki.Holder = r.Present && (fence.ReservationType(r.Type).AllRegistrants() || fence.Key(r.Key) == fk)
		s.Keys = append(s.Keys, ki)
	}
	if r.Present {
		s.Reservation = &ReservationInfo{Key: fence.Key(r.Key), Type: fence.ReservationType(r.Type)}
		if r.Key != 0 {
			s.Reservation.Node = e.resolve(fence.Key(r.Key))
		}
	}
	return s, nil
}
