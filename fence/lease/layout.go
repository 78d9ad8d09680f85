package lease

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"strings"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// On-disk geometry. Every structure is one 4096-byte block so that every
// read and write is aligned for O_DIRECT on disks with 512- and 4096-byte
// logical sectors alike, and so that no two hosts ever write the same
// physical sector.
const (
	// BlockSize is the unit of every lease I/O.
	BlockSize = 4096
	// Slots is the number of per-host slots.
	Slots = 16
	// AreaSize is the part of the disk the lease owns, from offset 0.
	AreaSize = 1 << 20
	// DataOffset is where the volume's data (filesystem, LUKS2 header, raw
	// block contents) begins.
	DataOffset = AreaSize
	// ReadSize is what one read of the lease state covers: the header and
	// every slot.
	ReadSize = (1 + Slots) * BlockSize

	headerMagic = "VCOLEASE"
	slotMagic   = "VCOSLOT1"
	version     = 1
	crcOffset   = BlockSize - 4
	nodeNameLen = 64
	serialLen   = 64
)

// Bounds of the slot fields the engine computes with. A claim writes one
// more than the highest epoch on the disk and every write of a slot one
// more than its counter; a claim a second for a million years stays far
// below either bound, so only a slot written by something other than
// this agent's lease code reaches them, and no sum of the engine wraps.
const (
	// MaxSlotEpoch is the highest epoch a slot may carry; a claim above
	// a slot at it is refused.
	MaxSlotEpoch = 1 << 62
	// MaxSlotCounter is the highest counter a slot may carry.
	MaxSlotCounter = 1 << 62
)

// ErrDamaged is matched (errors.Is) by every DamagedError.
var ErrDamaged = errors.New("damaged lease area")

// DamagedError is a lease area the engine refuses to act on: its header
// fails its checksum or does not have this agent's geometry, or a slot
// that passes its checksum (so was written whole, never torn) holds a
// field outside the bounds of the layout (docs/fencing.md, "The on-disk
// lease"). Nothing is written to such an area: the engine fails every
// operation on it with this error, naming the field.
type DamagedError struct {
	// Slot is the slot's index; -1 for the header, or for a slot decoded
	// on its own (DecodeSlot).
	Slot int
	// Header is set when the header is damaged.
	Header bool
	// Field is the field, as docs/fencing.md's layout names it.
	Field string
	// Detail is what the field holds against its bound.
	Detail string
}

func (e *DamagedError) Error() string {
	where := "lease slot"
	switch {
	case e.Header:
		where = "lease header"
	case e.Slot >= 0:
		where = fmt.Sprintf("lease slot %d", e.Slot)
	}
	return fmt.Sprintf("%s: %s %s: the lease area is damaged or was written by another version, and nothing is done to it", where, e.Field, e.Detail)
}

// Is makes every DamagedError match ErrDamaged.
func (e *DamagedError) Is(target error) bool { return target == ErrDamaged }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Header is block 0 of the lease area. It marks the disk as formatted with
// the lease and says where the data begins.
type Header struct {
	Version    uint32
	BlockSize  uint32
	Slots      uint32
	SlotOffset uint64
	DataOffset uint64
	VolumeID   [16]byte
	// Created is the format time (Unix seconds; informational).
	Created int64
	// Creator is the fence key of the node that formatted the disk.
	Creator fence.Key
}

// State is what a slot says about its host.
type State uint8

const (
	// StateEmpty: the slot was never used (all zeros).
	StateEmpty State = 0
	// StateHeld: the host claims the disk (or is in the middle of claiming
	// it) at the slot's epoch, and renews the slot.
	StateHeld State = 1
	// StateReleased: the host gave the disk up cleanly.
	StateReleased State = 2
	// StateFenced: the host lost its claim and has stopped I/O to the disk.
	StateFenced State = 3
)

func (s State) String() string {
	switch s {
	case StateEmpty:
		return "empty"
	case StateHeld:
		return "held"
	case StateReleased:
		return "released"
	case StateFenced:
		return "fenced"
	}
	return fmt.Sprintf("state %d", uint8(s))
}

// MarshalText names the state in JSON output.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Slot is one host's record.
type Slot struct {
	Key fence.Key `json:"key"`
	// Epoch orders claims: a claim writes one more than the highest epoch
	// on the disk, and the held slot with the highest epoch owns the disk.
	Epoch uint64 `json:"epoch"`
	// Counter increases with every write of the slot; a reader sees a live
	// host as a slot that changes.
	Counter uint64 `json:"counter"`
	// Written is the writer's wall clock (Unix nanoseconds). Informational
	// only: no decision compares clocks of different hosts.
	Written int64 `json:"written_unix_ns"`
	State   State `json:"state"`
	// Timing is the writer's timing, so that a reader waits for the
	// writer's bound, not its own.
	Timing Timing `json:"timing"`
	// Supersedes is the key a granted takeover named, or 0.
	Supersedes fence.Key `json:"supersedes,omitempty"`
	// Node is the writer's node name (informational).
	Node string `json:"node,omitempty"`
	// Serial is the disk's serial number as the writer saw it, or empty.
	// A slot whose serial is not the disk's was copied with the disk's
	// contents from another disk (a clone, a restored snapshot).
	Serial string `json:"serial,omitempty"`
}

// SlotSerial is serial as a slot keeps it (at most 64 bytes), for
// comparing a device's serial with a slot's.
func SlotSerial(serial string) string {
	b := []byte(serial)
	return fieldText(b[:min(len(b), serialLen)])
}

// fieldText is the text of a fixed-size, NUL-padded slot field, made
// valid UTF-8 (a torn or foreign write may have cut a character).
func fieldText(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return strings.ToValidUTF8(string(b), "?")
}

// Live reports whether the slot claims the disk.
func (s Slot) Live() bool { return s.State == StateHeld }

// Area is one read of the lease area.
type Area struct {
	Header Header
	Slots  [Slots]Slot
	// Raw holds each slot's block as read; a reader compares these to see
	// whether a host has written since.
	Raw [Slots][]byte
	// Corrupt marks slots whose block is not all zeros and does not pass
	// its checksum or lacks the slot magic (a torn write, or something
	// else wrote there). Such a slot owns nothing, but a reader that
	// waits for expiry waits for it too, and clears it once it has stayed
	// unchanged for that bound.
	Corrupt [Slots]bool
}

// alive reports whether slot i may belong to a live host: it is held, or
// it does not decode (a write caught half landed, which only a live host
// makes). A reader never takes such a slot for a release.
func (a *Area) alive(i int) bool { return a.Corrupt[i] || a.Slots[i].Live() }

// Owner returns the slot index that owns the disk: the held slot with the
// highest epoch, the lowest key breaking a tie. -1 when no slot is held.
func (a *Area) Owner() int {
	o := -1
	for i, s := range a.Slots {
		if !s.Live() || a.Corrupt[i] {
			continue
		}
		if o < 0 || s.Epoch > a.Slots[o].Epoch || (s.Epoch == a.Slots[o].Epoch && s.Key < a.Slots[o].Key) {
			o = i
		}
	}
	return o
}

// ownerExcept is Owner among the slots of keys other than k.
func (a *Area) ownerExcept(k fence.Key) int {
	o := -1
	for i, s := range a.Slots {
		if !s.Live() || a.Corrupt[i] || s.Key == k {
			continue
		}
		if o < 0 || s.Epoch > a.Slots[o].Epoch || (s.Epoch == a.Slots[o].Epoch && s.Key < a.Slots[o].Key) {
			o = i
		}
	}
	return o
}

// blank reports whether every slot is empty (all zeros): no host has
// written a claim, a release or half a write.
func (a *Area) blank() bool {
	for i, s := range a.Slots {
		if a.Corrupt[i] || s.State != StateEmpty {
			return false
		}
	}
	return true
}

// onlyClaim reports whether slot idx holds exactly blk and every other
// slot is empty and readable: no other host has written a claim.
func (a *Area) onlyClaim(idx int, blk []byte) bool {
	if !bytes.Equal(a.Raw[idx], blk) {
		return false
	}
	for i, s := range a.Slots {
		if i != idx && (a.Corrupt[i] || s.State != StateEmpty) {
			return false
		}
	}
	return true
}

// MaxEpoch is the highest epoch written in any slot.
func (a *Area) MaxEpoch() uint64 {
	var m uint64
	for _, s := range a.Slots {
		m = max(m, s.Epoch)
	}
	return m
}

// Find returns the slot of key k, or -1.
func (a *Area) Find(k fence.Key) int {
	for i, s := range a.Slots {
		if s.Key == k && !a.Corrupt[i] && s.State != StateEmpty {
			return i
		}
	}
	return -1
}

// ErrNoLease is returned when a disk carries no lease header.
var ErrNoLease = errors.New("no lease area on the disk")

// EncodeHeader returns block 0 for h.
func EncodeHeader(h Header) []byte {
	b := make([]byte, BlockSize)
	copy(b[0:8], headerMagic)
	be := binary.BigEndian
	be.PutUint32(b[8:], h.Version)
	be.PutUint32(b[12:], h.BlockSize)
	be.PutUint32(b[16:], h.Slots)
	be.PutUint64(b[24:], h.SlotOffset)
	be.PutUint64(b[32:], h.DataOffset)
	copy(b[40:56], h.VolumeID[:])
	be.PutUint64(b[56:], uint64(h.Created))
	be.PutUint64(b[64:], uint64(h.Creator))
	be.PutUint32(b[crcOffset:], crc32.Checksum(b[:crcOffset], castagnoli))
	return b
}

// DecodeHeader parses block 0. A block without our magic is ErrNoLease;
// one with our magic that does not check out is another error (a damaged
// lease area is never reformatted silently).
func DecodeHeader(b []byte) (Header, error) {
	if len(b) < BlockSize {
		return Header{}, fmt.Errorf("lease header: %d bytes, want %d", len(b), BlockSize)
	}
	if string(b[0:8]) != headerMagic {
		return Header{}, ErrNoLease
	}
	be := binary.BigEndian
	if got, want := be.Uint32(b[crcOffset:]), crc32.Checksum(b[:crcOffset], castagnoli); got != want {
		return Header{}, &DamagedError{Slot: -1, Header: true, Field: "checksum", Detail: fmt.Sprintf("0x%08x, computed 0x%08x", got, want)}
	}
	h := Header{
		Version:    be.Uint32(b[8:]),
		BlockSize:  be.Uint32(b[12:]),
		Slots:      be.Uint32(b[16:]),
		SlotOffset: be.Uint64(b[24:]),
		DataOffset: be.Uint64(b[32:]),
		Created:    int64(be.Uint64(b[56:])),
		Creator:    fence.Key(be.Uint64(b[64:])),
	}
	copy(h.VolumeID[:], b[40:56])
	if h.Version != version {
		return h, &DamagedError{Slot: -1, Header: true, Field: "version", Detail: fmt.Sprintf("%d, this agent reads version %d", h.Version, version)}
	}
	// The geometry is fixed: the engine reads and writes at these offsets
	// and sizes, never at the header's.
	for _, g := range []struct {
		field     string
		got, want uint64
	}{
		{"block size", uint64(h.BlockSize), BlockSize},
		{"slot count", uint64(h.Slots), Slots},
		{"slot offset", h.SlotOffset, BlockSize},
		{"data offset", h.DataOffset, DataOffset},
	} {
		if g.got != g.want {
			return h, &DamagedError{Slot: -1, Header: true, Field: g.field, Detail: fmt.Sprintf("%d is not the geometry this agent writes (%d)", g.got, g.want)}
		}
	}
	return h, nil
}

// EncodeSlot returns the block for s.
func EncodeSlot(s Slot) []byte {
	b := make([]byte, BlockSize)
	copy(b[0:8], slotMagic)
	be := binary.BigEndian
	be.PutUint64(b[8:], uint64(s.Key))
	be.PutUint64(b[16:], s.Epoch)
	be.PutUint64(b[24:], s.Counter)
	be.PutUint64(b[32:], uint64(s.Written))
	b[40] = byte(s.State)
	be.PutUint32(b[48:], ms(s.Timing.IOTimeout))
	be.PutUint32(b[52:], ms(s.Timing.Renew))
	be.PutUint32(b[56:], ms(s.Timing.Fail))
	be.PutUint32(b[60:], ms(s.Timing.Watchdog))
	be.PutUint64(b[64:], uint64(s.Supersedes))
	copy(b[72:72+nodeNameLen], s.Node)
	copy(b[136:136+serialLen], s.Serial)
	be.PutUint32(b[crcOffset:], crc32.Checksum(b[:crcOffset], castagnoli))
	return b
}

// DecodeSlot parses a slot block. An all-zero block is an empty slot. A
// block without the slot magic or failing its checksum is a torn write
// (or a foreign one): an error that is not a DamagedError. A block that
// passes its checksum with a field out of bounds is a DamagedError.
func DecodeSlot(b []byte) (Slot, error) {
	if len(b) < BlockSize {
		return Slot{}, fmt.Errorf("lease slot: %d bytes, want %d", len(b), BlockSize)
	}
	b = b[:BlockSize]
	if allZero(b) {
		return Slot{}, nil
	}
	if string(b[0:8]) != slotMagic {
		return Slot{}, fmt.Errorf("lease slot has no slot magic")
	}
	be := binary.BigEndian
	if got, want := be.Uint32(b[crcOffset:]), crc32.Checksum(b[:crcOffset], castagnoli); got != want {
		return Slot{}, fmt.Errorf("lease slot checksum 0x%08x, computed 0x%08x (torn or foreign write)", got, want)
	}
	s := Slot{
		Key:     fence.Key(be.Uint64(b[8:])),
		Epoch:   be.Uint64(b[16:]),
		Counter: be.Uint64(b[24:]),
		Written: int64(be.Uint64(b[32:])),
		State:   State(b[40]),
		Timing: Timing{
			IOTimeout: fromMS(be.Uint32(b[48:])),
			Renew:     fromMS(be.Uint32(b[52:])),
			Fail:      fromMS(be.Uint32(b[56:])),
			Watchdog:  fromMS(be.Uint32(b[60:])),
		},
		Supersedes: fence.Key(be.Uint64(b[64:])),
	}
	s.Node = fieldText(b[72 : 72+nodeNameLen])
	s.Serial = fieldText(b[136 : 136+serialLen])
	if err := s.bounds(); err != nil {
		return s, err
	}
	return s, nil
}

// bounds checks the fields of a slot that passed its checksum; a field
// out of bounds is a DamagedError.
func (s Slot) bounds() error {
	damaged := func(field, format string, args ...any) error {
		return &DamagedError{Slot: -1, Field: field, Detail: fmt.Sprintf(format, args...)}
	}
	switch {
	case s.Key == 0:
		return damaged("key", "is 0, which no node has")
	case s.State == StateEmpty || s.State > StateFenced:
		return damaged("state", "%d (key %s) is not held (1), released (2) or fenced (3)", uint8(s.State), s.Key)
	case s.Epoch == 0:
		return damaged("epoch", "is 0 (key %s); claims start at 1", s.Key)
	case s.Epoch > MaxSlotEpoch:
		return damaged("epoch", "%d (key %s) is above the bound %d", s.Epoch, s.Key, uint64(MaxSlotEpoch))
	case s.Counter > MaxSlotCounter:
		return damaged("counter", "%d (key %s) is above the bound %d", s.Counter, s.Key, uint64(MaxSlotCounter))
	}
	if err := s.Timing.validate(); err != nil {
		return damaged("timing", "of key %s: %v", s.Key, err)
	}
	return nil
}

// DecodeArea parses one read of the lease area (ReadSize bytes). Slots
// that do not pass their checksum are marked Corrupt rather than failing
// the read: a torn write by one host must not make the disk unreadable
// for the rest. A slot that passes it with a field out of bounds fails
// the read with a DamagedError naming the slot and the field.
func DecodeArea(b []byte) (*Area, error) {
	if len(b) < ReadSize {
		return nil, fmt.Errorf("lease area: %d bytes, want %d", len(b), ReadSize)
	}
	h, err := DecodeHeader(b[:BlockSize])
	if err != nil {
		return nil, err
	}
	a := &Area{Header: h}
	for i := range Slots {
		blk := b[BlockSize*(1+i) : BlockSize*(2+i)]
		a.Raw[i] = bytes.Clone(blk)
		s, err := DecodeSlot(blk)
		var d *DamagedError
		if errors.As(err, &d) {
			d.Slot = i
			return nil, d
		}
		if err != nil {
			a.Corrupt[i] = true
			continue
		}
		a.Slots[i] = s
	}
	return a, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
