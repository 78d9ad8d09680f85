package smbios

import (
	"errors"
	"strings"
	"testing"
)

func TestParseTableVersions(t *testing.T) {
	cases := []struct {
		name         string
		major, minor uint8
		is64         bool
		wantUUID     string
		wantVersion  string
	}{
		{"3.2 64-bit entry point", 3, 2, true, testUUIDLE, "3.2"},
		{"2.8 32-bit entry point", 2, 8, false, testUUIDLE, "2.8"},
		{"2.6 is the first little-endian version", 2, 6, false, testUUIDLE, "2.6"},
		{"2.5 keeps the big-endian fields", 2, 5, false, testUUIDBE, "2.5"},
		{"2.4 keeps the big-endian fields", 2, 4, false, testUUIDBE, "2.4"},
		{"2.51 is firmware's spelling of 2.6", 2, 51, false, testUUIDLE, "2.6"},
		{"2.33 is firmware's spelling of 2.3", 2, 33, false, testUUIDBE, "2.3"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ep, tab := table2(c.major, c.minor, testUUIDRaw)
			if c.is64 {
				ep, tab = table3(c.major, c.minor, testUUIDRaw)
			}
			info, err := ParseTable(ep, tab)
			if err != nil {
				t.Fatalf("ParseTable: %v", err)
			}
			want := Info{
				UUID:          c.wantUUID,
				Manufacturer:  "whitesky.cloud",
				ProductName:   "VCO Virtual Machine",
				Serial:        "SN-0042",
				SMBIOSVersion: c.wantVersion,
				Source:        SourceDMITable,
			}
			if info != want {
				t.Fatalf("got %+v\nwant %+v", info, want)
			}
		})
	}
}

func TestParseTableLegacyEntryPoint(t *testing.T) {
	tab := concat(systemInfo(testUUIDRaw), endOfTable())
	info, err := ParseTable(entryPointLegacy(2, 3, uint16(len(tab)), 2), tab)
	if err != nil {
		t.Fatal(err)
	}
	if info.UUID != testUUIDBE || info.SMBIOSVersion != "2.3" {
		t.Fatalf("got %+v", info)
	}
}

// A 3.x kernel export may be longer than the table (padding) or end right
// after the end-of-table structure; both parse. Bytes after end-of-table
// are never walked.
func TestParseTable3TrailingBytes(t *testing.T) {
	ep, tab := table3(3, 0, testUUIDRaw)
	tab = append(tab, 0xde, 0xad, 0xbe, 0xef, 0x01)
	info, err := ParseTable(ep, tab)
	if err != nil {
		t.Fatal(err)
	}
	if info.UUID != testUUIDLE {
		t.Fatalf("UUID %s", info.UUID)
	}
}

func TestParseTableStringsOutOfRange(t *testing.T) {
	body := make([]byte, 0x1B-headerLen)
	body[0x04-headerLen] = 1
	body[0x05-headerLen] = 9 // beyond the string set
	body[0x07-headerLen] = 0 // no serial
	copy(body[0x08-headerLen:], testUUIDRaw[:])
	tab := concat(structure(1, 1, body, "Acme"), endOfTable())
	info, err := ParseTable(entryPoint64(3, 4, uint32(len(tab))), tab)
	if err != nil {
		t.Fatal(err)
	}
	if info.Manufacturer != "Acme" || info.ProductName != "" || info.Serial != "" || info.UUID != testUUIDLE {
		t.Fatalf("got %+v", info)
	}
}

func TestParseTableNotPresentUUID(t *testing.T) {
	var ff [16]byte
	for i := range ff {
		ff[i] = 0xFF
	}
	for name, raw := range map[string][16]byte{"all bytes 0x00": {}, "all bytes 0xFF": ff} {
		t.Run(name, func(t *testing.T) {
			ep, tab := table3(3, 2, raw)
			_, err := ParseTable(ep, tab)
			if !errors.Is(err, ErrUUIDNotPresent) {
				t.Fatalf("want ErrUUIDNotPresent, got %v", err)
			}
			if !strings.Contains(err.Error(), name) {
				t.Fatalf("error %q does not say %q", err, name)
			}
		})
	}
}

func TestParseTableErrors(t *testing.T) {
	goodEP3, goodTab := table3(3, 2, testUUIDRaw)
	goodEP2, goodTab2 := table2(2, 8, testUUIDRaw)

	badSum64 := clone(goodEP3)
	badSum64[0x0C]++
	badSum32 := clone(goodEP2)
	badSum32[0x06]++ // outside the intermediate area: only the outer sum breaks
	badInter := clone(goodEP2)
	badInter[0x16]++ // table length: breaks the intermediate sum
	fixChecksum(badInter, 0x04)
	noInter := clone(goodEP2)
	copy(noInter[0x10:], "XXXXX")
	fixChecksum(noInter, 0x04)
	badLen32 := clone(goodEP2)
	badLen32[0x05] = 0x10
	badLen64 := clone(goodEP3)
	badLen64[0x06] = 0x40

	v20 := structure(1, 1, []byte{1, 2, 3, 4}, "a", "b", "c", "d") // 2.0: no UUID field
	v20Tab := concat(v20, endOfTable())

	cases := []struct {
		name    string
		ep, tab []byte
		target  error
		want    string
	}{
		{"empty entry point", nil, goodTab, ErrInvalidEntryPoint, "unknown anchor"},
		{"unknown anchor", []byte("_XX_ whatever"), goodTab, ErrInvalidEntryPoint, "unknown anchor"},
		{"64-bit checksum", badSum64, goodTab, ErrInvalidEntryPoint, "64-bit entry point checksum"},
		{"64-bit truncated", goodEP3[:10], goodTab, ErrInvalidEntryPoint, "only 10 bytes"},
		{"64-bit length beyond buffer", badLen64, goodTab, ErrInvalidEntryPoint, "declares length 64"},
		{"32-bit checksum", badSum32, goodTab2, ErrInvalidEntryPoint, "32-bit entry point checksum"},
		{"32-bit intermediate checksum", badInter, goodTab2, ErrInvalidEntryPoint, "intermediate checksum"},
		{"32-bit no intermediate anchor", noInter, goodTab2, ErrInvalidEntryPoint, "_DMI_ intermediate anchor"},
		{"32-bit bad length", badLen32, goodTab2, ErrInvalidEntryPoint, "declares length 16"},
		{"32-bit truncated", goodEP2[:20], goodTab2, ErrInvalidEntryPoint, "only 20 bytes"},
		{"legacy truncated", []byte("_DMI_abc"), goodTab2, ErrInvalidEntryPoint, "legacy DMI entry point truncated"},
		{"2.x table shorter than declared", goodEP2, goodTab2[:len(goodTab2)-3], ErrInvalidTable, "truncated"},
		{"header truncated", entryPoint64(3, 0, 100), goodTab[:2], ErrInvalidTable, "header truncated"},
		{"length below header", entryPoint64(3, 0, 100), []byte{1, 2, 0, 0, 0, 0}, ErrInvalidTable, "below the header size"},
		{"formatted area truncated", entryPoint64(3, 0, 100), systemInfo(testUUIDRaw)[:20], ErrInvalidTable, "declares length 27 but only 20"},
		{"string set unterminated", entryPoint64(3, 0, 1000), systemInfo(testUUIDRaw)[:40], ErrInvalidTable, "not terminated by a double NUL"},
		{"cut by the 3.x maximum size", entryPoint64(3, 0, uint32(len(biosInfo())+20)), goodTab, ErrInvalidTable, "structure type 1"},
		{"no system information", entryPoint64(3, 0, 100), concat(biosInfo(), endOfTable()), ErrInvalidTable, "no system information (type 1)"},
		{"system information before end-of-table missing", entryPoint64(3, 0, 100), concat(biosInfo(), endOfTable(), systemInfo(testUUIDRaw)), ErrInvalidTable, "no system information"},
		{"SMBIOS 2.0 system information has no UUID", entryPoint32(2, 0, uint16(len(v20Tab)), 2), v20Tab, ErrInvalidTable, "carries no UUID"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			info, err := ParseTable(c.ep, c.tab)
			if err == nil {
				t.Fatalf("want an error, got %+v", info)
			}
			if !errors.Is(err, c.target) {
				t.Fatalf("error %q does not wrap %v", err, c.target)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not contain %q", err, c.want)
			}
		})
	}
}

// The 2.x structure count bounds the walk: a table whose count stops
// before type 1 has no system information even if bytes follow.
func TestParseTableStructureCount(t *testing.T) {
	tab := concat(biosInfo(), systemInfo(testUUIDRaw), endOfTable())
	_, err := ParseTable(entryPoint32(2, 8, uint16(len(tab)), 1), tab)
	if err == nil || !strings.Contains(err.Error(), "no system information") {
		t.Fatalf("got %v", err)
	}
}

func TestParseStructures(t *testing.T) {
	tab := concat(biosInfo(), systemInfo(testUUIDRaw), structure(32, 0x2000, []byte{0, 0, 0, 0, 0, 0, 0}), endOfTable(), []byte{0xff, 0xff})
	ss, err := ParseStructures(tab)
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) != 4 {
		t.Fatalf("got %d structures, want 4 (walk must stop at end-of-table)", len(ss))
	}
	wantTypes := []uint8{0, 1, 32, 127}
	for i, s := range ss {
		if s.Type != wantTypes[i] {
			t.Fatalf("structure %d has type %d, want %d", i, s.Type, wantTypes[i])
		}
	}
	if ss[0].Handle != 0 || ss[1].Handle != 0x0100 || ss[2].Handle != 0x2000 {
		t.Fatalf("handles: %04x %04x %04x", ss[0].Handle, ss[1].Handle, ss[2].Handle)
	}
	if got := strings.Join(ss[1].Strings, "|"); got != "whitesky.cloud|VCO Virtual Machine|1.0|SN-0042" {
		t.Fatalf("strings %q", got)
	}
	if len(ss[2].Strings) != 0 {
		t.Fatalf("structure without strings got %q", ss[2].Strings)
	}
	if s, ok := ss[0].String(0x04); !ok || s != "SeaBIOS" {
		t.Fatalf("String(0x05) = %q, %v", s, ok)
	}
	if _, ok := ss[0].String(0x200); ok {
		t.Fatal("String beyond the formatted area must report !ok")
	}
}

func TestFormatUUID(t *testing.T) {
	le, err := FormatUUID(testUUIDRaw, true)
	if err != nil || le != testUUIDLE {
		t.Fatalf("little-endian fields: %q, %v", le, err)
	}
	be, err := FormatUUID(testUUIDRaw, false)
	if err != nil || be != testUUIDBE {
		t.Fatalf("big-endian fields: %q, %v", be, err)
	}
}

func TestParseUUID(t *testing.T) {
	got, err := ParseUUID("4C4C4544-0042-3510-8056-B4C04F564433")
	if err != nil || got != "4c4c4544-0042-3510-8056-b4c04f564433" {
		t.Fatalf("got %q, %v", got, err)
	}
	bad := map[string]string{
		"":                                         "0 characters",
		"4c4c4544-0042-3510-8056-b4c04f56443":      "35 characters",
		"4c4c4544x0042-3510-8056-b4c04f564433":     "want '-' at position 9",
		"4c4c4544-0042-3510-8056-b4c04f56443g":     "not hexadecimal at position 35",
		"00000000-0000-0000-0000-000000000000":     "all bytes 0x00",
		"FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF":     "all bytes 0xFF",
		"{4c4c4544-0042-3510-8056-b4c04f564433}":   "38 characters",
		"4c4c4544-0042-3510-8056-b4c04f564433\x00": "37 characters",
	}
	for in, want := range bad {
		_, err := ParseUUID(in)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseUUID(%q) = %v, want an error containing %q", in, err, want)
		}
	}
}

func clone(b []byte) []byte { return append([]byte{}, b...) }
