package lease

import (
	"bytes"
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// A slot crafted with epoch 2^64-1 (a hostile or imported disk image)
// must not take the agent down: the next claim's epoch would wrap to 0.
// The lease area is refused as damaged, naming the slot and the field,
// and nothing is written.
func TestSlotWithTheLastEpochIsRefusedNotAPanic(t *testing.T) {
	for _, state := range []State{StateReleased, StateHeld} {
		t.Run(state.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				disk := formattedSimDisk(512)
				tm := simTiming[1]
				copy(disk.data[BlockSize*(1+3):], EncodeSlot(Slot{Key: 0x5000, Epoch: math.MaxUint64, Counter: 1, State: state, Timing: tm}))
				before := bytes.Clone(disk.data)
				e := scriptedNode(t, disk, 0x1000, tm, nil)
				ctx, cancel := context.WithTimeout(context.Background(), 10*tm.Expiry())
				defer cancel()
				_, err := e.Acquire(ctx, nil)
				if err == nil || !strings.Contains(err.Error(), "slot 3") || !strings.Contains(err.Error(), "epoch") {
					t.Fatalf("acquiring past a slot with epoch 2^64-1: %v, want a refusal naming slot 3 and its epoch", err)
				}
				if !bytes.Equal(disk.data, before) {
					t.Error("the refused lease area was written")
				}
			})
		})
	}
}

// Every field of a slot that the engine computes with is bounded: a slot
// that passes its checksum (a whole write) with a field out of bounds is
// a damaged lease area, refused naming the field; a slot that fails it
// (a torn write) is not.
func TestDamagedSlotNamesItsField(t *testing.T) {
	tm := DefaultTiming()
	ok := Slot{Key: keyA, Epoch: 4, Counter: 2, State: StateHeld, Timing: tm}
	cases := []struct {
		field string
		s     func(Slot) Slot
	}{
		{"key", func(s Slot) Slot { s.Key = 0; return s }},
		{"epoch", func(s Slot) Slot { s.Epoch = 0; return s }},
		{"epoch", func(s Slot) Slot { s.Epoch = MaxSlotEpoch + 1; return s }},
		{"counter", func(s Slot) Slot { s.Counter = MaxSlotCounter + 1; return s }},
		{"state", func(s Slot) Slot { s.State = 9; return s }},
		{"state", func(s Slot) Slot { s.State = StateEmpty; return s }},
		{"timing", func(s Slot) Slot { s.Timing = Timing{}; return s }},
	}
	for _, c := range cases {
		a := area(Slot{Key: keyB, Epoch: 1, State: StateReleased, Timing: tm})
		b := a.bytes()
		copy(b[BlockSize*(1+7):], EncodeSlot(c.s(ok)))
		_, err := DecodeArea(b)
		var d *DamagedError
		if !errors.As(err, &d) || !errors.Is(err, ErrDamaged) || d.Slot != 7 || d.Field != c.field {
			t.Errorf("%s out of bounds: %v (%+v), want a damaged lease naming slot 7's %s", c.field, err, d, c.field)
		}
	}
	a := area(Slot{Key: keyB, Epoch: MaxSlotEpoch, Counter: MaxSlotCounter, State: StateReleased, Timing: tm})
	if a.Corrupt[0] || a.Slots[0].Epoch != MaxSlotEpoch {
		t.Errorf("a slot at the bounds does not decode")
	}
	b := a.bytes()
	b[BlockSize+20] ^= 1 // a torn write: the checksum fails
	if a, err := DecodeArea(b); err != nil || !a.Corrupt[0] {
		t.Errorf("a slot failing its checksum: %v, want marked corrupt", err)
	}
}

// A disk whose slots carry the highest epoch the layout allows takes no
// claim above it: refused as damaged, before anything is written.
func TestNoClaimAboveTheLastEpoch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		copy(disk.data[BlockSize*(1+3):], EncodeSlot(Slot{Key: 0x5000, Epoch: MaxSlotEpoch, Counter: 1, State: StateReleased, Timing: tm}))
		before := bytes.Clone(disk.data)
		e := scriptedNode(t, disk, 0x1000, tm, nil)
		_, err := e.Acquire(context.Background(), nil)
		if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), "epoch") {
			t.Fatalf("claim above the last epoch: %v", err)
		}
		if !bytes.Equal(disk.data, before) {
			t.Error("written")
		}
	})
}

// The header's geometry fields are each named when they are not the ones
// this agent writes.
func TestDamagedHeaderNamesItsField(t *testing.T) {
	good := Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset}
	for field, h := range map[string]Header{
		"version":     {Version: 2, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset},
		"block size":  {Version: version, BlockSize: 512, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset},
		"slot count":  {Version: version, BlockSize: BlockSize, Slots: 1 << 31, SlotOffset: BlockSize, DataOffset: DataOffset},
		"slot offset": {Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: math.MaxUint64, DataOffset: DataOffset},
		"data offset": {Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: 0},
	} {
		_, err := DecodeHeader(EncodeHeader(h))
		var d *DamagedError
		if !errors.As(err, &d) || d.Slot != -1 || d.Field != field || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: %v, want a damaged lease header naming it", field, err)
		}
	}
	b := EncodeHeader(good)
	b[100] = 1
	if _, err := DecodeHeader(b); !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), "checksum") {
		t.Errorf("header failing its checksum: %v", err)
	}
}

// A holder whose lease area is damaged under it (a slot crafted while it
// holds) cannot verify its claim: its check says why, naming the field,
// so does its loss once the fail bound has passed without a renewal, and
// an agent restarted then takes the damage for a lost claim (its
// caller stops the volume's I/O) rather than retrying for ever with the
// host watchdog unfed.
func TestDamageUnderAHolder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		e := scriptedNode(t, disk, 0x1000, tm, func(*fence.LostError) bool { return true })
		if _, err := e.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		copy(disk.data[BlockSize*(1+12):], EncodeSlot(Slot{Key: 0x5000, Epoch: MaxSlotEpoch + 7, Counter: 1, State: StateHeld, Timing: tm}))
		if err := e.Check(context.Background()); !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), "epoch") {
			t.Errorf("check of a claim whose lease area was damaged: %v", err)
		}
		time.Sleep(tm.Fail + tm.Renew)
		if l := e.Lost(); l == nil || !strings.Contains(l.Reason, "epoch") {
			t.Errorf("a holder that could not verify its claim for the fail bound: loss %v, want one naming the damaged field", l)
		}
		r := scriptedNode(t, disk, 0x1000, tm, nil)
		var lost *fence.LostError
		if err := r.Resume(context.Background()); !errors.As(err, &lost) || !strings.Contains(err.Error(), "epoch") {
			t.Errorf("resume on a damaged lease area: %v, want a lost claim naming the field", err)
		}
	})
}
