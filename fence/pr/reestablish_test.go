package pr

import (
	"errors"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// restarted returns a target on which node a held the disk (Write
// Exclusive) and node b was refused, after a target restart: everything
// forgotten, generation 0, a 29/00 unit attention waiting for each
// initiator. a's check has reported the loss.
func restarted(t *testing.T) (*scsitest.Target, *node, *node) {
	t.Helper()
	tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: true})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	if _, err := b.e.Acquire(ctx(t), nil); err == nil {
		t.Fatal("b acquired a held disk")
	}
	tgt.Restart()
	var le *fence.LostError
	if err := a.e.Check(ctx(t)); !errors.As(err, &le) {
		t.Fatalf("check after the target restart: %v, want a loss", err)
	}
	if !strings.Contains(le.Error(), "no registration and no reservation") {
		t.Fatalf("loss after the restart: %v", le)
	}
	return tgt, a, b
}

// prOut reports whether cdb is PERSISTENT RESERVE OUT with action sa.
func prOut(cdb []byte, sa scsi.PROutAction) bool {
	return len(cdb) > 1 && cdb[0] == scsi.OpPersistentReserveOut && scsi.PROutAction(cdb[1]&0x1f) == sa
}

// wantLostTo asserts that err is a loss naming holder.
func wantLostTo(t *testing.T, err error, holder *node) *fence.LostError {
	t.Helper()
	var le *fence.LostError
	if !errors.As(err, &le) {
		t.Fatalf("re-establish: %v, want a *fence.LostError", err)
	}
	if holder != nil && (le.Holder != holder.key || le.HolderNode != "node-"+holder.name) {
		t.Fatalf("loss names %s (%q), want %s (node-%s): %v", le.Holder, le.HolderNode, holder.key, holder.name, le)
	}
	return le
}

func TestReestablishAfterTargetRestartWithNoOtherKey(t *testing.T) {
	tgt, a, b := restarted(t)
	// An I_T nexus reset between the check and the re-establish: the
	// unit attention it leaves is retried through, not taken for a loss.
	tgt.QueueUnitAttention("a", 0x29, 0x07)
	before := len(tgt.Log())
	c, err := a.e.Reestablish(ctx(t))
	if err != nil {
		t.Fatalf("re-establish on a target that forgot everything: %v", err)
	}
	if c.Key != a.key || c.Type != fence.WriteExclusive || c.Method != fence.MethodPR {
		t.Fatalf("claim = %+v", c)
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
	if err := a.e.Check(ctx(t)); err != nil {
		t.Fatalf("check after re-establishing: %v", err)
	}
	if !tgt.CanWrite("a") || tgt.CanWrite("b") {
		t.Fatalf("after re-establishing: a can write %v, b can write %v", tgt.CanWrite("a"), tgt.CanWrite("b"))
	}
	// The other node is refused again, naming the holder, without a grant.
	_, err = b.e.Acquire(ctx(t), nil)
	var he *fence.HeldError
	if !errors.As(err, &he) || he.Holder != a.key {
		t.Fatalf("b after a re-established: %v", err)
	}
	// Plain REGISTER (never IGNORE EXISTING KEY), each step re-read.
	wantClaimOrder(t, tgt.Log()[before:], "a", "PR OUT REGISTER")
	// Exclusive Access is re-established as Exclusive Access.
	tgt2 := scsitest.New(scsitest.Options{})
	x := newNode(t, tgt2, "a", uuidA, func(c *Config) { c.Prefer = fence.ExclusiveAccess })
	mustAcquire(t, x, nil)
	tgt2.Restart()
	if err := x.e.Check(ctx(t)); err == nil {
		t.Fatal("check passed after the restart")
	}
	if c, err := x.e.Reestablish(ctx(t)); err != nil || c.Type != fence.ExclusiveAccess {
		t.Fatalf("re-establish of an Exclusive Access claim: %+v %v", c, err)
	}
	assertHolder(t, tgt2, "a", x.key, fence.ExclusiveAccess)
}

func TestReestablishAfterAnAgentRestart(t *testing.T) {
	// The agent restarted too: a fresh engine whose first check finds the
	// target empty re-establishes with the preferred type.
	tgt, a, _ := restarted(t)
	a2 := newNode(t, tgt, "a", uuidA)
	if err := a2.e.Check(ctx(t)); err == nil {
		t.Fatal("fresh engine's check passed on an empty target")
	}
	if _, err := a2.e.Reestablish(ctx(t)); err != nil {
		t.Fatal(err)
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
}

func TestReestablishRefusedWhenAnotherNodeClaimedFirst(t *testing.T) {
	tgt, a, b := restarted(t)
	// b finds the disk free after the restart and claims it.
	mustAcquire(t, b, nil)
	le := wantLostTo(t, reestablish(t, a), b)
	if !strings.Contains(le.Reason, "appeared") {
		t.Fatalf("reason: %v", le)
	}
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("a registered although b held the disk")
	}
	// The loss is final: no second try, no acquire without a grant.
	if _, err := a.e.Reestablish(ctx(t)); !errors.As(err, new(*fence.LostError)) {
		t.Fatalf("second re-establish: %v", err)
	}
	if _, err := a.e.Acquire(ctx(t), nil); !errors.As(err, new(*fence.LostError)) {
		t.Fatalf("acquire after the refused re-establish: %v", err)
	}
}

func TestReestablishRefusedWhenAForeignKeyIsOnlyRegistered(t *testing.T) {
	tgt, a, b := restarted(t)
	d := scsi.NewDevice("b", tgt.Initiator("b"))
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(b.key)}); err != nil {
		t.Fatal(err)
	}
	wantLostTo(t, reestablish(t, a), b)
	if k, reg := tgt.Registered("b"); !reg || fence.Key(k) != b.key {
		t.Fatal("the foreign registration was touched")
	}
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("a registered")
	}
}

func reestablish(t *testing.T, n *node) error {
	t.Helper()
	_, err := n.e.Reestablish(ctx(t))
	return err
}

func TestReestablishRefusedWhenAForeignKeyAppearsBetweenTheReads(t *testing.T) {
	t.Run("registered before our REGISTER", func(t *testing.T) { foreignKeyRegisteredBeforeOurREGISTER(t) })
	t.Run("claimed between our REGISTER and RESERVE", func(t *testing.T) { foreignKeyClaimedBetweenOurREGISTERAndRESERVE(t) })
	t.Run("registered after our RESERVE", func(t *testing.T) { foreignKeyRegisteredAfterOurRESERVE(t) })
}

func foreignKeyClaimedBetweenOurREGISTERAndRESERVE(t *testing.T) {
	tgt, a, b := restarted(t)
	fired := false
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == "a" && !fired && prOut(cdb, scsi.Reserve) {
			fired = true
			// b's acquire sees a's bare registration, not a holder:
			// it claims.
			if _, err := b.e.Acquire(ctx(t), nil); err != nil {
				t.Error(err)
			}
		}
	}
	wantLostTo(t, reestablish(t, a), b)
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("a left its registration")
	}
	if err := b.e.Check(ctx(t)); err != nil {
		t.Fatalf("b's claim: %v", err)
	}
}

func foreignKeyRegisteredBeforeOurREGISTER(t *testing.T) {
	tgt, a, b := restarted(t)
	fired := false
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == "a" && !fired && prOut(cdb, scsi.Register) {
			fired = true
			d := scsi.NewDevice("b", tgt.Initiator("b"))
			if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(b.key)}); err != nil {
				t.Error(err)
			}
		}
	}
	wantLostTo(t, reestablish(t, a), b)
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("a left its registration")
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("a reserved although a foreign key appeared")
	}
	if k, reg := tgt.Registered("b"); !reg || fence.Key(k) != b.key {
		t.Fatal("the foreign registration was touched")
	}
}

func foreignKeyRegisteredAfterOurRESERVE(t *testing.T) {
	tgt, a, b := restarted(t)
	reserved := false
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini != "a" {
			return
		}
		if prOut(cdb, scsi.Reserve) {
			reserved = true
			return
		}
		if reserved && cdb[0] == scsi.OpPersistentReserveIn {
			reserved = false
			// b tries to claim: its RESERVE conflicts with a's, so it
			// is refused naming a, and cleans up; a registration of
			// its own stays (as a half-done acquire would leave it).
			var he *fence.HeldError
			if _, err := b.e.Acquire(ctx(t), nil); !errors.As(err, &he) || he.Holder != a.key {
				t.Errorf("b's acquire against a's fresh reservation: %v", err)
			}
			d := scsi.NewDevice("b", tgt.Initiator("b"))
			if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(b.key)}); err != nil {
				t.Error(err)
			}
		}
	}
	wantLostTo(t, reestablish(t, a), b)
	// a keeps the reservation it made (b registered against a disk
	// that was a's; it gets it only with a grant) but has fenced
	// itself: the engine is lost.
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
	if tgt.CanWrite("b") {
		t.Fatal("b can write")
	}
	if err := a.e.Check(ctx(t)); !errors.As(err, new(*fence.LostError)) {
		t.Fatalf("check after the refused re-establish: %v", err)
	}
	tgt.BeforeCommand = nil
	if _, err := b.e.Acquire(ctx(t), nil); !errors.As(err, new(*fence.HeldError)) {
		t.Fatalf("b without a grant: %v", err)
	}
	// Unstaging a's volume releases it; a grant would let b in before.
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("release left a's reservation")
	}
}

// takenOverAndReleased returns a target on which b took the disk over
// from a with a grant and then released it: empty, with a 2A/05 unit
// attention waiting for a.
func takenOverAndReleased(t *testing.T) (*scsitest.Target, *node) {
	t.Helper()
	tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: true})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	mustAcquire(t, b, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{a.key}})
	if err := b.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	return tgt, a
}

func TestPreemptionIsNeverReestablished(t *testing.T) {
	t.Run("preemption reported by unit attention", func(t *testing.T) {
		tgt, a := takenOverAndReleased(t)
		// The target is empty again, but a's check sees the 2A/05 first.
		if err := a.e.Check(ctx(t)); !errors.As(err, new(*fence.LostError)) {
			t.Fatalf("check: %v", err)
		}
		n := len(tgt.Log())
		if err := reestablish(t, a); !errors.As(err, new(*fence.LostError)) {
			t.Fatalf("re-establish after a preemption: %v", err)
		}
		if len(tgt.Log()) != n {
			t.Fatalf("re-establish after a preemption sent commands: %v", tgt.Log()[n:])
		}
	})
	t.Run("preemption whose unit attention someone else consumed", func(t *testing.T) {
		tgt, a := takenOverAndReleased(t)
		// The guest kernel's own I/O took the 2A/05 on a's nexus.
		if err := scsi.NewDevice("a", tgt.Initiator("a")).TestUnitReady(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if err := a.e.Check(ctx(t)); !errors.As(err, new(*fence.LostError)) {
			t.Fatalf("check: %v", err)
		}
		le := wantLostTo(t, reestablish(t, a), nil)
		if !strings.Contains(le.Reason, "generation") {
			t.Fatalf("reason: %v", le)
		}
		if _, reg := tgt.Registered("a"); reg {
			t.Fatal("a registered again after a takeover")
		}
	})
	t.Run("loss found by a write", func(t *testing.T) {
		tgt := scsitest.New(scsitest.Options{})
		a := newNode(t, tgt, "a", uuidA)
		mustAcquire(t, a, nil)
		tgt.Restart()
		a.e.MarkLost("write failed with EBADE")
		if err := reestablish(t, a); !errors.As(err, new(*fence.LostError)) || !strings.Contains(err.Error(), "EBADE") {
			t.Fatalf("re-establish after MarkLost: %v", err)
		}
	})
}

func TestReestablishRefusedAfterRegistrationsCameAndWent(t *testing.T) {
	// After the restart another node registered and unregistered (it
	// claimed and released while a's check waited): empty, generation 2.
	tgt, a, b := restarted(t)
	mustAcquire(t, b, nil)
	if err := b.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if tgt.Generation() == 0 {
		t.Fatal("model: generation did not move")
	}
	wantLostTo(t, reestablish(t, a), nil)
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("a registered")
	}
}

func TestReestablishNeedsALoss(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	mustAcquire(t, a, nil)
	_, err := a.e.Reestablish(ctx(t))
	if err == nil || errors.As(err, new(*fence.LostError)) {
		t.Fatalf("re-establish of an intact claim: %v", err)
	}
}
