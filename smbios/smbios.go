package smbios

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Where Info.UUID came from.
const (
	SourceSysfs    = "sysfs"
	SourceDMITable = "dmi-table"
)

// DefaultSysfsRoot is where sysfs is mounted on a normal host.
const DefaultSysfsRoot = "/sys"

// Paths below the sysfs root.
const (
	pathUUID         = "class/dmi/id/product_uuid"
	pathVendor       = "class/dmi/id/sys_vendor"
	pathProduct      = "class/dmi/id/product_name"
	pathSerial       = "class/dmi/id/product_serial"
	pathEntryPoint   = "firmware/dmi/tables/smbios_entry_point"
	pathDMITable     = "firmware/dmi/tables/DMI"
	maxAttributeSize = 4096
)

// Info is the node's SMBIOS identity.
type Info struct {
	UUID, Manufacturer, ProductName, Serial string
	SMBIOSVersion                           string // e.g. "3.2", empty when read from sysfs attributes only
	Source                                  string // "sysfs" or "dmi-table": where the UUID came from
}

// ErrUUIDNotPresent is wrapped when the firmware reports the UUID as not
// present (all 0xFF) or not set (all 0x00). Such a host has no usable
// identity: fencing keys derived from it would collide across hosts.
var ErrUUIDNotPresent = errors.New("SMBIOS system UUID is not set")

// ErrInvalidUUID is wrapped when a UUID read from sysfs is not in the
// canonical 8-4-4-4-12 hexadecimal form.
var ErrInvalidUUID = errors.New("malformed SMBIOS system UUID")

// Read returns the node's identity. The UUID comes from
// <sysfsRoot>/class/dmi/id/product_uuid; when that file is absent or
// unreadable, from the raw table under <sysfsRoot>/firmware/dmi/tables.
// A UUID that is present but malformed or "not set" is an error, not a
// reason to look elsewhere: it means the firmware gives this host no
// identity.
func Read(sysfsRoot string) (Info, error) {
	if sysfsRoot == "" {
		sysfsRoot = DefaultSysfsRoot
	}
	uuidPath := filepath.Join(sysfsRoot, pathUUID)
	text, sysErr := os.ReadFile(uuidPath)
	if sysErr == nil {
		return readSysfs(sysfsRoot, uuidPath, text)
	}
	info, tabErr := ReadTable(sysfsRoot)
	if tabErr != nil {
		return Info{}, fmt.Errorf("smbios: no system UUID: %s: %s; and the raw table: %w", uuidPath, describe(sysErr), tabErr)
	}
	return info, nil
}

func readSysfs(root, uuidPath string, text []byte) (Info, error) {
	u, err := ParseUUID(strings.TrimSpace(string(text)))
	if err != nil {
		return Info{}, fmt.Errorf("smbios: %s: %w", uuidPath, err)
	}
	info := Info{
		UUID:         u,
		Manufacturer: readAttribute(filepath.Join(root, pathVendor)),
		ProductName:  readAttribute(filepath.Join(root, pathProduct)),
		Serial:       readAttribute(filepath.Join(root, pathSerial)),
		Source:       SourceSysfs,
	}
	// The version is informational; a missing or odd entry point must not
	// fail a host whose decoded attributes are fine.
	if b, err := os.ReadFile(filepath.Join(root, pathEntryPoint)); err == nil {
		if ep, err := ParseEntryPoint(b); err == nil {
			info.SMBIOSVersion = ep.Version()
		}
	}
	return info, nil
}

// readAttribute returns a descriptive sysfs attribute, or "" when it is
// absent, unreadable or not printable text: these fields describe the host
// to an operator and never decide anything.
func readAttribute(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) > maxAttributeSize {
		return ""
	}
	s := strings.TrimSpace(string(b))
	for _, r := range s {
		if r < 0x20 || r == 0x7F || r == '\uFFFD' {
			return ""
		}
	}
	return s
}

// ReadTable parses the raw SMBIOS entry point and table that the kernel
// exports under <sysfsRoot>/firmware/dmi/tables.
func ReadTable(sysfsRoot string) (Info, error) {
	epPath := filepath.Join(sysfsRoot, pathEntryPoint)
	tabPath := filepath.Join(sysfsRoot, pathDMITable)
	ep, err := os.ReadFile(epPath)
	if err != nil {
		return Info{}, fmt.Errorf("%s: %s", epPath, describe(err))
	}
	tab, err := os.ReadFile(tabPath)
	if err != nil {
		return Info{}, fmt.Errorf("%s: %s", tabPath, describe(err))
	}
	info, err := ParseTable(ep, tab)
	if err != nil {
		if errors.Is(err, ErrInvalidEntryPoint) {
			return Info{}, fmt.Errorf("%s: %w; the firmware's SMBIOS entry point is damaged", epPath, err)
		}
		return Info{}, fmt.Errorf("%s: %w; the firmware's SMBIOS table is damaged or does not describe the system", tabPath, err)
	}
	return info, nil
}

// describe turns a read error into a sentence that says what to check.
func describe(err error) string {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "missing (check that sysfs is mounted there and the kernel exposes DMI: CONFIG_DMI_SYSFS; a host without SMBIOS has no identity)"
	case errors.Is(err, fs.ErrPermission):
		return "permission denied (the DMI tables are readable by root only; run the agent as root)"
	default:
		return fmt.Sprintf("unreadable (%v)", err)
	}
}

// FormatUUID renders a raw 16-byte SMBIOS UUID in lower-case canonical
// form. From SMBIOS 2.6 on, the first three fields are stored
// little-endian (the "wire format" of RFC 4122 is only used for the last
// two); earlier tables store all fields big-endian.
func FormatUUID(raw [16]byte, littleEndianFields bool) (string, error) {
	if allBytes(raw[:], 0x00) {
		return "", fmt.Errorf("%w: all bytes 0x00 (the firmware says present but not set)", ErrUUIDNotPresent)
	}
	if allBytes(raw[:], 0xFF) {
		return "", fmt.Errorf("%w: all bytes 0xFF (the firmware says not present)", ErrUUIDNotPresent)
	}
	b := raw
	if littleEndianFields {
		b[0], b[1], b[2], b[3] = raw[3], raw[2], raw[1], raw[0]
		b[4], b[5] = raw[5], raw[4]
		b[6], b[7] = raw[7], raw[6]
	}
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32], nil
}

// ParseUUID validates a UUID in text form (as sysfs prints it) and returns
// it in lower-case canonical form.
func ParseUUID(s string) (string, error) {
	if len(s) != 36 {
		shown := s
		if len(shown) > 64 {
			shown = shown[:64] + "..."
		}
		return "", fmt.Errorf("%w: %q is %d characters, want 36 (8-4-4-4-12 hexadecimal)", ErrInvalidUUID, shown, len(s))
	}
	var raw [16]byte
	j := 0
	for i := 0; i < 36; i++ {
		switch i {
		case 8, 13, 18, 23:
			if s[i] != '-' {
				return "", fmt.Errorf("%w: %q: want '-' at position %d", ErrInvalidUUID, s, i+1)
			}
			continue
		}
		if _, err := hex.Decode(raw[j/2:j/2+1], []byte{s[i], s[i+1]}); err != nil {
			return "", fmt.Errorf("%w: %q: not hexadecimal at position %d", ErrInvalidUUID, s, i+1)
		}
		i++
		j += 2
	}
	return FormatUUID(raw, false)
}

func allBytes(b []byte, v byte) bool {
	for _, c := range b {
		if c != v {
			return false
		}
	}
	return true
}
