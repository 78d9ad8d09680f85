package scsi

import (
	"encoding/binary"
	"fmt"
)

// Status is a SCSI status byte (SAM-5 "Status codes").
type Status uint8

const (
	StatusGood                Status = 0x00
	StatusCheckCondition      Status = 0x02
	StatusConditionMet        Status = 0x04
	StatusBusy                Status = 0x08
	StatusReservationConflict Status = 0x18
	StatusTaskSetFull         Status = 0x28
	StatusACAActive           Status = 0x30
	StatusTaskAborted         Status = 0x40
)

func (s Status) String() string { return codeName(statusNames[:], s, "status") }

var statusNames = [...]string{
	StatusGood:                "GOOD",
	StatusCheckCondition:      "CHECK CONDITION",
	StatusConditionMet:        "CONDITION MET",
	StatusBusy:                "BUSY",
	StatusReservationConflict: "RESERVATION CONFLICT",
	StatusTaskSetFull:         "TASK SET FULL",
	StatusACAActive:           "ACA ACTIVE",
	StatusTaskAborted:         "TASK ABORTED",
}

// SenseKey is the SENSE KEY field (SPC-4 "Sense key descriptions").
type SenseKey uint8

const (
	NoSense        SenseKey = 0x0
	RecoveredError SenseKey = 0x1
	NotReady       SenseKey = 0x2
	MediumError    SenseKey = 0x3
	HardwareError  SenseKey = 0x4
	IllegalRequest SenseKey = 0x5
	UnitAttention  SenseKey = 0x6
	DataProtect    SenseKey = 0x7
	BlankCheck     SenseKey = 0x8
	VendorSpecific SenseKey = 0x9
	CopyAborted    SenseKey = 0xA
	AbortedCommand SenseKey = 0xB
	VolumeOverflow SenseKey = 0xD
	Miscompare     SenseKey = 0xE
	Completed      SenseKey = 0xF
)

var senseKeyNames = [16]string{
	"NO SENSE", "RECOVERED ERROR", "NOT READY", "MEDIUM ERROR", "HARDWARE ERROR",
	"ILLEGAL REQUEST", "UNIT ATTENTION", "DATA PROTECT", "BLANK CHECK", "VENDOR SPECIFIC",
	"COPY ABORTED", "ABORTED COMMAND", "reserved sense key 0xc", "VOLUME OVERFLOW", "MISCOMPARE", "COMPLETED",
}

func (k SenseKey) String() string { return senseKeyNames[k&0xf] }

// Sense is parsed sense data, from either format.
type Sense struct {
	// ResponseCode is 0x70/0x71 (fixed, current/deferred) or 0x72/0x73
	// (descriptor, current/deferred).
	ResponseCode uint8
	Key          SenseKey
	ASC, ASCQ    uint8
	// Information is the INFORMATION field when InfoValid (fixed format:
	// VALID bit and bytes 3-6; descriptor format: the Information
	// descriptor, type 00h).
	Information uint64
	InfoValid   bool
	// SenseKeySpecific holds the three sense-key-specific bytes when SKSV
	// is set (fixed bytes 15-17; descriptor type 02h bytes 4-6).
	SenseKeySpecific [3]byte
	SKSV             bool
}

// Deferred reports a deferred error (response code 71h or 73h): it belongs
// to an earlier command, not to the one that returned it.
func (s Sense) Deferred() bool { return s.ResponseCode == 0x71 || s.ResponseCode == 0x73 }

// Descriptor reports descriptor-format sense data.
func (s Sense) Descriptor() bool { return s.ResponseCode == 0x72 || s.ResponseCode == 0x73 }

func (s Sense) String() string {
	d := ascDescription(s.ASC, s.ASCQ)
	if d == "" {
		d = "additional sense"
	}
	return fmt.Sprintf("%s, %s (ASC/ASCQ %02x/%02x)", s.Key, d, s.ASC, s.ASCQ)
}

// ErrNoSense is returned by ParseSense for an empty or all-zero buffer
// (a CHECK CONDITION whose sense was not returned).
var ErrNoSense = fmt.Errorf("scsi: no sense data")

// ParseSense parses sense data in fixed format (SPC-4 "Fixed format sense
// data": response code 70h/71h) or descriptor format ("Descriptor format
// sense data": 72h/73h). Truncated data is parsed as far as it goes: the
// kernel may cut sense to the buffer it was given, and a sense key alone is
// still worth acting on.
func ParseSense(b []byte) (Sense, error) {
	if len(b) == 0 {
		return Sense{}, ErrNoSense
	}
	s := Sense{ResponseCode: b[0] & 0x7f}
	switch s.ResponseCode {
	case 0x70, 0x71:
		return parseFixedSense(b, s)
	case 0x72, 0x73:
		return parseDescriptorSense(b, s)
	}
	return s, fmt.Errorf("scsi: unknown sense response code 0x%02x", s.ResponseCode)
}

// parseFixedSense parses fixed-format sense data into s.
func parseFixedSense(b []byte, s Sense) (Sense, error) {
	// Fixed: byte 0 bit 7 VALID; byte 2 bits 3-0 SENSE KEY; bytes 3-6
	// INFORMATION; byte 7 ADDITIONAL SENSE LENGTH (n-7); byte 12 ASC;
	// byte 13 ASCQ; byte 15 bit 7 SKSV, bytes 15-17 sense key specific.
	if len(b) < 3 {
		return s, fmt.Errorf("scsi: fixed-format sense data truncated to %d bytes", len(b))
	}
	s.Key = SenseKey(b[2] & 0x0f)
	end := len(b)
	if len(b) >= 8 {
		if n := 8 + int(b[7]); n < end {
			end = n
		}
	}
	b = b[:end]
	if len(b) >= 7 && b[0]&0x80 != 0 {
		s.Information = uint64(binary.BigEndian.Uint32(b[3:7]))
		s.InfoValid = true
	}
	if len(b) >= 13 {
		s.ASC = b[12]
	}
	if len(b) >= 14 {
		s.ASCQ = b[13]
	}
	if len(b) >= 18 && b[15]&0x80 != 0 {
		s.SKSV = true
		copy(s.SenseKeySpecific[:], b[15:18])
		s.SenseKeySpecific[0] &= 0x7f
	}
	return s, nil
}

// parseDescriptorSense parses descriptor-format sense data into s.
func parseDescriptorSense(b []byte, s Sense) (Sense, error) {
	// Descriptor: byte 1 bits 3-0 SENSE KEY; byte 2 ASC; byte 3 ASCQ;
	// byte 7 ADDITIONAL SENSE LENGTH (n-7); sense data descriptors from
	// byte 8, each with its type in byte 0 and ADDITIONAL LENGTH in byte 1.
	if len(b) < 2 {
		return s, fmt.Errorf("scsi: descriptor-format sense data truncated to %d bytes", len(b))
	}
	s.Key = SenseKey(b[1] & 0x0f)
	if len(b) >= 3 {
		s.ASC = b[2]
	}
	if len(b) >= 4 {
		s.ASCQ = b[3]
	}
	if len(b) < 8 {
		return s, nil
	}
	end := 8 + int(b[7])
	if end > len(b) {
		end = len(b)
	}
	for p := 8; p+2 <= end; {
		typ, l := b[p], int(b[p+1])
		readDescriptor(&s, typ, b[p+2:min(p+2+l, end)])
		p += 2 + l
	}
	return s, nil
}

// readDescriptor reads a sense data descriptor of type typ, d its bytes
// after the type and length, into s.
func readDescriptor(s *Sense, typ byte, d []byte) {
	switch typ {
	case 0x00: // Information descriptor: byte 2 bit 7 VALID, bytes 4-11 INFORMATION.
		if len(d) >= 10 && d[0]&0x80 != 0 {
			s.Information = binary.BigEndian.Uint64(d[2:10])
			s.InfoValid = true
		}
	case 0x02: // Sense key specific descriptor: byte 4 bit 7 SKSV, bytes 4-6.
		if len(d) >= 5 && d[2]&0x80 != 0 {
			s.SKSV = true
			copy(s.SenseKeySpecific[:], d[2:5])
			s.SenseKeySpecific[0] &= 0x7f
		}
	}
}

// Additional sense codes the fencing logic acts on (SPC-4 "ASC and ASCQ
// assignments").
const (
	ASCInvalidOpcode           = 0x20 // 20/00 INVALID COMMAND OPERATION CODE
	ASCInvalidFieldInCDB       = 0x24 // 24/00 INVALID FIELD IN CDB
	ASCInvalidFieldInParamList = 0x26 // 26/00 INVALID FIELD IN PARAMETER LIST; 26/04 INVALID RELEASE OF PERSISTENT RESERVATION
	ASCPowerOnReset            = 0x29 // 29/xx POWER ON, RESET, OR BUS DEVICE RESET OCCURRED
	ASCParametersChanged       = 0x2A // 2A/03 RESERVATIONS PREEMPTED, 2A/04 RESERVATIONS RELEASED, 2A/05 REGISTRATIONS PREEMPTED
	ASCNotReady                = 0x04 // 04/xx LOGICAL UNIT NOT READY
	ASCMediumNotPresent        = 0x3A // 3A/xx MEDIUM NOT PRESENT
)

const (
	ASCQReservationsPreempted  = 0x03
	ASCQReservationsReleased   = 0x04
	ASCQRegistrationsPreempted = 0x05
	ASCQBecomingReady          = 0x01 // with ASC 04h
)

// ascDescriptions name the additional sense codes (ASC<<8 | ASCQ) seen
// from the targets the fencing logic talks to (SPC-4 "ASC and ASCQ
// assignments").
var ascDescriptions = map[uint16]string{
	0x0400: "LOGICAL UNIT NOT READY, CAUSE NOT REPORTABLE",
	0x0401: "LOGICAL UNIT IS IN PROCESS OF BECOMING READY",
	0x0402: "LOGICAL UNIT NOT READY, INITIALIZING COMMAND REQUIRED",
	0x0403: "LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED",
	0x2000: "INVALID COMMAND OPERATION CODE",
	0x2400: "INVALID FIELD IN CDB",
	0x2500: "LOGICAL UNIT NOT SUPPORTED",
	0x2600: "INVALID FIELD IN PARAMETER LIST",
	0x2604: "INVALID RELEASE OF PERSISTENT RESERVATION",
	0x2900: "POWER ON, RESET, OR BUS DEVICE RESET OCCURRED",
	0x2901: "POWER ON OCCURRED",
	0x2902: "SCSI BUS RESET OCCURRED",
	0x2903: "BUS DEVICE RESET FUNCTION OCCURRED",
	0x2904: "DEVICE INTERNAL RESET",
	0x2907: "I_T NEXUS LOSS OCCURRED",
	0x2A01: "MODE PARAMETERS CHANGED",
	0x2A03: "RESERVATIONS PREEMPTED",
	0x2A04: "RESERVATIONS RELEASED",
	0x2A05: "REGISTRATIONS PREEMPTED",
	0x2A09: "CAPACITY DATA HAS CHANGED",
	0x3A00: "MEDIUM NOT PRESENT",
	0x3F0E: "REPORTED LUNS DATA HAS CHANGED",
}

// ascDescription names an additional sense code, or "" when it is not in
// ascDescriptions.
func ascDescription(asc, ascq uint8) string {
	return ascDescriptions[uint16(asc)<<8|uint16(ascq)]
}
