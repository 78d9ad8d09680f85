package lease

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// FuzzDecodeArea feeds arbitrary blocks to the lease area decoder as the
// header and two slots of an otherwise empty area (small inputs keep the
// fuzzer fast; every slot is decoded the same way): it must never panic,
// whatever it accepts must re-encode to the same blocks, and the owner it
// names must be a live, intact slot.
func FuzzDecodeArea(f *testing.F) {
	held := area(Slot{Key: keyA, Epoch: 3, Counter: 9, State: StateHeld, Timing: testTiming, Node: "a"})
	f.Add(held.bytes()[:BlockSize], held.Raw[0], []byte{})
	f.Fuzz(func(t *testing.T, header, slot0, slot1 []byte) {
		b := make([]byte, ReadSize)
		copy(b[:BlockSize], header)
		copy(b[BlockSize:2*BlockSize], slot0)
		copy(b[2*BlockSize:3*BlockSize], slot1)
		a, err := DecodeArea(b)
		if err != nil {
			return
		}
		if !bytes.Equal(EncodeHeader(a.Header), b[:BlockSize]) {
			t.Fatalf("header does not re-encode")
		}
		for i, s := range a.Slots {
			if a.Corrupt[i] || s.State == StateEmpty {
				continue
			}
			if !bytes.Equal(EncodeSlot(s), b[BlockSize*(1+i):BlockSize*(2+i)]) {
				t.Fatalf("slot %d does not re-encode: %+v", i, s)
			}
		}
		if o := a.Owner(); o >= 0 && (!a.Slots[o].Live() || a.Corrupt[o]) {
			t.Fatalf("owner %d is not a live slot", o)
		}
	})
}

// FuzzClassify: any head and tail classify without panicking, and a blank
// answer means zeros.
func FuzzClassify(f *testing.F) {
	f.Add([]byte("XFSB"), []byte{})
	f.Add(make([]byte, 8192), make([]byte, 70000))
	f.Fuzz(func(t *testing.T, head, tail []byte) {
		c := Classify(head, tail)
		if c.Layout == LayoutBlank && (!allZero(head) || !allZero(tail)) {
			t.Fatalf("non-zero input classified blank")
		}
		if c.Layout == LayoutForeign && c.Signature == "" {
			t.Fatalf("foreign without a name")
		}
	})
}

func (a *Area) bytes() []byte {
	b := make([]byte, ReadSize)
	copy(b, EncodeHeader(a.Header))
	for i := range a.Raw {
		copy(b[BlockSize*(1+i):], a.Raw[i])
	}
	return b
}

// Flags of FuzzLeaseEngine's input.
const (
	// fuzzSealSlots gives every non-zero slot block the slot magic and a
	// checksum that matches, so the fuzzer's fields reach the bounds
	// checks and the engine rather than being read as torn writes.
	fuzzSealSlots = 1 << iota
	// fuzzSealHeader recomputes the header's checksum after the fuzzed
	// header bytes were laid over a valid header.
	fuzzSealHeader
	// fuzzOwnKey: the engine's key is the one in the first non-zero slot
	// block (its own record, from an earlier run).
	fuzzOwnKey
	// fuzzGrant: the acquisition carries a grant naming every other key
	// in the slot blocks.
	fuzzGrant
	// fuzzFirst: AcquireFirst (the controller says no node had the disk).
	fuzzFirst
)

// FuzzLeaseEngine feeds an arbitrary lease area (slot blocks laid from
// slot at on, optionally a header laid over a valid one) to the engine in
// the schedule simulator's fake clock: an acquisition (Acquire or
// AcquireFirst, with or without a grant), checks while the lease is held
// and renewed, a release, then an agent restart's Resume on the area as
// it was, and ReadStatus. Nothing may panic (here or in the engine's
// goroutines); a damaged lease area (DecodeArea refuses it) fails every
// operation and is never written; an acquisition that succeeds leaves
// the engine the owner, and its check passes.
func FuzzLeaseEngine(f *testing.F) {
	tm := simTiming[1]
	held := EncodeSlot(Slot{Key: 0x5000, Epoch: 3, Counter: 9, State: StateHeld, Timing: tm, Node: "h"})
	released := EncodeSlot(Slot{Key: 0x5000, Epoch: 3, Counter: 9, State: StateReleased, Timing: tm})
	lastEpoch := EncodeSlot(Slot{Key: 0x5000, Epoch: 1<<64 - 1, Counter: 1, State: StateReleased, Timing: tm})
	torn := tornBlock(0x5000, tm)
	sixteenTorn := bytes.Repeat(torn, Slots)
	f.Add([]byte{}, uint8(0), []byte{}, uint8(0))
	f.Add(held, uint8(3), []byte{}, uint8(0))
	f.Add(held, uint8(3), []byte{}, uint8(fuzzGrant))
	f.Add(held, uint8(3), []byte{}, uint8(fuzzOwnKey))
	f.Add(append(bytes.Clone(released), held...), uint8(0), []byte{}, uint8(fuzzFirst))
	f.Add(lastEpoch, uint8(5), []byte{}, uint8(0))
	f.Add(lastEpoch, uint8(5), []byte{}, uint8(fuzzSealSlots))
	f.Add(torn, uint8(7), []byte{}, uint8(0))
	f.Add(sixteenTorn, uint8(0), []byte{}, uint8(0))
	f.Add(held, uint8(1), []byte("VCOLEASE\x00\x00\x00\x01\x00\x00\x10\x00\x00\x00\x00\x11"), uint8(fuzzSealHeader))
	f.Fuzz(fuzzLeaseEngine)
}

// fuzzLeaseEngine is one run of FuzzLeaseEngine.
func fuzzLeaseEngine(t *testing.T, slots []byte, at uint8, header []byte, flags uint8) {
	tm := simTiming[1]
	disk := fuzzDisk(slots, at, header, flags)
	orig := bytes.Clone(disk.data)
	_, derr := DecodeArea(orig)
	key, grant := fuzzKeys(orig, flags)
	synctest.Test(t, func(t *testing.T) {
		// Each step ends by its deadline (the fake clock's), and the
		// I/O a step abandons completes within the last sleep.
		step := func(d time.Duration) context.Context {
			ctx, cancel := context.WithTimeout(context.Background(), d)
			t.Cleanup(cancel)
			return ctx
		}
		defer time.Sleep(time.Minute)
		e := scriptedNode(t, disk, key, tm, func(*fence.LostError) bool { return true })
		e.cfg.Serial = "S1"
		var err error
		if flags&fuzzFirst != 0 {
			_, err = e.AcquireFirst(step(3 * time.Minute))
		} else {
			_, err = e.Acquire(step(3*time.Minute), grant)
		}
		if err == nil {
			if derr != nil {
				t.Fatalf("acquired a lease area that does not decode (%v)", derr)
			}
			fuzzHolds(t, e, disk, key)
		}
		_ = e.Release(step(time.Minute))

		// An agent restart over the area as it was.
		copy(disk.data, orig)
		r := scriptedNode(t, disk, key, tm, func(*fence.LostError) bool { return true })
		if err := r.Resume(step(time.Minute)); err == nil {
			if derr != nil {
				t.Fatalf("resumed on a lease area that does not decode (%v)", derr)
			}
			time.Sleep(tm.Renew + tm.IOTimeout)
		}
		_ = r.Release(step(time.Minute))
		if _, _, err := ReadStatus(step(time.Minute), r.dev, key, tm.IOTimeout); (err == nil) != (derr == nil) {
			t.Fatalf("ReadStatus: %v, DecodeArea: %v", err, derr)
		}
	})
	if derr != nil && !bytes.Equal(disk.data, orig) {
		t.Fatalf("a lease area refused (%v) was written", derr)
	}
}

// fuzzDisk is FuzzLeaseEngine's disk: a formatted lease area with the
// fuzzed blocks laid over it.
func fuzzDisk(slots []byte, at uint8, header []byte, flags uint8) *simDisk {
	disk := formattedSimDisk(512)
	copy(disk.data[:BlockSize], header)
	if flags&fuzzSealHeader != 0 {
		binary.BigEndian.PutUint32(disk.data[crcOffset:], crc32.Checksum(disk.data[:crcOffset], castagnoli))
	}
	copy(disk.data[BlockSize*(1+int(at)%Slots):], slots)
	if flags&fuzzSealSlots != 0 {
		for i := range Slots {
			blk := disk.data[BlockSize*(1+i) : BlockSize*(2+i)]
			if !allZero(blk) {
				copy(blk, slotMagic)
				binary.BigEndian.PutUint32(blk[crcOffset:], crc32.Checksum(blk[:crcOffset], castagnoli))
			}
		}
	}
	return disk
}

// fuzzKeys is the engine's key (0x1000, or with fuzzOwnKey the key in the
// first non-zero slot block) and, with fuzzGrant, a grant naming every
// other key in the slot blocks.
func fuzzKeys(area []byte, flags uint8) (fence.Key, *fence.Grant) {
	var keys []fence.Key
	for i := range Slots {
		blk := area[BlockSize*(1+i) : BlockSize*(2+i)]
		if k := fence.Key(binary.BigEndian.Uint64(blk[8:])); k != 0 {
			keys = append(keys, k)
		}
	}
	key := fence.Key(0x1000)
	if flags&fuzzOwnKey != 0 && len(keys) > 0 {
		key = keys[0]
	}
	if flags&fuzzGrant == 0 {
		return key, nil
	}
	g := &fence.Grant{Node: fmt.Sprintf("00000000-0000-4000-8000-%012x", uint64(key)&(1<<48-1))}
	for _, k := range keys {
		if k != key {
			g.Supersedes = append(g.Supersedes, k)
		}
	}
	return key, g
}

// fuzzHolds checks an engine that has just acquired: it owns the lease,
// its check passes, and it keeps passing across renewals.
func fuzzHolds(t *testing.T, e *Engine, disk *simDisk, key fence.Key) {
	t.Helper()
	a, err := DecodeArea(bytes.Clone(disk.data))
	if err != nil {
		t.Fatalf("the lease area does not decode after our acquisition: %v", err)
	}
	if o := a.Owner(); o < 0 || a.Slots[o].Key != key {
		t.Fatalf("acquired, yet the owner is slot %d", o)
	}
	for range 3 {
		if err := e.Check(context.Background()); err != nil {
			t.Fatalf("check of the lease just acquired: %v", err)
		}
		time.Sleep(e.cfg.Timing.Renew)
	}
}
