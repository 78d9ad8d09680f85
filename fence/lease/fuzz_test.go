package lease

import (
	"bytes"
	"testing"
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
