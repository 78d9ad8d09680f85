package lease

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// FuzzLeaseRetake feeds an arbitrary lease area to an agent restart's
// Resume and, when that finds the claim lost with no holder named (as the
// agent's retakenUnused asks), to Retake. Nothing may panic; a damaged
// area is never written; a retake that succeeds was allowed by the area
// as it was (a held record of ours owned it, no other key's slot held or
// torn, no other key's claim above ours), leaves the engine the owner,
// and its check passes across renewals.
func FuzzLeaseRetake(f *testing.F) {
	tm := simTiming[1]
	own := EncodeSlot(Slot{Key: 0x1000, Epoch: 3, Counter: 9, State: StateHeld, Timing: tm, Node: "a"})
	other := EncodeSlot(Slot{Key: 0x5000, Epoch: 4, Counter: 2, State: StateReleased, Timing: tm, Node: "b"})
	below := EncodeSlot(Slot{Key: 0x5000, Epoch: 2, Counter: 2, State: StateHeld, Timing: tm, Node: "b"})
	f.Add(own, uint8(3), uint8(0))
	f.Add(append(bytes.Clone(own), other...), uint8(3), uint8(0))
	f.Add(append(bytes.Clone(own), below...), uint8(3), uint8(0))
	f.Add(append(bytes.Clone(own), tornBlock(0x5000, tm)...), uint8(15), uint8(0))
	f.Add(own, uint8(1), uint8(fuzzSealSlots))
	f.Fuzz(func(t *testing.T, slots []byte, at uint8, flags uint8) {
		retakeArea(t, slots, at, flags)
	})
}

// TestRetakeOnRandomAreas runs FuzzLeaseRetake's check on areas made
// from a seeded stream: our stale record and up to three other slots of
// any state, epoch and key, some torn, some with our key.
func TestRetakeOnRandomAreas(t *testing.T) {
	tm := simTiming[1]
	r := rand.New(rand.NewPCG(23, 23))
	for n := range 300 {
		var area []byte
		blocks := 1 + r.IntN(4)
		for b := range blocks {
			key := fence.Key(0x1000)
			if b > 0 && r.IntN(4) > 0 {
				key = fence.Key(0x2000 + r.IntN(3)*0x1000)
			}
			s := Slot{Key: key, Epoch: 1 + uint64(r.IntN(6)), Counter: 1 + uint64(r.IntN(9)),
				State: State(1 + r.IntN(3)), Timing: tm, Node: "n"}
			if b == 0 {
				s.State = StateHeld
			}
			blk := EncodeSlot(s)
			if r.IntN(8) == 0 {
				blk = tornBlock(key, tm)
			}
			area = append(area, blk...)
		}
		at := uint8(r.IntN(Slots))
		t.Run("", func(t *testing.T) {
			_ = n
			retakeArea(t, area, at, 0)
		})
	}
}

func retakeArea(t *testing.T, slots []byte, at uint8, flags uint8) {
	tm := simTiming[1]
	disk := fuzzDisk(slots, at, nil, flags)
	orig := bytes.Clone(disk.data)
	a0, derr := DecodeArea(orig)
	key := fence.Key(0x1000)
	synctest.Test(t, func(t *testing.T) {
		step := func(d time.Duration) context.Context {
			ctx, cancel := context.WithTimeout(context.Background(), d)
			t.Cleanup(cancel)
			return ctx
		}
		defer time.Sleep(time.Minute)
		// The fuzzed slots carry times of their own; the restart comes
		// past any fail bound they could be young within.
		time.Sleep(time.Hour)
		e := scriptedNode(t, disk, key, tm, func(*fence.LostError) bool { return true })
		err := e.Resume(step(time.Minute))
		var lost *fence.LostError
		if !errors.As(err, &lost) || lost.Holder != 0 {
			return
		}
		_, err = e.Retake(step(3 * time.Minute))
		if err != nil {
			return
		}
		if derr != nil {
			t.Fatalf("retook a lease area that does not decode (%v)", derr)
		}
		o := a0.Owner()
		if o < 0 || a0.Slots[o].Key != key {
			t.Fatalf("retook a lease whose owner was slot %d, not a record of ours", o)
		}
		for i, s := range a0.Slots {
			if a0.Corrupt[i] {
				t.Fatalf("retook a lease with slot %d torn", i)
			}
			if s.Key != key && s.Live() {
				t.Fatalf("retook a lease whose slot %d is held by key %s", i, s.Key)
			}
			if s.Key != key && s.State != StateEmpty && s.Epoch > a0.Slots[o].Epoch {
				t.Fatalf("retook a lease key %s claimed above our record (slot %d, epoch %d over %d)", s.Key, i, s.Epoch, a0.Slots[o].Epoch)
			}
		}
		fuzzHolds(t, e, disk, key)
		_ = e.Release(step(time.Minute))
	})
	if derr != nil && !bytes.Equal(disk.data, orig) {
		t.Fatalf("a lease area refused (%v) was written", derr)
	}
}
