package scsi

import (
	"bytes"
	"testing"
)

func TestTestUnitReadyCDB(t *testing.T) {
	// SPC-4 "TEST UNIT READY command": opcode 00h, bytes 1-4 reserved,
	// byte 5 CONTROL.
	if got := TestUnitReadyCDB(); !bytes.Equal(got, []byte{0, 0, 0, 0, 0, 0}) {
		t.Fatalf("TUR CDB % x", got)
	}
}

func TestInquiryCDB(t *testing.T) {
	// SPC-4 "INQUIRY command": byte 0 12h; byte 1 bit 0 EVPD; byte 2 PAGE
	// CODE; bytes 3-4 ALLOCATION LENGTH (MSB first); byte 5 CONTROL.
	for _, tc := range []struct {
		evpd  bool
		page  uint8
		alloc uint16
		want  []byte
	}{
		{false, 0, 96, []byte{0x12, 0x00, 0x00, 0x00, 0x60, 0x00}},
		{true, 0x80, 255, []byte{0x12, 0x01, 0x80, 0x00, 0xff, 0x00}},
		{true, 0x83, 0x1234, []byte{0x12, 0x01, 0x83, 0x12, 0x34, 0x00}},
	} {
		if got := InquiryCDB(tc.evpd, tc.page, tc.alloc); !bytes.Equal(got, tc.want) {
			t.Errorf("InquiryCDB(%v, %#x, %d) = % x, want % x", tc.evpd, tc.page, tc.alloc, got, tc.want)
		}
	}
}

func TestPRInCDB(t *testing.T) {
	// SPC-4 "PERSISTENT RESERVE IN command": byte 0 5Eh; byte 1 bits 4-0
	// SERVICE ACTION; bytes 2-6 reserved; bytes 7-8 ALLOCATION LENGTH;
	// byte 9 CONTROL. Service action codes from "PERSISTENT RESERVE IN
	// service action codes": READ KEYS 00h, READ RESERVATION 01h, REPORT
	// CAPABILITIES 02h, READ FULL STATUS 03h.
	for _, tc := range []struct {
		a     PRInAction
		alloc uint16
		want  []byte
	}{
		{ReadKeys, 264, []byte{0x5e, 0x00, 0, 0, 0, 0, 0, 0x01, 0x08, 0}},
		{ReadReservation, 24, []byte{0x5e, 0x01, 0, 0, 0, 0, 0, 0x00, 0x18, 0}},
		{ReportCapabilities, 8, []byte{0x5e, 0x02, 0, 0, 0, 0, 0, 0x00, 0x08, 0}},
		{ReadFullStatus, 0xffff, []byte{0x5e, 0x03, 0, 0, 0, 0, 0, 0xff, 0xff, 0}},
	} {
		if got := PRInCDB(tc.a, tc.alloc); !bytes.Equal(got, tc.want) {
			t.Errorf("PRInCDB(%s, %d) = % x, want % x", tc.a, tc.alloc, got, tc.want)
		}
	}
}

func TestPROutCDBAndParams(t *testing.T) {
	// SPC-4 "PERSISTENT RESERVE OUT command": byte 0 5Fh; byte 1 bits 4-0
	// SERVICE ACTION; byte 2 SCOPE (bits 7-4, LU_SCOPE 0h) and TYPE (bits
	// 3-0); bytes 3-4 reserved; bytes 5-8 PARAMETER LIST LENGTH (18h for
	// the basic list); byte 9 CONTROL. Service action codes from
	// "PERSISTENT RESERVE OUT service action codes".
	const key, sakey = 0x7663a1b2c3d4e5f6, 0x76630102030405f0
	for _, tc := range []struct {
		p    PROut
		cdb  []byte
		par  []byte
		name string
	}{
		{
			p:    PROut{Action: Register, Key: 0, ServiceActionKey: key},
			name: "REGISTER",
			cdb:  []byte{0x5f, 0x00, 0x00, 0, 0, 0x00, 0x00, 0x00, 0x18, 0},
			par: []byte{0, 0, 0, 0, 0, 0, 0, 0,
				0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: Register, Key: key, ServiceActionKey: 0},
			name: "REGISTER",
			cdb:  []byte{0x5f, 0x00, 0x00, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: RegisterAndIgnoreExistingKey, ServiceActionKey: key},
			name: "REGISTER AND IGNORE EXISTING KEY",
			cdb:  []byte{0x5f, 0x06, 0x00, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0, 0, 0, 0, 0, 0, 0, 0,
				0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: Reserve, Type: 1, Key: key},
			name: "RESERVE",
			cdb:  []byte{0x5f, 0x01, 0x01, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: Release, Type: 3, Key: key},
			name: "RELEASE",
			cdb:  []byte{0x5f, 0x02, 0x03, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: Clear, Key: key},
			name: "CLEAR",
			cdb:  []byte{0x5f, 0x03, 0x00, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0, 0, 0, 0, 0, 0, 0, 0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: Preempt, Type: 1, Key: key, ServiceActionKey: sakey},
			name: "PREEMPT",
			cdb:  []byte{0x5f, 0x04, 0x01, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0x76, 0x63, 0x01, 0x02, 0x03, 0x04, 0x05, 0xf0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			p:    PROut{Action: PreemptAndAbort, Type: 3, Key: key, ServiceActionKey: sakey},
			name: "PREEMPT AND ABORT",
			cdb:  []byte{0x5f, 0x05, 0x03, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0x76, 0x63, 0xa1, 0xb2, 0xc3, 0xd4, 0xe5, 0xf6,
				0x76, 0x63, 0x01, 0x02, 0x03, 0x04, 0x05, 0xf0,
				0, 0, 0, 0, 0, 0, 0, 0},
		},
		{
			// APTPL is byte 20 bit 0 of "PERSISTENT RESERVE OUT parameter
			// list"; the engine never sets it, the encoder must still
			// place it right.
			p:    PROut{Action: RegisterAndIgnoreExistingKey, ServiceActionKey: 1, APTPL: true},
			name: "REGISTER AND IGNORE EXISTING KEY",
			cdb:  []byte{0x5f, 0x06, 0x00, 0, 0, 0, 0, 0, 0x18, 0},
			par: []byte{0, 0, 0, 0, 0, 0, 0, 0,
				0, 0, 0, 0, 0, 0, 0, 1,
				0, 0, 0, 0, 0x01, 0, 0, 0},
		},
	} {
		if got := tc.p.CDB(); !bytes.Equal(got, tc.cdb) {
			t.Errorf("%s CDB = % x, want % x", tc.name, got, tc.cdb)
		}
		if got := tc.p.Params(); !bytes.Equal(got, tc.par) {
			t.Errorf("%s params = % x, want % x", tc.name, got, tc.par)
		}
		if tc.p.Action.String() != tc.name {
			t.Errorf("action %d named %q, want %q", tc.p.Action, tc.p.Action, tc.name)
		}
	}
}

func TestCodeNames(t *testing.T) {
	for _, tc := range []struct {
		got, want string
	}{
		{ReadFullStatus.String(), "READ FULL STATUS"},
		{PRInAction(0x1f).String(), "PR IN service action 0x1f"},
		{RegisterAndIgnoreExistingKey.String(), "REGISTER AND IGNORE EXISTING KEY"},
		{PROutAction(0x0a).String(), "PR OUT service action 0x0a"},
		{StatusReservationConflict.String(), "RESERVATION CONFLICT"},
		{Status(0x22).String(), "status 0x22"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
}
