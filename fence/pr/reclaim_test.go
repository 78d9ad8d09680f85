package pr

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// holding is a Contents that reports data on the disk and counts calls.
func holding(calls *atomic.Int32) func(context.Context) (string, error) {
	return func(context.Context) (string, error) {
		calls.Add(1)
		return "ext4 superblock at byte 1080", nil
	}
}

// readKeys reports whether cdb is PERSISTENT RESERVE IN, READ KEYS.
func readKeys(cdb []byte) bool {
	return len(cdb) > 1 && cdb[0] == scsi.OpPersistentReserveIn && scsi.PRInAction(cdb[1]&0x1f) == scsi.ReadKeys
}

// forever is a wait no test sits out: an engine that waits when it should
// not ends with the test context's deadline instead of a claim.
const forever = time.Hour

func TestForgottenDiskWithDataIsClaimedAfterTheWaitWhenNobodyReturns(t *testing.T) {
	tgt, a, b := restarted(t)
	var calls atomic.Int32
	polls := 0
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini == "b" && readKeys(cdb) {
			polls++
		}
	}
	const wait = 200 * time.Millisecond
	start := time.Now()
	c, err := b.e.AcquireWaiting(ctx(t), nil, fence.ReclaimWait{Wait: wait, Poll: 20 * time.Millisecond, Contents: holding(&calls)})
	if err != nil {
		t.Fatalf("b after the wait, with no holder back: %v", err)
	}
	if waited := time.Since(start); waited < wait {
		t.Fatalf("b claimed after %s, before the %s wait was over", waited, wait)
	}
	if c.Key != b.key || calls.Load() != 1 || polls < 3 {
		t.Fatalf("claim %+v, contents read %d times, %d READ KEYS: want b's claim after one look at the contents and polls during the wait", c, calls.Load(), polls)
	}
	assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	// The holder that comes back too late fences itself, naming b.
	tgt.BeforeCommand = nil
	wantLostTo(t, reestablish(t, a), b)
}

func TestHolderReestablishingDuringTheWaitIsNotOverruled(t *testing.T) {
	tgt, a, b := restarted(t)
	var calls atomic.Int32
	polls := 0
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini != "b" || !readKeys(cdb) {
			return
		}
		// The first READ KEYS is the acquire's own read; a's periodic
		// check comes round during b's wait.
		if polls++; polls == 3 {
			if _, err := a.e.Reestablish(ctx(t)); err != nil {
				t.Errorf("a's re-establish during b's wait: %v", err)
			}
		}
	}
	_, err := b.e.AcquireWaiting(ctx(t), nil, fence.ReclaimWait{Wait: forever, Poll: 10 * time.Millisecond, Contents: holding(&calls)})
	var he *fence.HeldError
	if !errors.As(err, &he) || he.Holder != a.key || he.HolderNode != "node-a" || he.Granted {
		t.Fatalf("b after a re-established during its wait: %v, want a refusal naming a", err)
	}
	if !strings.Contains(he.Error(), "held by another node") {
		t.Fatalf("refusal text: %v", he)
	}
	assertHolder(t, tgt, "a", a.key, fence.WriteExclusive)
	if _, reg := tgt.Registered("b"); reg {
		t.Fatal("b registered on a disk a re-established")
	}
	if tgt.CanWrite("b") || !tgt.CanWrite("a") {
		t.Fatalf("a can write %v, b can write %v", tgt.CanWrite("a"), tgt.CanWrite("b"))
	}
	tgt.BeforeCommand = nil
	if err := a.e.Check(ctx(t)); err != nil {
		t.Fatalf("a's claim after b gave up: %v", err)
	}
}

func TestKeyRegisteredWithoutReservationAtTheEndOfTheWaitIsRefused(t *testing.T) {
	tgt, a, b := restarted(t)
	var calls atomic.Int32
	// a's key registered, its RESERVE not yet come: a holder half-way
	// through re-establishing when b's wait ends.
	d := scsi.NewDevice("a", tgt.Initiator("a"))
	polls := 0
	tgt.BeforeCommand = func(ini string, cdb []byte) {
		if ini != "b" || !readKeys(cdb) {
			return
		}
		if polls++; polls == 2 {
			if err := d.PersistentReserveOut(ctx(t), scsi.PROut{Action: scsi.Register, ServiceActionKey: uint64(a.key)}); err != nil {
				t.Error(err)
			}
		}
	}
	_, err := b.e.AcquireWaiting(ctx(t), nil, fence.ReclaimWait{Wait: 50 * time.Millisecond, Poll: 10 * time.Millisecond, Contents: holding(&calls)})
	var he *fence.HeldError
	if !errors.As(err, &he) || he.Holder != a.key || he.HolderNode != "node-a" {
		t.Fatalf("b with a's key registered and no reservation after the wait: %v, want a refusal naming a", err)
	}
	if _, reg := tgt.Registered("b"); reg {
		t.Fatal("b registered")
	}
	if _, _, _, ok := tgt.Reservation(); ok {
		t.Fatal("b reserved")
	}
}

func TestNoWaitForADiskThatIsNotForgotten(t *testing.T) {
	// claimsAtOnce: b claims without looking at the contents.
	claimsAtOnce := func(t *testing.T, tgt *scsitest.Target, b *node, g *fence.Grant) {
		t.Helper()
		var calls atomic.Int32
		if _, err := b.e.AcquireWaiting(ctx(t), g, fence.ReclaimWait{Wait: forever, Poll: 10 * time.Millisecond, Contents: holding(&calls)}); err != nil {
			t.Fatalf("b: %v", err)
		}
		if calls.Load() != 0 {
			t.Fatal("the contents were examined")
		}
		assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	}
	t.Run("released by its holder: generation above 0", func(t *testing.T) {
		tgt := scsitest.New(scsitest.Options{})
		a := newNode(t, tgt, "a", uuidA)
		mustAcquire(t, a, nil)
		if err := a.e.Release(ctx(t)); err != nil {
			t.Fatal(err)
		}
		claimsAtOnce(t, tgt, newNode(t, tgt, "b", uuidB), nil)
	})
	t.Run("blank disk on a target at generation 0", func(t *testing.T) {
		tgt := scsitest.New(scsitest.Options{})
		b := newNode(t, tgt, "b", uuidB)
		calls := 0
		blank := func(context.Context) (string, error) { calls++; return "", nil }
		if _, err := b.e.AcquireWaiting(ctx(t), nil, fence.ReclaimWait{Wait: forever, Contents: blank}); err != nil {
			t.Fatalf("b on a new blank disk: %v", err)
		}
		if calls != 1 {
			t.Fatalf("contents examined %d times, want once", calls)
		}
		assertHolder(t, tgt, "b", b.key, fence.WriteExclusive)
	})
	t.Run("stage with a grant", func(t *testing.T) {
		tgt, a, b := restarted(t)
		claimsAtOnce(t, tgt, b, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{a.key}})
	})
	t.Run("held: refused at once", func(t *testing.T) {
		tgt := scsitest.New(scsitest.Options{})
		a := newNode(t, tgt, "a", uuidA)
		b := newNode(t, tgt, "b", uuidB)
		mustAcquire(t, a, nil)
		var calls atomic.Int32
		w := fence.ReclaimWait{Wait: forever, Poll: 10 * time.Millisecond, Contents: holding(&calls)}
		if _, err := b.e.AcquireWaiting(ctx(t), nil, w); !errors.As(err, new(*fence.HeldError)) || calls.Load() != 0 {
			t.Fatalf("b on a held disk: %v (contents examined %d times)", err, calls.Load())
		}
	})
}

func TestUnknownContentsCountAsData(t *testing.T) {
	for name, contents := range map[string]func(context.Context) (string, error){
		"no contents probe": nil,
		"probe fails":       func(context.Context) (string, error) { return "", errors.New("read error") },
	} {
		t.Run(name, func(t *testing.T) {
			tgt, _, b := restarted(t)
			// READ KEYS before b's first PERSISTENT RESERVE OUT: 1 is the
			// acquire's own read, more are polls of a wait.
			reads, out := 0, false
			tgt.BeforeCommand = func(ini string, cdb []byte) {
				switch {
				case ini != "b" || out:
				case cdb[0] == scsi.OpPersistentReserveOut:
					out = true
				case readKeys(cdb):
					reads++
				}
			}
			if _, err := b.e.AcquireWaiting(ctx(t), nil, fence.ReclaimWait{Wait: 50 * time.Millisecond, Poll: 10 * time.Millisecond, Contents: contents}); err != nil {
				t.Fatal(err)
			}
			if reads < 3 {
				t.Fatalf("b read the keys %d times before claiming: it did not wait", reads)
			}
		})
	}
}

func TestTheWaitEndsWithTheContext(t *testing.T) {
	tgt, _, b := restarted(t)
	var calls atomic.Int32
	c, cancel := context.WithCancel(ctx(t))
	defer cancel()
	// The caller gives up as the wait begins.
	leave := func(c context.Context) (string, error) {
		cancel()
		return holding(&calls)(c)
	}
	_, err := b.e.AcquireWaiting(c, nil, fence.ReclaimWait{Wait: forever, Poll: 10 * time.Millisecond, Contents: leave})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("acquire whose context ended during the wait: %v, want the context's error", err)
	}
	if _, reg := tgt.Registered("b"); reg {
		t.Fatal("b registered")
	}
	if !strings.Contains(err.Error(), "re-establish") {
		t.Fatalf("error does not say what was waited for: %v", err)
	}
}
