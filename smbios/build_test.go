package smbios

import "encoding/binary"

// Builders for SMBIOS tables, byte by byte as the specification lays them
// out (DSP0134), so the tests exercise the same bytes firmware writes.

// fixChecksum sets b[at] so that the bytes of b sum to zero.
func fixChecksum(b []byte, at int) {
	b[at] = 0
	var sum byte
	for _, c := range b {
		sum += c
	}
	b[at] = -sum
}

// entryPoint32 builds a 31-byte _SM_ entry point.
func entryPoint32(major, minor uint8, tableLen uint16, numStructs uint16) []byte {
	b := make([]byte, 0x1F)
	copy(b, "_SM_")
	b[0x05] = 0x1F
	b[0x06], b[0x07] = major, minor
	binary.LittleEndian.PutUint16(b[0x08:], 0x100) // maximum structure size
	copy(b[0x10:], "_DMI_")
	binary.LittleEndian.PutUint16(b[0x16:], tableLen)
	binary.LittleEndian.PutUint32(b[0x18:], 0x000F0000)
	binary.LittleEndian.PutUint16(b[0x1C:], numStructs)
	b[0x1E] = major<<4 | minor&0x0F
	fixChecksum(b[0x10:0x1F], 0x05)
	fixChecksum(b, 0x04)
	return b
}

// entryPoint64 builds a 24-byte _SM3_ entry point.
func entryPoint64(major, minor uint8, maxSize uint32) []byte {
	b := make([]byte, 0x18)
	copy(b, "_SM3_")
	b[0x06] = 0x18
	b[0x07], b[0x08], b[0x09] = major, minor, 0
	b[0x0A] = 1
	binary.LittleEndian.PutUint32(b[0x0C:], maxSize)
	binary.LittleEndian.PutUint64(b[0x10:], 0x7FFFF000)
	fixChecksum(b, 0x05)
	return b
}

// entryPointLegacy builds a 15-byte DMI 2.0 style _DMI_ entry point.
func entryPointLegacy(major, minor uint8, tableLen uint16, numStructs uint16) []byte {
	b := make([]byte, 0x0F)
	copy(b, "_DMI_")
	binary.LittleEndian.PutUint16(b[0x06:], tableLen)
	binary.LittleEndian.PutUint32(b[0x08:], 0x000F0000)
	binary.LittleEndian.PutUint16(b[0x0C:], numStructs)
	b[0x0E] = major<<4 | minor&0x0F
	fixChecksum(b, 0x05)
	return b
}

// structure encodes one structure: header, the rest of the formatted area,
// then the string set (two NULs when there are no strings).
func structure(typ uint8, handle uint16, body []byte, strs ...string) []byte {
	b := []byte{typ, byte(headerLen + len(body)), 0, 0}
	binary.LittleEndian.PutUint16(b[2:], handle)
	b = append(b, body...)
	if len(strs) == 0 {
		return append(b, 0, 0)
	}
	for _, s := range strs {
		b = append(b, s...)
		b = append(b, 0)
	}
	return append(b, 0)
}

// testUUIDRaw is a UUID as stored in a table. Read with the 2.6+ byte
// order it is testUUIDLE; with the older one testUUIDBE.
var testUUIDRaw = [16]byte{
	0x33, 0x22, 0x11, 0x00, 0x55, 0x44, 0x77, 0x66,
	0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff,
}

const (
	testUUIDLE = "00112233-4455-6677-8899-aabbccddeeff"
	testUUIDBE = "33221100-5544-7766-8899-aabbccddeeff"
)

// systemInfo builds a 2.4+ type 1 structure (27 bytes formatted) with
// manufacturer, product, version and serial strings.
func systemInfo(uuid [16]byte) []byte {
	body := make([]byte, 0x1B-headerLen)
	body[0x04-headerLen] = 1 // manufacturer
	body[0x05-headerLen] = 2 // product name
	body[0x06-headerLen] = 3 // version
	body[0x07-headerLen] = 4 // serial
	copy(body[0x08-headerLen:], uuid[:])
	body[0x18-headerLen] = 6 // wake-up type: power switch
	return structure(1, 0x0100, body, "whitesky.cloud", "VCO Virtual Machine", "1.0", "SN-0042")
}

// biosInfo builds a type 0 structure so type 1 is not the first one.
func biosInfo() []byte {
	body := make([]byte, 0x18-headerLen)
	body[0] = 1 // vendor
	body[1] = 2 // version
	return structure(0, 0x0000, body, "SeaBIOS", "1.16.2")
}

func endOfTable() []byte { return structure(typeEndOfTable, 0xFEFF, nil) }

func concat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// table2 returns a 2.x entry point and table holding BIOS, system and
// end-of-table structures.
func table2(major, minor uint8, uuid [16]byte) (ep, tab []byte) {
	tab = concat(biosInfo(), systemInfo(uuid), endOfTable())
	return entryPoint32(major, minor, uint16(len(tab)), 3), tab
}

// table3 returns a 3.x entry point and table; maxSize leaves slack as
// firmware commonly does.
func table3(major, minor uint8, uuid [16]byte) (ep, tab []byte) {
	tab = concat(biosInfo(), systemInfo(uuid), endOfTable())
	return entryPoint64(major, minor, uint32(len(tab)+64)), tab
}
