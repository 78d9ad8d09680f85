package lease

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

func TestSlotRoundTrip(t *testing.T) {
	s := Slot{Key: keyA, Epoch: 7, Counter: 42, Written: 1_700_000_000_123_456_789, State: StateHeld,
		Timing: DefaultTiming(), Supersedes: keyB, Node: "node-a"}
	b := EncodeSlot(s)
	if len(b) != BlockSize {
		t.Fatalf("slot block is %d bytes", len(b))
	}
	got, err := DecodeSlot(b)
	if err != nil || got != s {
		t.Fatalf("round trip: %+v %v, want %+v", got, err, s)
	}
	// Every flipped byte in the checksummed part is detected.
	for _, off := range []int{0, 9, 17, 40, 50, 100, crcOffset - 1, crcOffset} {
		c := bytes.Clone(b)
		c[off] ^= 0x10
		if _, err := DecodeSlot(c); err == nil {
			t.Errorf("flipped byte %d not detected", off)
		}
	}
	long := s
	long.Node = strings.Repeat("n", 100)
	got, err = DecodeSlot(EncodeSlot(long))
	if err != nil || len(got.Node) != nodeNameLen {
		t.Fatalf("long node name: %q %v", got.Node, err)
	}
	if s, err := DecodeSlot(make([]byte, BlockSize)); err != nil || s.State != StateEmpty {
		t.Fatalf("zero block: %+v %v", s, err)
	}
	// A serial is compared as the slot keeps it: one that is cut in the
	// middle of a character, or holds a NUL, still matches its slot.
	for _, serial := range []string{"5002", strings.Repeat("s", 63) + "é-tail", "ab\x00cd", ""} {
		sl := s
		sl.Serial = serial
		got, err := DecodeSlot(EncodeSlot(sl))
		if err != nil || got.Serial != SlotSerial(serial) {
			t.Errorf("serial %q: slot keeps %q, SlotSerial says %q (%v)", serial, got.Serial, SlotSerial(serial), err)
		}
	}
	if got := SlotSerial(strings.Repeat("s", 63) + "é"); got != strings.Repeat("s", 63)+"?" {
		t.Errorf("a serial cut inside a character: %q", got)
	}
}

func TestSlotRejectsNonsense(t *testing.T) {
	good := Slot{Key: keyA, Epoch: 1, State: StateHeld, Timing: DefaultTiming()}
	for name, s := range map[string]Slot{
		"zero key":   {Epoch: 1, State: StateHeld, Timing: DefaultTiming()},
		"zero epoch": {Key: keyA, State: StateHeld, Timing: DefaultTiming()},
		"bad state":  {Key: keyA, Epoch: 1, State: 9, Timing: DefaultTiming()},
		"no timing":  {Key: keyA, Epoch: 1, State: StateHeld},
		"fail < 2R":  {Key: keyA, Epoch: 1, State: StateHeld, Timing: Timing{IOTimeout: time.Second, Renew: 2 * time.Second, Fail: 3 * time.Second}},
	} {
		if _, err := DecodeSlot(EncodeSlot(s)); err == nil {
			t.Errorf("%s: decoded without error", name)
		}
	}
	if _, err := DecodeSlot(EncodeSlot(good)); err != nil {
		t.Fatal(err)
	}
}

func TestHeader(t *testing.T) {
	h := Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset, Created: 5, Creator: keyA}
	h.VolumeID[3] = 9
	got, err := DecodeHeader(EncodeHeader(h))
	if err != nil || got != h {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if _, err := DecodeHeader(make([]byte, BlockSize)); !errors.Is(err, ErrNoLease) {
		t.Fatalf("zero block: %v", err)
	}
	bad := h
	bad.DataOffset = 4096
	if _, err := DecodeHeader(EncodeHeader(bad)); err == nil || !strings.Contains(err.Error(), "geometry") {
		t.Fatalf("foreign geometry: %v", err)
	}
	b := EncodeHeader(h)
	b[100] = 1
	if _, err := DecodeHeader(b); err == nil || errors.Is(err, ErrNoLease) {
		t.Fatalf("damaged header: %v", err)
	}
}

func area(slots ...Slot) *Area {
	buf := make([]byte, ReadSize)
	copy(buf, EncodeHeader(Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset}))
	for i, s := range slots {
		if s.Key != 0 {
			copy(buf[BlockSize*(1+i):], EncodeSlot(s))
		}
	}
	a, err := DecodeArea(buf)
	if err != nil {
		panic(err)
	}
	return a
}

func TestOwner(t *testing.T) {
	tm := DefaultTiming()
	k3 := fence.Key(0x7663000000000003)
	cases := []struct {
		name  string
		a     *Area
		owner int
	}{
		{"empty", area(), -1},
		{"one held", area(Slot{}, Slot{Key: keyA, Epoch: 1, State: StateHeld, Timing: tm}), 1},
		{"released is not owner", area(Slot{Key: keyA, Epoch: 4, State: StateReleased, Timing: tm}), -1},
		{"higher epoch wins", area(
			Slot{Key: keyA, Epoch: 1, State: StateHeld, Timing: tm},
			Slot{Key: keyB, Epoch: 2, State: StateHeld, Timing: tm}), 1},
		{"tie: lower key", area(
			Slot{Key: k3, Epoch: 2, State: StateHeld, Timing: tm},
			Slot{Key: keyB, Epoch: 2, State: StateHeld, Timing: tm}), 0},
		{"fenced higher epoch does not own", area(
			Slot{Key: keyA, Epoch: 1, State: StateHeld, Timing: tm},
			Slot{Key: keyB, Epoch: 2, State: StateFenced, Timing: tm}), 0},
	}
	for _, c := range cases {
		if got := c.a.Owner(); got != c.owner {
			t.Errorf("%s: owner %d, want %d", c.name, got, c.owner)
		}
	}
	if k3 > keyB {
		t.Fatal("test keys out of order")
	}
}

func TestDecodeAreaMarksCorruptSlots(t *testing.T) {
	a := area(Slot{Key: keyA, Epoch: 1, State: StateHeld, Timing: DefaultTiming()})
	buf := make([]byte, ReadSize)
	copy(buf, EncodeHeader(a.Header))
	copy(buf[BlockSize:], a.Raw[0])
	buf[2*BlockSize+7] = 0xff // garbage in slot 1
	buf[BlockSize+30] ^= 1    // torn slot 0
	b, err := DecodeArea(buf)
	if err != nil {
		t.Fatal(err)
	}
	if !b.Corrupt[0] || !b.Corrupt[1] || b.Corrupt[2] || b.Owner() != -1 {
		t.Fatalf("corrupt flags %v, owner %d", b.Corrupt[:3], b.Owner())
	}
}

func TestTimingBounds(t *testing.T) {
	d := DefaultTiming()
	if d.Expiry() != 52*time.Second || d.Settle() != 4*time.Second {
		t.Fatalf("default expiry %s settle %s", d.Expiry(), d.Settle())
	}
	// Without a watchdog the delta lease's own delay can dominate.
	tm := Timing{IOTimeout: time.Second, Renew: 10 * time.Second, Fail: 20 * time.Second}
	if tm.Expiry() != 21*time.Second {
		t.Fatalf("expiry %s", tm.Expiry())
	}
	tm = Timing{IOTimeout: 2 * time.Second, Renew: 10 * time.Second, Fail: 20 * time.Second}
	if tm.Expiry() != 22*time.Second {
		t.Fatalf("expiry %s", tm.Expiry())
	}
	if err := (Timing{IOTimeout: time.Second, Renew: time.Millisecond, Fail: time.Minute}).validate(); err == nil {
		t.Fatal("renew below the I/O timeout accepted")
	}
}
