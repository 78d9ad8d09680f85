package smbios

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
)

// Entry point anchors. The kernel exports whichever one the firmware
// provided in sysfs as smbios_entry_point.
var (
	anchor32     = []byte("_SM_")
	anchor64     = []byte("_SM3_")
	anchorLegacy = []byte("_DMI_")
)

const (
	entryPoint32Len     = 0x1F
	entryPoint32LenV21  = 0x1E // SMBIOS 2.1 documented the length wrongly; such firmware exists.
	entryPoint64MinLen  = 0x18
	entryPointLegacyLen = 0x0F
	headerLen           = 4
	typeEndOfTable      = 127
)

// EntryPoint is the decoded SMBIOS entry point structure.
type EntryPoint struct {
	// Major and Minor are the SMBIOS version the table conforms to.
	Major, Minor uint8
	// Revision is the docrev of a 3.x entry point, 0 otherwise.
	Revision uint8
	// Is64 reports a 64-bit (_SM3_) entry point.
	Is64 bool
	// TableLength is the exact table length for 2.x entry points and the
	// maximum table size for 3.x ones.
	TableLength uint32
	// TableAddress is the table's physical address (informational: the
	// table itself is read from the sysfs DMI file).
	TableAddress uint64
	// NumStructures is the structure count a 2.x entry point declares; 0
	// for 3.x, which has none.
	NumStructures uint16
}

// Version returns the SMBIOS version as "major.minor".
func (e EntryPoint) Version() string { return fmt.Sprintf("%d.%d", e.Major, e.Minor) }

// atLeast reports whether the table's version is major.minor or later.
func (e EntryPoint) atLeast(major, minor uint8) bool {
	return e.Major > major || (e.Major == major && e.Minor >= minor)
}

// ErrInvalidEntryPoint is wrapped by every entry point parse failure.
var ErrInvalidEntryPoint = errors.New("invalid SMBIOS entry point")

// ErrInvalidTable is wrapped by every structure table parse failure.
var ErrInvalidTable = errors.New("invalid SMBIOS structure table")

func checksumOK(b []byte) bool {
	var sum byte
	for _, c := range b {
		sum += c
	}
	return sum == 0
}

// ParseEntryPoint decodes a 32-bit (_SM_), 64-bit (_SM3_) or legacy DMI-only
// (_DMI_) entry point, verifying its length and checksums.
func ParseEntryPoint(b []byte) (EntryPoint, error) {
	switch {
	case bytes.HasPrefix(b, anchor64):
		return parseEntryPoint64(b)
	case bytes.HasPrefix(b, anchor32):
		return parseEntryPoint32(b)
	case bytes.HasPrefix(b, anchorLegacy):
		return parseEntryPointLegacy(b)
	}
	n := min(len(b), 5)
	return EntryPoint{}, fmt.Errorf("%w: unknown anchor %q (want _SM_, _SM3_ or _DMI_)", ErrInvalidEntryPoint, b[:n])
}

func parseEntryPoint64(b []byte) (EntryPoint, error) {
	if len(b) < 7 {
		return EntryPoint{}, fmt.Errorf("%w: 64-bit entry point truncated to %d bytes", ErrInvalidEntryPoint, len(b))
	}
	l := int(b[6])
	if l < entryPoint64MinLen {
		return EntryPoint{}, fmt.Errorf("%w: 64-bit entry point declares length %d, below the minimum %d", ErrInvalidEntryPoint, l, entryPoint64MinLen)
	}
	if len(b) < l {
		return EntryPoint{}, fmt.Errorf("%w: 64-bit entry point declares length %d but only %d bytes are present", ErrInvalidEntryPoint, l, len(b))
	}
	if !checksumOK(b[:l]) {
		return EntryPoint{}, fmt.Errorf("%w: 64-bit entry point checksum mismatch", ErrInvalidEntryPoint)
	}
	return EntryPoint{
		Major:        b[7],
		Minor:        b[8],
		Revision:     b[9],
		Is64:         true,
		TableLength:  binary.LittleEndian.Uint32(b[0x0C:]),
		TableAddress: binary.LittleEndian.Uint64(b[0x10:]),
	}, nil
}

func parseEntryPoint32(b []byte) (EntryPoint, error) {
	if len(b) < 6 {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point truncated to %d bytes", ErrInvalidEntryPoint, len(b))
	}
	l := int(b[5])
	if l != entryPoint32Len && l != entryPoint32LenV21 {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point declares length %d, want %d", ErrInvalidEntryPoint, l, entryPoint32Len)
	}
	if len(b) < l {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point declares length %d but only %d bytes are present", ErrInvalidEntryPoint, l, len(b))
	}
	if !checksumOK(b[:l]) {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point checksum mismatch", ErrInvalidEntryPoint)
	}
	inter := b[0x10:]
	if !bytes.HasPrefix(inter, anchorLegacy) {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point lacks the _DMI_ intermediate anchor at offset 0x10", ErrInvalidEntryPoint)
	}
	if len(inter) < entryPointLegacyLen || !checksumOK(inter[:entryPointLegacyLen]) {
		return EntryPoint{}, fmt.Errorf("%w: 32-bit entry point intermediate checksum mismatch", ErrInvalidEntryPoint)
	}
	ep := EntryPoint{
		Major:         b[6],
		Minor:         b[7],
		TableLength:   uint32(binary.LittleEndian.Uint16(b[0x16:])),
		TableAddress:  uint64(binary.LittleEndian.Uint32(b[0x18:])),
		NumStructures: binary.LittleEndian.Uint16(b[0x1C:]),
	}
	// Some firmware writes the version digits as decimal minors: 2.31 or
	// 2.33 for 2.3, and 2.51 for 2.6. The kernel and dmidecode correct
	// these, and so must we, or a "2.51" table would be read with the
	// pre-2.6 UUID byte order and yield a different identity.
	if ep.Major == 2 {
		switch ep.Minor {
		case 31, 33:
			ep.Minor = 3
		case 51:
			ep.Minor = 6
		}
	}
	return ep, nil
}

// parseEntryPointLegacy handles firmware that provides only the DMI 2.0
// style entry point; the version is a BCD byte.
func parseEntryPointLegacy(b []byte) (EntryPoint, error) {
	if len(b) < entryPointLegacyLen {
		return EntryPoint{}, fmt.Errorf("%w: legacy DMI entry point truncated to %d bytes", ErrInvalidEntryPoint, len(b))
	}
	if !checksumOK(b[:entryPointLegacyLen]) {
		return EntryPoint{}, fmt.Errorf("%w: legacy DMI entry point checksum mismatch", ErrInvalidEntryPoint)
	}
	bcd := b[0x0E]
	return EntryPoint{
		Major:         bcd >> 4,
		Minor:         bcd & 0x0F,
		TableLength:   uint32(binary.LittleEndian.Uint16(b[0x06:])),
		TableAddress:  uint64(binary.LittleEndian.Uint32(b[0x08:])),
		NumStructures: binary.LittleEndian.Uint16(b[0x0C:]),
	}, nil
}

// Structure is one SMBIOS structure: its formatted area (header included,
// so offsets match the specification's tables) and its string set.
type Structure struct {
	Type      uint8
	Handle    uint16
	Formatted []byte
	Strings   []string
}

// String returns the string a formatted-area byte at offset refers to.
// Index 0 means "no string" and yields "". ok is false when the offset is
// beyond the formatted area or the index beyond the string set.
func (s Structure) String(offset int) (str string, ok bool) {
	if offset >= len(s.Formatted) {
		return "", false
	}
	idx := int(s.Formatted[offset])
	if idx == 0 {
		return "", true
	}
	if idx > len(s.Strings) {
		return "", false
	}
	return s.Strings[idx-1], true
}

// walk calls fn for each structure of table until fn returns false, the
// end-of-table structure (type 127) has been visited, limit structures have
// been visited (0 means no limit), or the table ends at a structure
// boundary. A structure cut short is an error naming its offset.
func walk(table []byte, limit int, fn func(Structure) bool) error {
	off, n := 0, 0
	for off < len(table) && (limit == 0 || n < limit) {
		rest := table[off:]
		if len(rest) < headerLen {
			return fmt.Errorf("%w: structure at offset %d: header truncated (%d of %d bytes)", ErrInvalidTable, off, len(rest), headerLen)
		}
		typ, l := rest[0], int(rest[1])
		if l < headerLen {
			return fmt.Errorf("%w: structure type %d at offset %d declares length %d, below the header size %d", ErrInvalidTable, typ, off, l, headerLen)
		}
		if len(rest) < l {
			return fmt.Errorf("%w: structure type %d at offset %d declares length %d but only %d bytes remain", ErrInvalidTable, typ, off, l, len(rest))
		}
		// The string set ends at the first double NUL after the formatted
		// area; a structure without strings is followed by two NULs.
		end := bytes.Index(rest[l:], []byte{0, 0})
		if end < 0 {
			return fmt.Errorf("%w: structure type %d at offset %d: string set not terminated by a double NUL before the table ends", ErrInvalidTable, typ, off)
		}
		s := Structure{
			Type:      typ,
			Handle:    binary.LittleEndian.Uint16(rest[2:]),
			Formatted: rest[:l:l],
		}
		if end > 0 {
			for _, str := range bytes.Split(rest[l:l+end], []byte{0}) {
				s.Strings = append(s.Strings, string(str))
			}
		}
		off += l + end + 2
		n++
		if !fn(s) || typ == typeEndOfTable {
			return nil
		}
	}
	return nil
}

// ParseStructures walks a whole structure table and returns its structures
// up to and including the end-of-table structure.
func ParseStructures(table []byte) ([]Structure, error) {
	var out []Structure
	err := walk(table, 0, func(s Structure) bool {
		out = append(out, s)
		return true
	})
	return out, err
}

// ParseTable decodes the system information (type 1) structure from the
// entry point and structure table as the kernel exports them in
// /sys/firmware/dmi/tables. The returned Info has Source "dmi-table".
func ParseTable(entryPoint, table []byte) (Info, error) {
	ep, err := ParseEntryPoint(entryPoint)
	if err != nil {
		return Info{}, err
	}
	tab := table
	if ep.Is64 {
		// A 3.x entry point gives only a maximum size; the kernel may
		// export less, ending after the end-of-table structure.
		if uint64(len(tab)) > uint64(ep.TableLength) {
			tab = tab[:ep.TableLength]
		}
	} else {
		if uint64(len(tab)) < uint64(ep.TableLength) {
			return Info{}, fmt.Errorf("%w: the entry point declares %d bytes but the table has %d (truncated)", ErrInvalidTable, ep.TableLength, len(tab))
		}
		tab = tab[:ep.TableLength]
	}
	var (
		sys   Structure
		found bool
	)
	err = walk(tab, int(ep.NumStructures), func(s Structure) bool {
		if s.Type == 1 {
			sys, found = s, true
			return false
		}
		return true
	})
	if err != nil {
		return Info{}, err
	}
	if !found {
		return Info{}, fmt.Errorf("%w: no system information (type 1) structure", ErrInvalidTable)
	}
	return decodeSystemInfo(sys, ep)
}

// decodeSystemInfo reads the type 1 structure. Descriptive strings with a
// bad index come back empty rather than failing: they are informational,
// and firmware with such bugs exists. The UUID is never guessed at.
func decodeSystemInfo(s Structure, ep EntryPoint) (Info, error) {
	info := Info{SMBIOSVersion: ep.Version(), Source: SourceDMITable}
	info.Manufacturer, _ = s.String(0x04)
	info.ProductName, _ = s.String(0x05)
	info.Serial, _ = s.String(0x07)
	if len(s.Formatted) < 0x18 {
		return Info{}, fmt.Errorf("%w: system information structure (handle 0x%04X) is %d bytes long and carries no UUID (SMBIOS %s; a UUID needs 2.1 or later)", ErrInvalidTable, s.Handle, len(s.Formatted), ep.Version())
	}
	var raw [16]byte
	copy(raw[:], s.Formatted[0x08:0x18])
	u, err := FormatUUID(raw, ep.atLeast(2, 6))
	if err != nil {
		return Info{}, err
	}
	info.UUID = u
	return info, nil
}
