package scsitest

import (
	"context"
	"errors"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// The model's own rules, checked against SPC-4's descriptions of the PR OUT
// service actions, so that engine tests do not rest on a wrong model.

func dev(t *Target, ini string) *scsi.Device {
	d := scsi.NewDevice(ini, t.Initiator(ini))
	d.UnitAttentionRetries = -1
	return d
}

// wantErr fails the test, naming what was done, unless err is want.
func wantErr(t *testing.T, err, want error, what string) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: %v", what, err)
	}
}

// mustOK fails the test on err.
func mustOK(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestModelFollowsSPC4(t *testing.T) {
	ctx := context.Background()
	tgt := New(Options{})
	a, b := dev(tgt, "a"), dev(tgt, "b")
	out := func(d *scsi.Device, p scsi.PROut) error { return d.PersistentReserveOut(ctx, p) }

	registerAndReserveFollowSPC4(t, out, a)
	releaseFollowsSPC4(t, tgt, out, a, b)
	preemptFollowsSPC4(t, ctx, tgt, out, a, b)
	parameterListFollowsSPC4(t, ctx, tgt, out, a)
	// INQUIRY does not consume a pending unit attention.
	tgt.QueueUnitAttention("a", 0x29, 0)
	if _, err := a.Inquiry(ctx); err != nil {
		t.Fatalf("inquiry with pending UA: %v", err)
	}
	if _, _, ok := scsi.UnitAttentionCode(a.TestUnitReady(ctx)); !ok {
		t.Fatal("unit attention consumed by INQUIRY")
	}
}

// prOut sends a PERSISTENT RESERVE OUT from a device.
type prOut func(d *scsi.Device, p scsi.PROut) error

// registerAndReserveFollowSPC4 registers a with key 1 and reserves the
// target for it with type 1 (Write Exclusive).
func registerAndReserveFollowSPC4(t *testing.T, out prOut, a *scsi.Device) {
	t.Helper()
	// REGISTER from an unregistered nexus with a non-zero RESERVATION KEY
	// conflicts; with zero it registers.
	wantErr(t, out(a, scsi.PROut{Action: scsi.Register, Key: 5, ServiceActionKey: 1}), scsi.ErrReservationConflict, "register with wrong key")
	mustOK(t, out(a, scsi.PROut{Action: scsi.Register, ServiceActionKey: 1}))
	// RESERVE needs the registered key; an invalid type is ILLEGAL REQUEST.
	wantErr(t, out(a, scsi.PROut{Action: scsi.Reserve, Type: 1, Key: 2}), scsi.ErrReservationConflict, "reserve with wrong key")
	wantErr(t, out(a, scsi.PROut{Action: scsi.Reserve, Type: 2, Key: 1}), scsi.ErrIllegalRequest, "reserve type 2")
	mustOK(t, out(a, scsi.PROut{Action: scsi.Reserve, Type: 1, Key: 1}))
	// Same type again is GOOD, another type conflicts.
	mustOK(t, out(a, scsi.PROut{Action: scsi.Reserve, Type: 1, Key: 1}))
	wantErr(t, out(a, scsi.PROut{Action: scsi.Reserve, Type: 3, Key: 1}), scsi.ErrReservationConflict, "reserve other type")
}

// releaseFollowsSPC4 registers b with key 2 beside a's reservation.
func releaseFollowsSPC4(t *testing.T, tgt *Target, out prOut, a, b *scsi.Device) {
	t.Helper()
	// Another registrant's RESERVE conflicts; its RELEASE is a no-op.
	mustOK(t, out(b, scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: 2}))
	wantErr(t, out(b, scsi.PROut{Action: scsi.Reserve, Type: 1, Key: 2}), scsi.ErrReservationConflict, "second reserve")
	mustOK(t, out(b, scsi.PROut{Action: scsi.Release, Type: 1, Key: 2}))
	if _, k, _, ok := tgt.Reservation(); !ok || k != 1 {
		t.Fatal("non-holder's RELEASE released")
	}
	// RELEASE by the holder with the wrong type: INVALID RELEASE (26/04).
	err := out(a, scsi.PROut{Action: scsi.Release, Type: 3, Key: 1})
	var ce *scsi.CommandError
	if !errors.As(err, &ce) || ce.Sense == nil || ce.Sense.ASC != 0x26 || ce.Sense.ASCQ != 0x04 {
		t.Fatalf("release with wrong type: %v", err)
	}
}

// preemptFollowsSPC4 has b preempt a, then unregister, which leaves the
// target without a reservation.
func preemptFollowsSPC4(t *testing.T, ctx context.Context, tgt *Target, out prOut, a, b *scsi.Device) {
	t.Helper()
	// PREEMPT of a key nobody holds conflicts; PREEMPT with SA key 0 and no
	// all-registrants reservation is ILLEGAL REQUEST.
	wantErr(t, out(b, scsi.PROut{Action: scsi.Preempt, Type: 1, Key: 2, ServiceActionKey: 9}), scsi.ErrReservationConflict, "preempt unknown key")
	wantErr(t, out(b, scsi.PROut{Action: scsi.Preempt, Type: 1, Key: 2}), scsi.ErrIllegalRequest, "preempt key 0")
	// PREEMPT of the holder moves the reservation and tells the preempted
	// nexus REGISTRATIONS PREEMPTED (2A/05) on its next command.
	mustOK(t, out(b, scsi.PROut{Action: scsi.Preempt, Type: 3, Key: 2, ServiceActionKey: 1}))
	if h, k, ty, _ := tgt.Reservation(); h != "b" || k != 2 || ty != 3 {
		t.Fatalf("after preempt: %s %d %d", h, k, ty)
	}
	if asc, ascq, ok := scsi.UnitAttentionCode(a.TestUnitReady(ctx)); !ok || asc != 0x2a || ascq != 0x05 {
		t.Fatal("no REGISTRATIONS PREEMPTED unit attention")
	}
	// Exclusive Access: a can neither read nor write; unregistering the
	// holder releases the reservation.
	if tgt.CanRead("a") || tgt.CanWrite("a") || !tgt.CanWrite("b") {
		t.Fatal("Exclusive Access access rules")
	}
	mustOK(t, out(b, scsi.PROut{Action: scsi.Register, Key: 2}))
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("unregistering holder kept the reservation")
	}
}

// parameterListFollowsSPC4: APTPL is rejected by default (tgt does so)
// and the parameter list length must be 24.
func parameterListFollowsSPC4(t *testing.T, ctx context.Context, tgt *Target, out prOut, a *scsi.Device) {
	t.Helper()
	wantErr(t, out(a, scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: 1, APTPL: true}), scsi.ErrIllegalRequest, "APTPL")
	r, err := tgt.Initiator("a").Execute(ctx, scsi.PROut{Action: scsi.Register}.CDB(), scsi.DirToDevice, make([]byte, 23), 0)
	if s, serr := scsi.ParseSense(r.Sense); err != nil || r.Status != scsi.StatusCheckCondition || serr != nil || s.ASC != 0x1a {
		t.Fatalf("23-byte parameter list: %+v, %v", r, err)
	}
}

func TestRestartForgetsEverythingAndResetsTheGeneration(t *testing.T) {
	ctx := context.Background()
	tgt := New(Options{})
	a, b := dev(tgt, "a"), dev(tgt, "b")
	if err := a.PersistentReserveOut(ctx, scsi.PROut{Action: scsi.Register, ServiceActionKey: 1}); err != nil {
		t.Fatal(err)
	}
	if err := a.PersistentReserveOut(ctx, scsi.PROut{Action: scsi.Reserve, Type: 1, Key: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReadKeys(ctx); err != nil {
		t.Fatal(err)
	}
	if tgt.Generation() == 0 {
		t.Fatal("REGISTER did not move the generation")
	}
	tgt.Restart()
	// Every initiator that had talked to the target is told, once.
	for _, d := range []*scsi.Device{a, b} {
		if _, err := d.ReadKeys(ctx); err == nil {
			t.Fatalf("%s: first command after the restart answered without a unit attention", d.Name)
		} else if asc, _, ok := scsi.UnitAttentionCode(err); !ok || asc != 0x29 {
			t.Fatalf("%s: first command after the restart: %v, want UNIT ATTENTION 29h", d.Name, err)
		}
	}
	k, err := a.ReadKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.ReadReservation(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(k.Keys) != 0 || r.Present || k.Generation != 0 || r.Generation != 0 {
		t.Fatalf("after the restart: keys %v (generation %d), reservation %+v", k.Keys, k.Generation, r)
	}
	if !tgt.CanWrite("b") {
		t.Fatal("a restarted target with no reservation still refuses a write")
	}
}
