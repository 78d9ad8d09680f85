package lease

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// tornBlock is what a host reset leaves in a slot in the middle of a
// renewal of a held slot: the new write's first sector, the rest of the
// old one, so the block does not pass its checksum.
func tornBlock(key fence.Key, tm Timing) []byte {
	old := EncodeSlot(Slot{Key: key, Epoch: 2, Counter: 7, State: StateHeld, Timing: tm})
	torn := EncodeSlot(Slot{Key: key, Epoch: 2, Counter: 8, State: StateHeld, Timing: tm})
	copy(torn[512:], old[512:])
	return torn
}

// scriptedNode is an engine on disk whose every I/O takes 10 ms.
func scriptedNode(t *testing.T, disk *simDisk, key fence.Key, tm Timing, onLost func(*fence.LostError) bool) *Engine {
	t.Helper()
	dev := &simDevice{disk: disk, script: func(bool) time.Duration { return 10 * time.Millisecond }}
	e, err := New(&Device{name: key.String(), f: dev, sem: make(chan struct{}, 1), size: 1 << 30},
		Config{Key: key, Node: fmt.Sprintf("00000000-0000-4000-8000-%012x", uint64(key)&(1<<48-1)), Timing: tm, OnLost: onLost})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// slotBytes is slot i of disk as it is now.
func slotBytes(disk *simDisk, i int) []byte {
	b := make([]byte, BlockSize)
	disk.readBlock(b, BlockSize*(1+i))
	return b
}

// A slot torn by a host reset (its writer is gone) is waited out by the
// first acquisition after it, for its expiry bound, and then cleared: a
// later acquisition of the free disk takes the settle wait only, and a
// granted takeover takes only its own bound, not the torn slot's expiry
// bound again.
func TestTornSlotIsWaitedOutOnceThenCleared(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		const tornSlot = 6
		copy(disk.data[BlockSize*(1+tornSlot):], tornBlock(0x5000, tm))
		a := scriptedNode(t, disk, 0x1000, tm, func(*fence.LostError) bool { return true })
		start := time.Now()
		if _, err := a.Acquire(context.Background(), nil); err != nil {
			t.Fatalf("first acquisition past a torn slot: %v", err)
		}
		if took := time.Since(start); took < tm.Expiry() {
			t.Fatalf("first acquisition past a torn slot took %s, below its expiry bound %s", took, tm.Expiry())
		}
		if got := slotBytes(disk, tornSlot); !allZero(got) {
			t.Errorf("the torn slot waited out is still there after the acquisition: it is waited out again by every later one")
		}
		if err := a.Release(context.Background()); err != nil {
			t.Fatal(err)
		}

		// The free disk: the settle wait and a few I/Os.
		b := scriptedNode(t, disk, 0x2000, tm, func(*fence.LostError) bool { return true })
		start = time.Now()
		if _, err := b.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		if took, bound := time.Since(start), tm.Settle()+time.Second; took > bound {
			t.Errorf("acquiring the free disk again took %s (expiry bound %s); want the settle wait, under %s", took, tm.Expiry(), bound)
		}

		// A granted takeover of b, live: its own bound.
		c := scriptedNode(t, disk, 0x3000, tm, nil)
		start = time.Now()
		if _, err := c.Acquire(context.Background(), &fence.Grant{Node: c.cfg.Node, Supersedes: []fence.Key{b.cfg.Key}}); err != nil {
			t.Fatal(err)
		}
		if took, bound := time.Since(start), tm.Bounds().GrantLiveSlowIO; took > bound {
			t.Errorf("granted takeover took %s, past its bound %s (expiry bound %s)", took, bound, tm.Expiry())
		}
		_ = c.Release(context.Background())
		_ = b.Release(context.Background())
	})
}

// A disk whose sixteen slots were all torn (sixteen host resets in the
// middle of a write) is still acquired, once they were waited out, and
// they are cleared: the next acquisition is quick.
func TestSixteenTornSlotsLeaveTheDiskUsable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		for i := range Slots {
			copy(disk.data[BlockSize*(1+i):], tornBlock(fence.Key(0x5000+i), tm))
		}
		a := scriptedNode(t, disk, 0x1000, tm, func(*fence.LostError) bool { return true })
		if _, err := a.Acquire(context.Background(), nil); err != nil {
			t.Fatalf("acquiring a disk whose every slot is torn: %v", err)
		}
		if err := a.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
		for i := range Slots {
			s := slotBytes(disk, i)
			if !allZero(s) && !bytes.Equal(s[:8], []byte(slotMagic)) {
				t.Errorf("slot %d: not cleared", i)
			}
			if _, err := DecodeSlot(s); err != nil {
				t.Errorf("slot %d still does not decode: %v", i, err)
			}
		}
		b := scriptedNode(t, disk, 0x2000, tm, nil)
		start := time.Now()
		if _, err := b.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		if took, bound := time.Since(start), tm.Settle()+time.Second; took > bound {
			t.Errorf("the next acquisition took %s; want under %s", took, bound)
		}
		_ = b.Release(context.Background())
	})
}

// A slot that does not decode and changes while it is waited out has a
// live writer: the acquisition is refused and the slot is left as its
// writer wrote it.
func TestTornSlotThatChangesIsNotCleared(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		const tornSlot = 4
		copy(disk.data[BlockSize*(1+tornSlot):], tornBlock(0x5000, tm))
		again := tornBlock(0x5000, tm)
		again[30] ^= 0xff // another write of the same slot, caught half landed too
		go func() {
			time.Sleep(tm.Expiry() / 2)
			disk.landSector(BlockSize*(1+tornSlot), again)
		}()
		a := scriptedNode(t, disk, 0x1000, tm, nil)
		_, err := a.Acquire(context.Background(), nil)
		var held *fence.HeldError
		if !errors.As(err, &held) {
			t.Fatalf("acquisition past a torn slot that changed: %v, want refused", err)
		}
		if got := slotBytes(disk, tornSlot); !bytes.Equal(got, again) {
			t.Error("the slot a live writer changed was overwritten")
		}
	})
}
