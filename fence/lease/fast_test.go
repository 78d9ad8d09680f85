package lease

import (
	"context"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// The never-published fast path, scripted on the fake clock: which
// acquisitions skip the settle wait and which slot they write. The
// simulator (sim_test.go, class first) races it against other hosts.

func fastNode(t *testing.T, disk *simDisk, key fence.Key, io time.Duration) *Engine {
	t.Helper()
	e, err := New(&Device{name: fmt.Sprintf("fast-%s", key), f: &simDevice{disk: disk, script: func(bool) time.Duration { return io }},
		sem: make(chan struct{}, 1), size: 1 << 30}, Config{Key: key, Node: key.String(), Serial: "disk-1"})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// A first stage (AcquireFirst) of a blank lease area holds the disk once
// its claim has landed: no settle wait, no second read. It writes
// FastSlot and renews as any holder.
func TestFirstClaimOfABlankAreaSkipsTheSettleWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		e := fastNode(t, disk, 0x1234, 5*time.Millisecond)
		start := time.Now()
		c, err := e.AcquireFirst(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		if took >= e.cfg.Timing.Settle() || took > FastClaimWithin {
			t.Fatalf("first claim of a blank area took %s; want it held without the settle wait (%s)", took, e.cfg.Timing.Settle())
		}
		if c.Key != 0x1234 || e.Stats().FastClaims != 1 {
			t.Fatalf("claim %+v, fast claims %d", c, e.Stats().FastClaims)
		}
		a, _ := DecodeArea(disk.data)
		if o := a.Owner(); o != FastSlot || a.Slots[o].Key != 0x1234 {
			t.Fatalf("owner slot %d (%+v), want slot %d of our key", o, a.Slots[max(o, 0)], FastSlot)
		}
		time.Sleep(e.cfg.Timing.Renew + time.Second)
		if err := e.Check(context.Background()); err != nil {
			t.Fatalf("the fast claim is not renewed: %v", err)
		}
		if e.Stats().Renewals == 0 {
			t.Fatal("no renewal one renewal interval after the fast claim")
		}
		if err := e.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// A first claim whose read and write took longer than FastClaimWithin
// settles and is checked like any other: a racer with the shortest I/O
// timeout may already have checked its own claim without seeing it.
func TestSlowFirstClaimSettles(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		e := fastNode(t, disk, 0x1234, FastClaimWithin/2+time.Millisecond)
		start := time.Now()
		if _, err := e.AcquireFirst(context.Background()); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took < e.cfg.Timing.Settle() {
			t.Fatalf("a first claim whose read and write took %s held the disk after %s, without the settle wait", FastClaimWithin+2*time.Millisecond, took)
		}
		if n := e.Stats().FastClaims; n != 0 {
			t.Fatalf("%d fast claims, want 0", n)
		}
		e.Release(context.Background())
	})
}

// Only AcquireFirst on an area that was blank from its first read is
// fast: a plain Acquire of a blank area, and AcquireFirst of a clone
// whose copied slots it cleared, settle as before.
func TestOnlyAFirstClaimOfABlankAreaIsFast(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		e := fastNode(t, disk, 0x1234, 5*time.Millisecond)
		start := time.Now()
		if _, err := e.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took < e.cfg.Timing.Settle() {
			t.Fatalf("a plain Acquire of a blank area took %s, without the settle wait", took)
		}
		e.Release(context.Background())

		clone := formattedSimDisk(512)
		copy(clone.data[BlockSize*(1+7):], EncodeSlot(Slot{Key: 0x999, Epoch: 3, Counter: 8, State: StateHeld, Timing: DefaultTiming(), Serial: "source-disk"}))
		f := fastNode(t, clone, 0x1234, 5*time.Millisecond)
		start = time.Now()
		if _, err := f.AcquireFirst(context.Background()); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took < f.cfg.Timing.Settle() || f.Stats().FastClaims != 0 {
			t.Fatalf("AcquireFirst of a clone with a copied slot took %s (%d fast claims): clearing copies must not lead to a fast claim", took, f.Stats().FastClaims)
		}
		f.Release(context.Background())
	})
}

// An empty FastSlot is written only by a fast claim: a host whose slot
// order starts there, acquiring a blank area, takes the next slot, so it
// can never erase a fast claim it did not see. Once FastSlot is used
// (released), it is reused as any released slot.
func TestClaimsOtherThanTheFastOneSkipAnEmptyFastSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		key := fence.Key(0x2000)
		for ; fastNode(t, disk, key, time.Millisecond).slotOrder() != FastSlot; key++ {
		}
		e := fastNode(t, disk, key, time.Millisecond)
		if _, err := e.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		a, _ := DecodeArea(disk.data)
		if a.Slots[FastSlot].State != StateEmpty || a.Find(key) != FastSlot+1 {
			t.Fatalf("a key whose slot order starts at FastSlot claimed slot %d of a blank area; want %d, FastSlot left empty", a.Find(key), FastSlot+1)
		}
		e.Release(context.Background())
	})
}

// The fast path's bound rests on MinIOTimeout: no engine runs with a
// shorter I/O timeout.
func TestEngineRefusesAnIOTimeoutBelowTheMinimum(t *testing.T) {
	disk := formattedSimDisk(512)
	tm := Timing{IOTimeout: MinIOTimeout - time.Millisecond, Renew: time.Second, Fail: 4 * time.Second}
	if _, err := New(&Device{name: "short", f: &simDevice{disk: disk}, sem: make(chan struct{}, 1), size: 1 << 30},
		Config{Key: 1, Timing: tm}); err == nil {
		t.Fatalf("New accepted timing %s, below the minimum I/O timeout %s", tm, MinIOTimeout)
	}
}

// A host paused between its read of the blank area and its claim write
// does not see the pause on its clock. Another host that wrote its claim
// meanwhile (here injected as the pause's outcome: its claim, taken on a
// disk of its own, copied in just before ours is written) must be seen:
// the first claim is then not fast, and does not hold the disk beside it.
func TestFastClaimAfterAPauseSeesAClaimWrittenMeanwhile(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		other := formattedSimDisk(512)
		b := fastNode(t, other, 0x5678, 5*time.Millisecond)
		if _, err := b.Acquire(ctx, nil); err != nil {
			t.Fatal(err)
		}
		ob, _ := DecodeArea(other.data)
		bslot := ob.Owner()
		bblk := append([]byte(nil), ob.Raw[bslot]...)
		defer b.Release(ctx)

		disk := formattedSimDisk(512)
		a := fastNode(t, disk, 0x1234, 5*time.Millisecond)
		testHookClaimWrite = func(e *Engine, idx int, blk []byte) {
			if e == a {
				disk.mu.Lock()
				copy(disk.data[BlockSize*(1+bslot):], bblk)
				disk.mu.Unlock()
			}
		}
		t.Cleanup(func() { testHookClaimWrite = nil })
		start := time.Now()
		_, err := a.AcquireFirst(ctx)
		took := time.Since(start)
		defer a.Release(ctx) // stops its renewer whatever the outcome
		if n := a.Stats().FastClaims; n != 0 {
			t.Fatalf("the first claim was held as fast (%d) beside another host's claim in slot %d", n, bslot)
		}
		if err == nil && took < a.cfg.Timing.Settle() {
			t.Fatalf("the first claim was held after %s, before the settle wait, beside another host's claim", took)
		}
	})
}
