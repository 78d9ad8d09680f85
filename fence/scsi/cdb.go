package scsi

import "encoding/binary"

// Operation codes (SPC-4 "Operation codes", annex E).
const (
	OpTestUnitReady        = 0x00
	OpInquiry              = 0x12
	OpPersistentReserveIn  = 0x5E
	OpPersistentReserveOut = 0x5F
)

// PRInAction is a PERSISTENT RESERVE IN service action (SPC-4 "PERSISTENT
// RESERVE IN service action codes").
type PRInAction uint8

const (
	ReadKeys           PRInAction = 0x00
	ReadReservation    PRInAction = 0x01
	ReportCapabilities PRInAction = 0x02
	ReadFullStatus     PRInAction = 0x03
)

func (a PRInAction) String() string { return codeName(prInActionNames[:], a, "PR IN service action") }

var prInActionNames = [...]string{
	ReadKeys: "READ KEYS", ReadReservation: "READ RESERVATION",
	ReportCapabilities: "REPORT CAPABILITIES", ReadFullStatus: "READ FULL STATUS",
}

// PROutAction is a PERSISTENT RESERVE OUT service action (SPC-4
// "PERSISTENT RESERVE OUT service action codes").
type PROutAction uint8

const (
	Register                     PROutAction = 0x00
	Reserve                      PROutAction = 0x01
	Release                      PROutAction = 0x02
	Clear                        PROutAction = 0x03
	Preempt                      PROutAction = 0x04
	PreemptAndAbort              PROutAction = 0x05
	RegisterAndIgnoreExistingKey PROutAction = 0x06
)

func (a PROutAction) String() string {
	return codeName(prOutActionNames[:], a, "PR OUT service action")
}

var prOutActionNames = [...]string{
	Register: "REGISTER", Reserve: "RESERVE", Release: "RELEASE", Clear: "CLEAR",
	Preempt: "PREEMPT", PreemptAndAbort: "PREEMPT AND ABORT",
	RegisterAndIgnoreExistingKey: "REGISTER AND IGNORE EXISTING KEY",
}

// ScopeLU is the only scope SPC-4 still defines ("Persistent reservation scope codes":
// LU_SCOPE = 0h).
const ScopeLU = 0x0

// PROutParamLen is the length of the basic PERSISTENT RESERVE OUT parameter
// list (SPC-4 "PERSISTENT RESERVE OUT parameter list"), used by every service action we send.
const PROutParamLen = 24

// TestUnitReadyCDB builds TEST UNIT READY (SPC-4 "TEST UNIT READY command"): six bytes,
// operation code 00h, all other fields zero.
func TestUnitReadyCDB() []byte {
	return []byte{OpTestUnitReady, 0, 0, 0, 0, 0}
}

// InquiryCDB builds INQUIRY (SPC-4 "INQUIRY command"). evpd selects a VPD page
// (byte 1 bit 0), page is the PAGE CODE (byte 2), allocLen the ALLOCATION
// LENGTH (bytes 3-4, big-endian).
func InquiryCDB(evpd bool, page uint8, allocLen uint16) []byte {
	c := make([]byte, 6)
	c[0] = OpInquiry
	if evpd {
		c[1] = 0x01
	}
	c[2] = page
	binary.BigEndian.PutUint16(c[3:5], allocLen)
	return c
}

// PRInCDB builds PERSISTENT RESERVE IN (SPC-4 "PERSISTENT RESERVE IN
// command"): byte 1 bits 4-0
// SERVICE ACTION, bytes 7-8 ALLOCATION LENGTH, byte 9 CONTROL.
func PRInCDB(a PRInAction, allocLen uint16) []byte {
	c := make([]byte, 10)
	c[0] = OpPersistentReserveIn
	c[1] = uint8(a) & 0x1f
	binary.BigEndian.PutUint16(c[7:9], allocLen)
	return c
}

// PROut is one PERSISTENT RESERVE OUT command: the CDB fields and the basic
// parameter list.
type PROut struct {
	Action PROutAction
	// Type is the TYPE field (CDB byte 2 bits 3-0); meaningful for RESERVE,
	// RELEASE, PREEMPT and PREEMPT AND ABORT, zero otherwise.
	Type uint8
	// Key is the RESERVATION KEY (parameter bytes 0-7): the key the I_T nexus
	// is registered with (ignored by REGISTER AND IGNORE EXISTING KEY).
	Key uint64
	// ServiceActionKey is the SERVICE ACTION RESERVATION KEY (parameter bytes
	// 8-15): the new key for REGISTER (0 unregisters), the key to preempt for
	// PREEMPT / PREEMPT AND ABORT.
	ServiceActionKey uint64
	// APTPL asks the target to persist through power loss (byte 20 bit 0).
	// Never set by the fencing engine: tgt rejects it, and a reservation that
	// outlives a power cycle of the target is not what we want.
	APTPL bool
}

// CDB builds the PERSISTENT RESERVE OUT CDB (SPC-4 "PERSISTENT RESERVE OUT
// command"): byte 1 bits
// 4-0 SERVICE ACTION, byte 2 SCOPE (bits 7-4) and TYPE (bits 3-0), bytes 5-8
// PARAMETER LIST LENGTH, byte 9 CONTROL.
func (p PROut) CDB() []byte {
	c := make([]byte, 10)
	c[0] = OpPersistentReserveOut
	c[1] = uint8(p.Action) & 0x1f
	c[2] = ScopeLU<<4 | p.Type&0x0f
	binary.BigEndian.PutUint32(c[5:9], PROutParamLen)
	return c
}

// Params builds the basic parameter list (SPC-4 "PERSISTENT RESERVE OUT parameter list"): bytes 0-7
// RESERVATION KEY, 8-15 SERVICE ACTION RESERVATION KEY, 16-19 obsolete, byte
// 20 SPEC_I_PT (bit 3), ALL_TG_PT (bit 2), APTPL (bit 0), 21 reserved, 22-23
// obsolete. SPEC_I_PT and ALL_TG_PT stay zero: every path registers itself.
func (p PROut) Params() []byte {
	b := make([]byte, PROutParamLen)
	binary.BigEndian.PutUint64(b[0:8], p.Key)
	binary.BigEndian.PutUint64(b[8:16], p.ServiceActionKey)
	if p.APTPL {
		b[20] |= 0x01
	}
	return b
}

const hexDigits = "0123456789abcdef"

// codeName is the name names gives code (names is indexed by code), or
// prefix and the code in hex for a code it does not name.
func codeName[T ~uint8](names []string, code T, prefix string) string {
	if int(code) < len(names) && names[code] != "" {
		return names[code]
	}
	return prefix + " " + hex8(uint8(code))
}

func hex8(v uint8) string { return "0x" + string(hexDigits[v>>4]) + string(hexDigits[v&0xf]) }
