package pr

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// These tests run the engine against scsitest, a model of an SPC-4 target.
// They pin the engine's decisions; the lab proves the same flows against
// tgt in real guest kernels.

const (
	uuidA = "4c4c4544-0042-3610-8052-b4c04f4e3332"
	uuidB = "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab"
	uuidC = "00112233-4455-6677-8899-aabbccddeeff"
)

type node struct {
	name string
	uuid string
	key  fence.Key
	e    *Engine
}

func newNode(t *testing.T, tgt *scsitest.Target, name, uuid string, mod ...func(*Config)) *node {
	t.Helper()
	k, err := fence.KeyFromUUID(uuid)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := fence.NewDirectory(map[string]string{"node-a": uuidA, "node-b": uuidB, "node-c": uuidC})
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Key: k, Node: uuid, Disk: "disk-1", Resolver: dir, ReadyDelay: time.Millisecond}
	for _, m := range mod {
		m(&cfg)
	}
	e, err := New("/dev/sdb@"+name, tgt.Initiator(name), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &node{name: name, uuid: uuid, key: k, e: e}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func mustAcquire(t *testing.T, n *node, g *fence.Grant) fence.Acquired {
	t.Helper()
	c, err := n.e.Acquire(ctx(t), g)
	if err != nil {
		t.Fatalf("%s: acquire: %v", n.name, err)
	}
	return c
}

func assertHolder(t *testing.T, tgt *scsitest.Target, ini string, key fence.Key, typ fence.ReservationType) {
	t.Helper()
	h, k, ty, ok := tgt.Reservation()
	if !ok || h != ini || fence.Key(k) != key || fence.ReservationType(ty) != typ {
		t.Fatalf("reservation = (%q, %s, %d, %v), want (%q, %s, %d)", h, fence.Key(k), ty, ok, ini, key, typ)
	}
}

func TestAcquireFreeDiskWriteExclusive(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	c := mustAcquire(t, a, nil)
	if c.Type != fence.WriteExclusive || c.Key != a.key || c.Already {
		t.Fatalf("claim = %+v", c)
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
	if !tgt.CanWrite("a") {
		t.Fatal("holder cannot write")
	}
	// A second node that registers but does not hold must not be able to
	// write: that is why the registrants types are not used.
	b := tgt.Initiator("b")
	d := scsi.NewDevice("b", b)
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: 0x1234}); err != nil {
		t.Fatal(err)
	}
	if tgt.CanWrite("b") {
		t.Fatal("registered non-holder can write under the chosen type")
	}
	if err := a.e.Check(ctx(t)); err != nil {
		t.Fatalf("check after acquire: %v", err)
	}
	// The log shows the fence_scsi order: read before register, register
	// before reserve, re-read after each.
	wantClaimOrder(t, tgt.Log(), "a", "PR OUT REGISTER AND IGNORE EXISTING KEY")
}

// wantClaimOrder asserts that ini's reservation commands in log begin with
// the fence_scsi order: read, register (with the action given), re-read,
// reserve, re-read.
func wantClaimOrder(t *testing.T, log []string, ini, register string) {
	t.Helper()
	var outs []string
	for _, l := range log {
		if strings.HasPrefix(l, ini+": PR OUT") || strings.HasPrefix(l, ini+": PR IN READ") {
			outs = append(outs, strings.TrimPrefix(l, ini+": "))
		}
	}
	want := []string{
		"PR IN READ KEYS", "PR IN READ RESERVATION",
		register,
		"PR IN READ KEYS", "PR IN READ RESERVATION",
		"PR OUT RESERVE",
		"PR IN READ KEYS", "PR IN READ RESERVATION",
	}
	if len(outs) < len(want) || !slices.Equal(outs[:len(want)], want) {
		t.Fatalf("command order:\n%s\nwant prefix:\n%s", strings.Join(outs, "\n"), strings.Join(want, "\n"))
	}
}

func TestAcquireIsIdempotent(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	mustAcquire(t, a, nil)
	c := mustAcquire(t, a, nil)
	if !c.Already {
		t.Fatalf("second acquire: %+v, want Already", c)
	}
	// A fresh engine (agent restart) finds the claim too.
	a2 := newNode(t, tgt, "a", uuidA)
	if c := mustAcquire(t, a2, nil); !c.Already {
		t.Fatalf("acquire after restart: %+v", c)
	}
}

func TestSecondNodeRefusedNamingHolder(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	_, err := b.e.Acquire(ctx(t), nil)
	var he *fence.HeldError
	if !errors.As(err, &he) {
		t.Fatalf("acquire by b: %v, want HeldError", err)
	}
	if he.Holder != a.key || he.HolderNode != "node-a" || he.Type != fence.WriteExclusive {
		t.Fatalf("HeldError = %+v", he)
	}
	if !strings.Contains(err.Error(), a.key.String()) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("message does not name the holder: %v", err)
	}
	if _, reg := tgt.Registered("b"); reg {
		t.Fatal("refused node left a registration behind")
	}
	if tgt.CanWrite("b") {
		t.Fatal("refused node can write")
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
}

func TestReleaseThenHandover(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("reservation left after release")
	}
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("key left registered after release")
	}
	// Releasing again is harmless.
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatalf("second release: %v", err)
	}
	mustAcquire(t, b, nil)
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	// A's release while B holds leaves B alone.
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	var le *fence.LostError
	if err := a.e.Check(ctx(t)); !errors.As(err, &le) || le.Holder != b.key || le.HolderNode != "node-b" {
		t.Fatalf("check by a after handover: %v", err)
	}
}

func TestTakeoverWithGrant(t *testing.T) {
	for _, noPA := range []bool{false, true} {
		name := "preempt-and-abort"
		if noPA {
			name = "preempt-fallback"
		}
		t.Run(name, func(t *testing.T) {
			tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: noPA})
			a := newNode(t, tgt, "a", uuidA)
			b := newNode(t, tgt, "b", uuidB)
			mustAcquire(t, a, nil)
			g := &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{a.key}}
			c := mustAcquire(t, b, g)
			if c.PreemptAndAbort == noPA || !slices.Equal(c.Preempted, []fence.Key{a.key}) {
				t.Fatalf("claim = %+v", c)
			}
			assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
			if tgt.CanWrite("a") {
				t.Fatal("preempted node can still write")
			}
			if _, reg := tgt.Registered("a"); reg {
				t.Fatal("preempted key still registered")
			}
			err := a.e.Check(ctx(t))
			var le *fence.LostError
			if !errors.As(err, &le) {
				t.Fatalf("check on preempted node: %v", err)
			}
			if !strings.Contains(le.Reason, "REGISTRATIONS PREEMPTED") {
				t.Fatalf("loss reason %q, want the unit attention", le.Reason)
			}
			// P4: the preempted node never re-registers by itself.
			if _, err := a.e.Acquire(ctx(t), nil); !errors.As(err, &le) {
				t.Fatalf("acquire after loss: %v, want LostError", err)
			}
			if _, reg := tgt.Registered("a"); reg {
				t.Fatal("lost node re-registered")
			}
			for _, l := range tgt.Log() {
				if strings.HasPrefix(l, "a: PR OUT") && !strings.Contains(l, "a: PR OUT RESERVE") && !strings.Contains(l, "REGISTER AND IGNORE") {
					t.Fatalf("node a issued %q", l)
				}
			}
		})
	}
}

func TestGrantNotNamingHolderIsRefused(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	kc, _ := fence.KeyFromUUID(uuidC)
	_, err := b.e.Acquire(ctx(t), &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{kc}})
	var he *fence.HeldError
	if !errors.As(err, &he) || !he.Granted || he.Holder != a.key {
		t.Fatalf("acquire with wrong grant: %v", err)
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
}

func TestGrantForAnotherNodeOrDisk(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, a, nil)
	for _, g := range []*fence.Grant{
		{Disk: "disk-1", Node: uuidC, Supersedes: []fence.Key{a.key}},
		{Disk: "disk-2", Node: uuidB, Supersedes: []fence.Key{a.key}},
		{Disk: "disk-1", Node: uuidB},
	} {
		if _, err := b.e.Acquire(ctx(t), g); err == nil || !strings.Contains(err.Error(), "grant") {
			t.Fatalf("grant %+v accepted: %v", g, err)
		}
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
}

func TestLostRaceIsRefused(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	// B's claim runs entirely between A's REGISTER and A's RESERVE.
	fired := false
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == "a" && !fired && cdb[0] == scsi.OpPersistentReserveOut && cdb[1]&0x1f == byte(scsi.Reserve) {
			fired = true
			mustAcquire(t, b, nil)
		}
	}
	_, err := a.e.Acquire(ctx(t), nil)
	var he *fence.HeldError
	if !errors.As(err, &he) || he.Holder != b.key {
		t.Fatalf("a after losing the race: %v", err)
	}
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("loser left its registration")
	}
}

func TestRaceExactlyOneWins(t *testing.T) {
	for round := 0; round < 20; round++ {
		tgt := scsitest.New(scsitest.Options{})
		a := newNode(t, tgt, "a", uuidA)
		b := newNode(t, tgt, "b", uuidB)
		errs := make(chan error, 2)
		for _, n := range []*node{a, b} {
			go func() { _, err := n.e.Acquire(context.Background(), nil); errs <- err }()
		}
		var wins, refusals int
		for range 2 {
			err := <-errs
			var he *fence.HeldError
			switch {
			case err == nil:
				wins++
			case errors.As(err, &he):
				refusals++
			default:
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if wins != 1 || refusals != 1 {
			t.Fatalf("round %d: %d wins, %d refusals", round, wins, refusals)
		}
	}
}

func TestNoPR(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts scsitest.Options
		want string
	}{
		{"virtio-blk", scsitest.Options{NotSCSI: true}, "not a SCSI device"},
		{"scsi-hd", scsitest.Options{NoPR: true}, "rejects PERSISTENT RESERVE IN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tgt := scsitest.New(tc.opts)
			a := newNode(t, tgt, "a", uuidA)
			s, err := a.e.Probe(ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			if s.Method != fence.MethodNone || !strings.Contains(s.Reason, tc.want) {
				t.Fatalf("probe = %+v", s)
			}
			if _, err := a.e.Acquire(ctx(t), nil); !errors.Is(err, fence.ErrNotSupported) {
				t.Fatalf("acquire on a disk without PR: %v", err)
			}
		})
	}
}

func TestProbeReportsTypesAndPicksPreferred(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	s, err := a.e.Probe(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	want := []fence.ReservationType{1, 3, 5, 6, 7, 8}
	if s.Method != fence.MethodPR || !slices.Equal(s.Types, want) || s.Preferred != fence.WriteExclusive {
		t.Fatalf("probe = %+v", s)
	}
	// A target offering only Exclusive Access (and registrants types) gets EA.
	tgt = scsitest.New(scsitest.Options{TypeMask: 0x6808})
	a = newNode(t, tgt, "a", uuidA)
	c := mustAcquire(t, a, nil)
	if c.Type != fence.ExclusiveAccess {
		t.Fatalf("claim type %s, want Exclusive Access", c.Type)
	}
	if tgt.CanRead("b") {
		t.Fatal("Exclusive Access lets another node read")
	}
	// Only registrants types: no safe PR; the disk goes to the lease.
	tgt = scsitest.New(scsitest.Options{TypeMask: 0xE001})
	a = newNode(t, tgt, "a", uuidA)
	if s, err := a.e.Probe(ctx(t)); err != nil || s.Method != fence.MethodNone {
		t.Fatalf("probe with registrants-only types = %+v, %v", s, err)
	}
	// No REPORT CAPABILITIES: PR still works with the preferred type.
	tgt = scsitest.New(scsitest.Options{NoReportCapabilities: true})
	a = newNode(t, tgt, "a", uuidA, func(c *Config) { c.Prefer = fence.ExclusiveAccess })
	if c := mustAcquire(t, a, nil); c.Type != fence.ExclusiveAccess {
		t.Fatalf("claim %+v", c)
	}
}

func TestUnitAttentionsAtStartAreCleared(t *testing.T) {
	for _, desc := range []bool{false, true} {
		tgt := scsitest.New(scsitest.Options{DescriptorSense: desc})
		a := newNode(t, tgt, "a", uuidA)
		tgt.QueueUnitAttention("a", 0x29, 0x00)
		tgt.QueueUnitAttention("a", 0x2A, 0x03) // stale: from before this claim
		tgt.QueueUnitAttention("a", 0x3F, 0x0E)
		mustAcquire(t, a, nil)
		assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
	}
}

func TestEndlessUnitAttentionsAreBounded(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA, func(c *Config) { c.UnitAttentionRetries = 3; c.ReadyAttempts = 2 })
	for range 100 {
		tgt.QueueUnitAttention("a", 0x29, 0x00)
	}
	_, err := a.e.Acquire(ctx(t), nil)
	if !errors.Is(err, scsi.ErrUnitAttention) || !strings.Contains(err.Error(), "did not clear") {
		t.Fatalf("acquire under endless unit attentions: %v", err)
	}
	if n := len(tgt.Log()); n > 10 {
		t.Fatalf("%d commands issued; retries are not bounded", n)
	}
}

func TestCheckSeesPreemptionUnitAttention(t *testing.T) {
	for _, ascq := range []uint8{0x03, 0x05} {
		tgt := scsitest.New(scsitest.Options{DescriptorSense: ascq == 0x05})
		a := newNode(t, tgt, "a", uuidA)
		mustAcquire(t, a, nil)
		// The state on the target still looks intact, but the target says
		// our reservation was preempted (e.g. cleared and re-made by an
		// operator): the claim is lost, whatever a re-read shows.
		tgt.QueueUnitAttention("a", 0x2A, ascq)
		var le *fence.LostError
		if err := a.e.Check(ctx(t)); !errors.As(err, &le) {
			t.Fatalf("ascq %02x: check = %v", ascq, err)
		}
		if err := a.e.Check(ctx(t)); !errors.As(err, &le) {
			t.Fatal("loss is not sticky")
		}
	}
}

func TestCheckAfterClear(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	c := newNode(t, tgt, "c", uuidC)
	mustAcquire(t, a, nil)
	// An operator CLEARs from another node (needs a registration).
	d := scsi.NewDevice("c", tgt.Initiator("c"))
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(c.key)}); err != nil {
		t.Fatal(err)
	}
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.Clear, Key: uint64(c.key)}); err != nil {
		t.Fatal(err)
	}
	var le *fence.LostError
	if err := a.e.Check(ctx(t)); !errors.As(err, &le) {
		t.Fatalf("check after clear: %v", err)
	}
}

func TestMarkLostStopsAcquire(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	mustAcquire(t, a, nil)
	a.e.MarkLost("write failed with EBADE")
	var le *fence.LostError
	if _, err := a.e.Acquire(ctx(t), nil); !errors.As(err, &le) || !strings.Contains(err.Error(), "EBADE") {
		t.Fatalf("acquire after MarkLost: %v", err)
	}
	// Release still works: giving up is always allowed.
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("reservation left")
	}
}

func TestBrokenTargetFailsVerification(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{IgnoreReserve: true})
	a := newNode(t, tgt, "a", uuidA)
	_, err := a.e.Acquire(ctx(t), nil)
	if err == nil || !strings.Contains(err.Error(), "did not do what was asked") {
		t.Fatalf("acquire on a target ignoring RESERVE: %v", err)
	}
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("failed claim left a registration")
	}
}

func TestForeignRegistrationWithoutReservationDoesNotBlock(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	d := scsi.NewDevice("b", tgt.Initiator("b"))
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(b.key)}); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, a, nil)
	if tgt.CanWrite("b") {
		t.Fatal("registered non-holder can write")
	}
}

func TestForeignAllRegistrantsReservation(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	b := newNode(t, tgt, "b", uuidB)
	d := scsi.NewDevice("c", tgt.Initiator("c"))
	kc, _ := fence.KeyFromUUID(uuidC)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(kc)}))
	must(d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.Reserve, Type: 7, Key: uint64(kc)}))
	var he *fence.HeldError
	if _, err := a.e.Acquire(ctx(t), nil); !errors.As(err, &he) || he.Holder != kc || he.HolderNode != "node-c" {
		t.Fatalf("acquire against an all-registrants reservation: %v", err)
	}
	c := mustAcquire(t, b, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{kc}})
	if !slices.Equal(c.Preempted, []fence.Key{kc}) {
		t.Fatalf("claim %+v", c)
	}
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	if _, reg := tgt.Registered("c"); reg {
		t.Fatal("superseded registrant remains")
	}
}

func TestOwnRegistrantsTypeReservationIsNotAccepted(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	d := scsi.NewDevice("a", tgt.Initiator("a"))
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.RegisterAndIgnoreExistingKey, ServiceActionKey: uint64(a.key)}); err != nil {
		t.Fatal(err)
	}
	if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.Reserve, Type: 5, Key: uint64(a.key)}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.e.Acquire(ctx(t), nil); err == nil || !strings.Contains(err.Error(), "release") {
		t.Fatalf("acquire over own registrants-only reservation: %v", err)
	}
	// Release clears it (RELEASE with the reservation's own type).
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, a, nil)
}

func TestStatus(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "iqn.2026-11.lab:a", uuidA)
	b := newNode(t, tgt, "iqn.2026-11.lab:b", uuidB)
	mustAcquire(t, a, nil)
	s, err := b.e.Status(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if s.Reservation == nil || s.Reservation.Key != a.key || s.Reservation.Node != "node-a" || s.Reservation.Type != fence.WriteExclusive {
		t.Fatalf("status reservation %+v", s.Reservation)
	}
	if len(s.Keys) != 1 || s.Keys[0].Key != a.key || !s.Keys[0].Holder || s.Keys[0].Initiator != "iqn.2026-11.lab:a" {
		t.Fatalf("status keys %+v", s.Keys)
	}
	if s.Capabilities == nil || !s.Capabilities.TypeMaskValid {
		t.Fatalf("status capabilities %+v", s.Capabilities)
	}
}

func TestContextBoundsWaiting(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	c, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := a.e.Acquire(c, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("acquire with cancelled context: %v", err)
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("reserved despite cancelled context")
	}
}

func TestCycle(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA)
	st, err := Cycle(ctx(t), a.e, 5)
	if err != nil || st.Cycles != 5 || len(st.Acquire) != 5 || len(st.Release) != 5 || Median(st.Acquire) <= 0 {
		t.Fatalf("cycle: %+v, %v", st, err)
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("reservation left after cycles")
	}
	b := newNode(t, tgt, "b", uuidB)
	mustAcquire(t, b, nil)
	if st, err := Cycle(ctx(t), a.e, 3); err == nil || st.Cycles != 0 {
		t.Fatalf("cycle on a held disk: %+v, %v", st, err)
	}
}

func TestVerifyRunsBeforeEveryOperation(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	bad := errors.New("serial changed")
	var fail bool
	calls := 0
	a := newNode(t, tgt, "a", uuidA, func(c *Config) {
		c.Verify = func(context.Context) error {
			calls++
			if fail {
				return bad
			}
			return nil
		}
	})
	mustAcquire(t, a, nil)
	if err := a.e.Check(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if calls != 2 {
		t.Fatalf("verify ran %d times for 2 operations", calls)
	}
	fail = true
	n := len(tgt.Log())
	for name, op := range map[string]func() error{
		"acquire": func() error { _, err := a.e.Acquire(ctx(t), nil); return err },
		"release": func() error { return a.e.Release(ctx(t)) },
		"check":   func() error { return a.e.Check(ctx(t)) },
		"probe":   func() error { _, err := a.e.Probe(ctx(t)); return err },
		"status":  func() error { _, err := a.e.Status(ctx(t)); return err },
	} {
		if err := op(); !errors.Is(err, bad) {
			t.Errorf("%s with a failing identity check: %v", name, err)
		}
	}
	if len(tgt.Log()) != n {
		t.Fatalf("commands reached the device after the identity check failed: %v", tgt.Log()[n:])
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
}

func TestNotReadyIsWaitedOutBounded(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	a := newNode(t, tgt, "a", uuidA, func(c *Config) { c.ReadyAttempts = 5 })
	tgt.QueueNotReady("a", 3, 0x04, 0x01) // becoming ready
	mustAcquire(t, a, nil)
	if err := a.e.Release(ctx(t)); err != nil {
		t.Fatal(err)
	}
	tgt.QueueNotReady("a", 100, 0x04, 0x03) // manual intervention required
	_, err := a.e.Acquire(ctx(t), nil)
	if !errors.Is(err, scsi.ErrNotReady) || !strings.Contains(err.Error(), "after 5 attempts") {
		t.Fatalf("acquire on a unit that stays not ready: %v", err)
	}
	if _, reg := tgt.Registered("a"); reg {
		t.Fatal("registered on a unit that was not ready")
	}
}

func TestReservationMovesFromAnEarlierSessionOfThisNode(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{})
	old := newNode(t, tgt, "iqn.a,isid=1", uuidA)
	mustAcquire(t, old, nil)
	// The node comes back through a new I_T nexus (new iSCSI session): its
	// key holds the disk, but this path neither is registered nor holds
	// the reservation, so its writes would fail.
	now := newNode(t, tgt, "iqn.a,isid=2", uuidA)
	if err := now.e.Check(ctx(t)); err == nil {
		t.Fatal("check on a path that does not hold the reservation passed")
	}
	now = newNode(t, tgt, "iqn.a,isid=2", uuidA)
	c := mustAcquire(t, now, nil)
	if !c.Already {
		t.Fatalf("claim %+v", c)
	}
	assertHolder(t, tgt, "iqn.a,isid=2", now.key, fence.WriteExclusive)
	if !tgt.CanWrite("iqn.a,isid=2") || tgt.CanWrite("iqn.a,isid=1") {
		t.Fatal("write permissions after moving the reservation")
	}
	if _, reg := tgt.Registered("iqn.a,isid=1"); reg {
		t.Fatal("the earlier session is still registered")
	}
	if err := now.e.Check(ctx(t)); err != nil {
		t.Fatal(err)
	}
	var le *fence.LostError
	if err := old.e.Check(ctx(t)); !errors.As(err, &le) {
		t.Fatalf("check on the earlier session: %v", err)
	}
}
