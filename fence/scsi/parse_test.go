package scsi

import (
	"slices"
	"testing"
)

func TestParseSenseFixed(t *testing.T) {
	// SPC-4 "Fixed format sense data": byte 0 VALID (bit 7) and RESPONSE
	// CODE 70h; byte 2 SENSE KEY; bytes 3-6 INFORMATION; byte 7 ADDITIONAL
	// SENSE LENGTH; byte 12 ASC; byte 13 ASCQ; byte 15 SKSV (bit 7) and
	// bytes 15-17 SENSE KEY SPECIFIC.
	b := []byte{0xf0, 0, 0x06, 0x00, 0x00, 0x12, 0x34, 10, 0, 0, 0, 0, 0x2a, 0x03, 0, 0x80 | 0x40, 0x00, 0x02}
	s, err := ParseSense(b)
	if err != nil {
		t.Fatal(err)
	}
	if s.Key != UnitAttention || s.ASC != 0x2a || s.ASCQ != 0x03 || !s.InfoValid || s.Information != 0x1234 ||
		!s.SKSV || s.SenseKeySpecific != [3]byte{0x40, 0x00, 0x02} || s.Deferred() || s.Descriptor() {
		t.Fatalf("parsed %+v", s)
	}
	if got := s.String(); got != "UNIT ATTENTION, RESERVATIONS PREEMPTED (ASC/ASCQ 2a/03)" {
		t.Fatalf("String() = %q", got)
	}
	// The ADDITIONAL SENSE LENGTH bounds the data: with length 4, ASC and
	// ASCQ (bytes 12-13) lie outside it and must not be read.
	b[7] = 4
	s, _ = ParseSense(b)
	if s.ASC != 0 || s.ASCQ != 0 || s.Key != UnitAttention {
		t.Fatalf("short additional length: %+v", s)
	}
	// Deferred (71h) and truncated to three bytes.
	s, err = ParseSense([]byte{0x71, 0, 0x05})
	if err != nil || s.Key != IllegalRequest || !s.Deferred() {
		t.Fatalf("truncated deferred: %+v, %v", s, err)
	}
}

func TestParseSenseDescriptor(t *testing.T) {
	// SPC-4 "Descriptor format sense data": byte 0 RESPONSE CODE 72h; byte
	// 1 SENSE KEY; byte 2 ASC; byte 3 ASCQ; byte 7 ADDITIONAL SENSE LENGTH;
	// descriptors: Information (type 00h: byte 2 VALID bit 7, bytes 4-11
	// INFORMATION) and Sense key specific (type 02h: byte 4 SKSV bit 7).
	b := []byte{0x72, 0x05, 0x24, 0x00, 0, 0, 0, 20,
		0x00, 0x0a, 0x80, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x02,
		0x02, 0x06, 0, 0, 0xc0, 0x00, 0x01, 0}
	s, err := ParseSense(b)
	if err != nil {
		t.Fatal(err)
	}
	if s.Key != IllegalRequest || s.ASC != 0x24 || s.ASCQ != 0 || !s.Descriptor() ||
		!s.InfoValid || s.Information != 0x0102 || !s.SKSV || s.SenseKeySpecific != [3]byte{0x40, 0x00, 0x01} {
		t.Fatalf("parsed %+v", s)
	}
	if _, err := ParseSense(nil); err != ErrNoSense {
		t.Fatalf("empty sense: %v", err)
	}
	if _, err := ParseSense([]byte{0x7f, 1, 2}); err == nil {
		t.Fatal("unknown response code accepted")
	}
}

func TestParseReadKeys(t *testing.T) {
	// "PERSISTENT RESERVE IN parameter data for READ KEYS": PRGENERATION
	// bytes 0-3, ADDITIONAL LENGTH bytes 4-7, then 8-byte keys.
	b := []byte{0, 0, 0, 7, 0, 0, 0, 16,
		0x76, 0x63, 1, 2, 3, 4, 5, 6,
		0x76, 0x63, 9, 9, 9, 9, 9, 9}
	k, err := ParseReadKeys(b)
	if err != nil {
		t.Fatal(err)
	}
	if k.Generation != 7 || k.Truncated || !slices.Equal(k.Keys, []uint64{0x7663010203040506, 0x7663090909090909}) {
		t.Fatalf("parsed %+v", k)
	}
	// Cut at the allocation length: one key, and the parser says more exist.
	k, err = ParseReadKeys(b[:16])
	if err != nil || !k.Truncated || k.Need != 24 || len(k.Keys) != 1 {
		t.Fatalf("truncated: %+v, %v", k, err)
	}
	if _, err := ParseReadKeys([]byte{0, 0, 0, 0, 0, 0, 0, 3}); err == nil {
		t.Fatal("additional length not a multiple of 8 accepted")
	}
}

func TestParseReadReservation(t *testing.T) {
	// "PERSISTENT RESERVE IN parameter data for READ RESERVATION": with a
	// reservation, ADDITIONAL LENGTH 10h, RESERVATION KEY bytes 8-15, SCOPE
	// and TYPE in byte 21.
	none := []byte{0, 0, 0, 3, 0, 0, 0, 0}
	r, err := ParseReadReservation(none)
	if err != nil || r.Present || r.Generation != 3 {
		t.Fatalf("none: %+v, %v", r, err)
	}
	b := []byte{0, 0, 0, 4, 0, 0, 0, 0x10,
		0x76, 0x63, 1, 2, 3, 4, 5, 6,
		0, 0, 0, 0, 0, 0x03, 0, 0}
	r, err = ParseReadReservation(b)
	if err != nil || !r.Present || r.Key != 0x7663010203040506 || r.Type != 3 || r.Scope != 0 {
		t.Fatalf("reservation: %+v, %v", r, err)
	}
	if _, err := ParseReadReservation(b[:20]); err == nil {
		t.Fatal("truncated reservation accepted")
	}
}

func TestParseReportCapabilities(t *testing.T) {
	// "PERSISTENT RESERVE IN parameter data for REPORT CAPABILITIES": LENGTH
	// 0008h; byte 2 RLR_C bit 7, CRH bit 4, SIP_C bit 3, ATP_C bit 2,
	// PTPL_C bit 0; byte 3 TMV bit 7, ALLOW COMMANDS bits 6-4, PTPL_A bit 0;
	// byte 4 WR_EX_AR bit 7, EX_AC_RO bit 6, WR_EX_RO bit 5, EX_AC bit 3,
	// WR_EX bit 1; byte 5 EX_AC_AR bit 0.
	c, err := ParseReportCapabilities([]byte{0, 8, 0x8d, 0x91, 0xea, 0x01, 0, 0})
	if err != nil {
		t.Fatal(err)
	}
	want := Capabilities{ReplaceLostReservation: true, SpecifyInitiatorPorts: true, AllTargetPorts: true,
		PTPLCapable: true, TypeMaskValid: true, AllowCommands: 1, PTPLActivated: true, TypeMask: 0xea01}
	if c != want {
		t.Fatalf("parsed %+v, want %+v", c, want)
	}
	if !slices.Equal(c.Types(), []uint8{1, 3, 5, 6, 7, 8}) {
		t.Fatalf("types %v", c.Types())
	}
	// Only WR_EX (byte 4 bit 1) and EX_AC_AR (byte 5 bit 0).
	c, _ = ParseReportCapabilities([]byte{0, 8, 0, 0x80, 0x02, 0x01, 0, 0})
	if !slices.Equal(c.Types(), []uint8{1, 8}) {
		t.Fatalf("types %v", c.Types())
	}
	// TMV clear: the mask means nothing.
	c, _ = ParseReportCapabilities([]byte{0, 8, 0, 0x00, 0xea, 0x01, 0, 0})
	if c.Supports(1) || len(c.Types()) != 0 {
		t.Fatalf("mask used without TMV: %v", c.Types())
	}
}

func TestParseReadFullStatus(t *testing.T) {
	// "PERSISTENT RESERVE IN full status descriptor format": key 0-7,
	// ALL_TG_PT byte 12 bit 1, R_HOLDER byte 12 bit 0, SCOPE/TYPE byte 13,
	// RELATIVE TARGET PORT IDENTIFIER 18-19, ADDITIONAL DESCRIPTOR LENGTH
	// 20-23, TransportID from 24. The TransportID is an iSCSI initiator
	// device TransportID: protocol 5h, length bytes 2-3, name.
	tid := []byte{0x05, 0, 0, 8, 'i', 'q', 'n', '.', 'a', 0, 0, 0}
	d1 := append([]byte{0x76, 0x63, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0x01, 0x01, 0, 0, 0, 0, 0, 1, 0, 0, 0, byte(len(tid))}, tid...)
	d2 := []byte{0x76, 0x63, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0x02, 0x00, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0}
	body := append(append([]byte{}, d1...), d2...)
	b := append([]byte{0, 0, 0, 9, 0, 0, 0, byte(len(body))}, body...)
	fs, err := ParseReadFullStatus(b)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Generation != 9 || len(fs.Registrants) != 2 {
		t.Fatalf("parsed %+v", fs)
	}
	r := fs.Registrants[0]
	if r.Key != 0x7663010203040506 || !r.Holder || r.AllTargetPorts || r.Type != 1 || r.RelativeTargetPort != 1 || r.Initiator() != "iqn.a" {
		t.Fatalf("first %+v (%s)", r, r.Initiator())
	}
	r = fs.Registrants[1]
	if r.Holder || !r.AllTargetPorts || r.RelativeTargetPort != 2 || len(r.TransportID) != 0 {
		t.Fatalf("second %+v", r)
	}
	// A descriptor whose TransportID runs past the data is an error.
	bad := append([]byte{}, b...)
	bad[8+23] = 200
	if _, err := ParseReadFullStatus(bad); err == nil {
		t.Fatal("overrunning descriptor accepted")
	}
}

func TestParseInquiry(t *testing.T) {
	// "Standard INQUIRY data format": PERIPHERAL QUALIFIER and DEVICE TYPE
	// byte 0, VERSION byte 2, ADDITIONAL LENGTH byte 4, vendor 8-15,
	// product 16-31, revision 32-35.
	b := make([]byte, 36)
	b[0] = 0x00
	b[2] = 0x06
	b[4] = 31
	copy(b[8:], "IET     ")
	copy(b[16:], "VIRTUAL-DISK    ")
	copy(b[32:], "0001")
	q, err := ParseInquiry(b)
	if err != nil || q.Vendor != "IET" || q.Product != "VIRTUAL-DISK" || q.Revision != "0001" || q.Version != 6 || q.DeviceType != 0 {
		t.Fatalf("parsed %+v, %v", q, err)
	}
	b[0] = 0x7f // qualifier 3, type 1Fh: no LU
	b[10] = 0x07
	q, _ = ParseInquiry(b)
	if q.Qualifier != 3 || q.DeviceType != 0x1f || q.Vendor != "IE?" {
		t.Fatalf("parsed %+v", q)
	}
}

func TestParseVPD(t *testing.T) {
	// "Unit Serial Number VPD page": page code 80h byte 1, PAGE LENGTH
	// bytes 2-3, serial from byte 4.
	s, err := ParseUnitSerial([]byte{0, 0x80, 0, 8, ' ', ' ', 'b', 'e', 'e', 'f', '0', 0})
	if err != nil || s != "beef0" {
		t.Fatalf("serial %q, %v", s, err)
	}
	if _, err := ParseUnitSerial([]byte{0, 0x83, 0, 0}); err == nil {
		t.Fatal("wrong page accepted as 0x80")
	}
	// "Device Identification VPD page" with three designation descriptors:
	// NAA (type 3, binary), T10 vendor ID (type 1, ASCII), and a target
	// port designator (association 1) that must not count as the LU's name.
	naa := []byte{0x01, 0x03, 0, 16, 0x60, 0x01, 0x40, 0x5f, 0xa8, 0x3b, 0x1c, 0x2d, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77}
	t10 := []byte{0x02, 0x01, 0, 8, 'I', 'E', 'T', ' ', ' ', ' ', ' ', 'x'}
	port := []byte{0x51, 0x94, 0, 4, 0, 0, 0, 1}
	body := append(append(append([]byte{}, naa...), t10...), port...)
	page := append([]byte{0, 0x83, 0, byte(len(body))}, body...)
	ds, err := ParseDeviceID(page)
	if err != nil || len(ds) != 3 {
		t.Fatalf("designators %+v, %v", ds, err)
	}
	if d := ds[2]; d.Protocol != 5 || !d.PIV || d.Association != 1 || d.Type != 4 {
		t.Fatalf("port designator %+v", d)
	}
	if got := LUNames(ds); !slices.Equal(got, []string{"naa.6001405fa83b1c2d0011223344556677", "t10.IET    x"}) {
		t.Fatalf("LU names %q", got)
	}
	page[3] = byte(len(body) + 4) // page length beyond the data: truncated to what is there
	if _, err := ParseDeviceID(append(page, 0x01, 0x03, 0, 9)); err == nil {
		t.Fatal("overrunning descriptor accepted")
	}
}
