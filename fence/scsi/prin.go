package scsi

import (
	"encoding/binary"
	"fmt"
)

// Keys is READ KEYS parameter data (SPC-4 "PERSISTENT RESERVE IN parameter
// data for READ KEYS"): bytes 0-3 PRGENERATION, 4-7 ADDITIONAL LENGTH (n-7),
// then 8-byte reservation keys, one per registered I_T nexus (a key
// registered through several nexuses appears several times).
type Keys struct {
	Generation uint32
	Keys       []uint64
	// Truncated: ADDITIONAL LENGTH says more keys exist than the allocation
	// length let the target return; read again with a larger buffer.
	Truncated bool
	// Need is the buffer size the full list needs (8 + ADDITIONAL LENGTH).
	Need int
}

// ParseReadKeys parses READ KEYS data. n is what the target returned.
func ParseReadKeys(b []byte) (Keys, error) {
	if len(b) < 8 {
		return Keys{}, fmt.Errorf("scsi: READ KEYS data is %d bytes, want at least 8", len(b))
	}
	k := Keys{Generation: binary.BigEndian.Uint32(b[0:4])}
	add := binary.BigEndian.Uint32(b[4:8])
	if add%8 != 0 {
		return Keys{}, fmt.Errorf("scsi: READ KEYS additional length %d is not a multiple of 8", add)
	}
	if add > 1<<20 {
		return Keys{}, fmt.Errorf("scsi: READ KEYS additional length %d is implausible", add)
	}
	k.Need = 8 + int(add)
	avail := len(b) - 8
	if int(add) > avail {
		k.Truncated = true
	} else {
		avail = int(add)
	}
	for p := 8; p+8 <= 8+avail; p += 8 {
		k.Keys = append(k.Keys, binary.BigEndian.Uint64(b[p:p+8]))
	}
	return k, nil
}

// Reservation is READ RESERVATION parameter data (SPC-4 "PERSISTENT RESERVE
// IN parameter data for READ RESERVATION"): bytes 0-3 PRGENERATION, 4-7
// ADDITIONAL LENGTH (0 when there is no reservation, 10h with one), and for a
// reservation: 8-15 RESERVATION KEY, 16-19 obsolete, 20 reserved, 21 SCOPE
// (bits 7-4) and TYPE (bits 3-0), 22-23 obsolete.
type Reservation struct {
	Generation uint32
	Present    bool
	// Key of the holder; 0 for the all-registrants types.
	Key   uint64
	Scope uint8
	Type  uint8
}

// ParseReadReservation parses READ RESERVATION data.
func ParseReadReservation(b []byte) (Reservation, error) {
	if len(b) < 8 {
		return Reservation{}, fmt.Errorf("scsi: READ RESERVATION data is %d bytes, want at least 8", len(b))
	}
	r := Reservation{Generation: binary.BigEndian.Uint32(b[0:4])}
	add := binary.BigEndian.Uint32(b[4:8])
	switch {
	case add == 0:
		return r, nil
	case add < 0x10:
		return Reservation{}, fmt.Errorf("scsi: READ RESERVATION additional length %d, want 0 or 16", add)
	case len(b) < 24:
		return Reservation{}, fmt.Errorf("scsi: READ RESERVATION data truncated to %d bytes, want 24", len(b))
	}
	r.Present = true
	r.Key = binary.BigEndian.Uint64(b[8:16])
	r.Scope = b[21] >> 4
	r.Type = b[21] & 0x0f
	return r, nil
}

// Capabilities is REPORT CAPABILITIES parameter data (SPC-4 "PERSISTENT
// RESERVE IN parameter data for REPORT CAPABILITIES"): bytes 0-1 LENGTH
// (0008h); byte 2 RLR_C (bit 7), CRH (bit 4), SIP_C (bit 3), ATP_C (bit 2),
// PTPL_C (bit 0); byte 3 TMV (bit 7), ALLOW COMMANDS (bits 6-4), PTPL_A
// (bit 0); bytes 4-5 PERSISTENT RESERVATION TYPE MASK.
type Capabilities struct {
	ReplaceLostReservation bool  `json:"rlr_c"`
	CompatibleReservation  bool  `json:"crh"`
	SpecifyInitiatorPorts  bool  `json:"sip_c"`
	AllTargetPorts         bool  `json:"atp_c"`
	PTPLCapable            bool  `json:"ptpl_c"`
	TypeMaskValid          bool  `json:"tmv"`
	AllowCommands          uint8 `json:"allow_commands"`
	PTPLActivated          bool  `json:"ptpl_a"`
	// TypeMask is the raw PERSISTENT RESERVATION TYPE MASK: byte 4 WR_EX_AR
	// (bit 7), EX_AC_RO (6), WR_EX_RO (5), EX_AC (3), WR_EX (1); byte 5
	// EX_AC_AR (bit 0).
	TypeMask uint16
}

// Supports reports whether the type mask lists reservation type t. It is
// false for every type when the mask is not valid (TMV=0).
func (c Capabilities) Supports(t uint8) bool {
	if !c.TypeMaskValid {
		return false
	}
	var bit uint16
	switch t {
	case 0x1:
		bit = 1 << 9 // byte 4 bit 1
	case 0x3:
		bit = 1 << 11 // byte 4 bit 3
	case 0x5:
		bit = 1 << 13 // byte 4 bit 5
	case 0x6:
		bit = 1 << 14 // byte 4 bit 6
	case 0x7:
		bit = 1 << 15 // byte 4 bit 7
	case 0x8:
		bit = 1 << 0 // byte 5 bit 0
	default:
		return false
	}
	return c.TypeMask&bit != 0
}

// Types lists the supported reservation types in code order.
func (c Capabilities) Types() []uint8 {
	var ts []uint8
	for _, t := range []uint8{1, 3, 5, 6, 7, 8} {
		if c.Supports(t) {
			ts = append(ts, t)
		}
	}
	return ts
}

// ParseReportCapabilities parses REPORT CAPABILITIES data.
func ParseReportCapabilities(b []byte) (Capabilities, error) {
	if len(b) < 6 {
		return Capabilities{}, fmt.Errorf("scsi: REPORT CAPABILITIES data is %d bytes, want 8", len(b))
	}
	if l := binary.BigEndian.Uint16(b[0:2]); l < 6 {
		return Capabilities{}, fmt.Errorf("scsi: REPORT CAPABILITIES length field %d, want 8", l)
	}
	return Capabilities{
		ReplaceLostReservation: b[2]&0x80 != 0,
		CompatibleReservation:  b[2]&0x10 != 0,
		SpecifyInitiatorPorts:  b[2]&0x08 != 0,
		AllTargetPorts:         b[2]&0x04 != 0,
		PTPLCapable:            b[2]&0x01 != 0,
		TypeMaskValid:          b[3]&0x80 != 0,
		AllowCommands:          (b[3] >> 4) & 0x07,
		PTPLActivated:          b[3]&0x01 != 0,
		TypeMask:               binary.BigEndian.Uint16(b[4:6]),
	}, nil
}

// FullStatus is READ FULL STATUS parameter data (SPC-4 "PERSISTENT RESERVE
// IN parameter data for READ FULL STATUS"): bytes 0-3 PRGENERATION, 4-7
// ADDITIONAL LENGTH, then full status descriptors.
type FullStatus struct {
	Generation  uint32
	Registrants []Registrant
	Truncated   bool
	Need        int
}

// Registrant is one full status descriptor (SPC-4 "PERSISTENT RESERVE IN
// full status descriptor format"): bytes 0-7 RESERVATION KEY, 12 ALL_TG_PT
// (bit 1) and R_HOLDER (bit 0), 13 SCOPE (bits 7-4) and TYPE (bits 3-0),
// 18-19 RELATIVE TARGET PORT IDENTIFIER, 20-23 ADDITIONAL DESCRIPTOR LENGTH
// (n-23), 24-n TransportID of the initiator port.
type Registrant struct {
	Key                uint64
	AllTargetPorts     bool
	Holder             bool
	Scope, Type        uint8
	RelativeTargetPort uint16
	TransportID        []byte
}

// Initiator returns a printable initiator name from the TransportID when
// it is an iSCSI name (protocol identifier 5h, SPC-4 "iSCSI initiator
// device TransportID format"), else the TransportID in hex.
func (r Registrant) Initiator() string {
	t := r.TransportID
	if len(t) >= 4 && t[0]&0x0f == 0x5 {
		n := int(binary.BigEndian.Uint16(t[2:4]))
		name := t[4:min(4+n, len(t))]
		for i, c := range name {
			if c == 0 {
				name = name[:i]
				break
			}
		}
		return string(name)
	}
	return fmt.Sprintf("%x", t)
}

// ParseReadFullStatus parses READ FULL STATUS data.
func ParseReadFullStatus(b []byte) (FullStatus, error) {
	if len(b) < 8 {
		return FullStatus{}, fmt.Errorf("scsi: READ FULL STATUS data is %d bytes, want at least 8", len(b))
	}
	fs := FullStatus{Generation: binary.BigEndian.Uint32(b[0:4])}
	add := binary.BigEndian.Uint32(b[4:8])
	if add > 1<<20 {
		return FullStatus{}, fmt.Errorf("scsi: READ FULL STATUS additional length %d is implausible", add)
	}
	fs.Need = 8 + int(add)
	end := len(b)
	if fs.Need < end {
		end = fs.Need
	} else if fs.Need > end {
		fs.Truncated = true
	}
	p := 8
	for p+24 <= end {
		d := b[p:]
		dl := int(binary.BigEndian.Uint32(d[20:24]))
		if dl > end-p-24 {
			if !fs.Truncated {
				return FullStatus{}, fmt.Errorf("scsi: READ FULL STATUS descriptor at offset %d overruns the data (TransportID length %d)", p, dl)
			}
			break
		}
		fs.Registrants = append(fs.Registrants, Registrant{
			Key:                binary.BigEndian.Uint64(d[0:8]),
			AllTargetPorts:     d[12]&0x02 != 0,
			Holder:             d[12]&0x01 != 0,
			Scope:              d[13] >> 4,
			Type:               d[13] & 0x0f,
			RelativeTargetPort: binary.BigEndian.Uint16(d[18:20]),
			TransportID:        append([]byte(nil), d[24:24+dl]...),
		})
		p += 24 + dl
	}
	if p != end && !fs.Truncated {
		return FullStatus{}, fmt.Errorf("scsi: READ FULL STATUS has %d stray bytes after the last descriptor", end-p)
	}
	return fs, nil
}
