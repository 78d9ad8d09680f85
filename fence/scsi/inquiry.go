package scsi

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
)

// VPD page codes.
const (
	VPDUnitSerialNumber = 0x80
	VPDDeviceID         = 0x83
)

// Inquiry is standard INQUIRY data (SPC-4 "Standard INQUIRY data format"):
// byte 0 PERIPHERAL QUALIFIER (bits 7-5) and PERIPHERAL DEVICE TYPE (bits
// 4-0), byte 2 VERSION, 8-15 T10 VENDOR IDENTIFICATION, 16-31 PRODUCT
// IDENTIFICATION, 32-35 PRODUCT REVISION LEVEL.
type Inquiry struct {
	Qualifier  uint8
	DeviceType uint8
	Version    uint8
	Vendor     string
	Product    string
	Revision   string
}

// ParseInquiry parses standard INQUIRY data. Targets may return fewer than
// 36 bytes; missing text fields are left empty.
func ParseInquiry(b []byte) (Inquiry, error) {
	if len(b) < 5 {
		return Inquiry{}, fmt.Errorf("scsi: INQUIRY data is %d bytes, want at least 5", len(b))
	}
	if n := 5 + int(b[4]); n < len(b) {
		b = b[:n]
	}
	q := Inquiry{Qualifier: b[0] >> 5, DeviceType: b[0] & 0x1f, Version: b[2]}
	q.Vendor = asciiField(b, 8, 16)
	q.Product = asciiField(b, 16, 32)
	q.Revision = asciiField(b, 32, 36)
	return q, nil
}

func asciiField(b []byte, from, to int) string {
	if len(b) <= from {
		return ""
	}
	return cleanASCII(b[from:min(to, len(b))])
}

// cleanASCII trims the space/NUL padding SCSI text fields carry and replaces
// bytes outside printable ASCII, so a misbehaving target cannot inject
// control characters into logs and errors.
func cleanASCII(b []byte) string {
	var s strings.Builder
	for _, c := range b {
		if c >= 0x20 && c < 0x7f {
			s.WriteByte(c)
		} else if c == 0 {
			s.WriteByte(' ')
		} else {
			s.WriteByte('?')
		}
	}
	return strings.TrimSpace(s.String())
}

func vpdHeader(b []byte, page uint8) ([]byte, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("scsi: VPD page 0x%02x is %d bytes, want at least 4", page, len(b))
	}
	if b[1] != page {
		return nil, fmt.Errorf("scsi: asked for VPD page 0x%02x, got page 0x%02x", page, b[1])
	}
	n := int(binary.BigEndian.Uint16(b[2:4]))
	body := b[4:]
	if n < len(body) {
		body = body[:n]
	}
	return body, nil
}

// ParseUnitSerial parses the Unit Serial Number VPD page (SPC-4 "Unit Serial
// Number VPD page": byte 1 PAGE CODE 80h, bytes 2-3 PAGE LENGTH (n-3), 4-n
// PRODUCT SERIAL NUMBER, ASCII, right-aligned and space-padded).
func ParseUnitSerial(b []byte) (string, error) {
	body, err := vpdHeader(b, VPDUnitSerialNumber)
	if err != nil {
		return "", err
	}
	return cleanASCII(body), nil
}

// Designator is one designation descriptor of the Device Identification VPD
// page (SPC-4 "Designation descriptor"): byte 0 PROTOCOL IDENTIFIER (bits
// 7-4) and CODE SET (bits 3-0); byte 1 PIV (bit 7), ASSOCIATION (bits 5-4),
// DESIGNATOR TYPE (bits 3-0); byte 3 DESIGNATOR LENGTH (n-3); 4-n DESIGNATOR.
type Designator struct {
	Protocol    uint8
	CodeSet     uint8 // 1 binary, 2 ASCII, 3 UTF-8
	PIV         bool
	Association uint8 // 0 logical unit, 1 target port, 2 target device
	Type        uint8 // 1 T10 vendor ID, 2 EUI-64, 3 NAA, 8 SCSI name string, ...
	Value       []byte
}

// Designator types (SPC-4 "DESIGNATOR TYPE field").
const (
	DesigVendor      = 0x0
	DesigT10Vendor   = 0x1
	DesigEUI64       = 0x2
	DesigNAA         = 0x3
	DesigSCSIName    = 0x8
	AssocLogicalUnit = 0x0
)

// ID formats the designator the way the Linux kernel writes the sysfs
// "wwid" attribute (drivers/scsi/scsi_lib.c, scsi_vpd_lun_id), so a WWN from
// VPD 0x83 compares equal to what sysfs shows: "naa.<hex>", "eui.<hex>",
// "t10.<ascii>", or the SCSI name string as is. Other types give "".
func (d Designator) ID() string {
	switch d.Type {
	case DesigNAA:
		return "naa." + hex.EncodeToString(d.Value)
	case DesigEUI64:
		return "eui." + hex.EncodeToString(d.Value)
	case DesigT10Vendor:
		return "t10." + cleanASCII(d.Value)
	case DesigSCSIName:
		return cleanASCII(d.Value)
	}
	return ""
}

// ParseDeviceID parses the Device Identification VPD page (SPC-4 "Device
// Identification VPD page": byte 1 PAGE CODE 83h, bytes 2-3 PAGE LENGTH,
// then designation descriptors).
func ParseDeviceID(b []byte) ([]Designator, error) {
	body, err := vpdHeader(b, VPDDeviceID)
	if err != nil {
		return nil, err
	}
	var ds []Designator
	for p := 0; p < len(body); {
		if p+4 > len(body) {
			return ds, fmt.Errorf("scsi: VPD 0x83 descriptor header at offset %d truncated", p+4)
		}
		l := int(body[p+3])
		if p+4+l > len(body) {
			return ds, fmt.Errorf("scsi: VPD 0x83 descriptor at offset %d claims %d bytes, %d remain", p+4, l, len(body)-p-4)
		}
		ds = append(ds, Designator{
			Protocol:    body[p] >> 4,
			CodeSet:     body[p] & 0x0f,
			PIV:         body[p+1]&0x80 != 0,
			Association: (body[p+1] >> 4) & 0x3,
			Type:        body[p+1] & 0x0f,
			Value:       append([]byte(nil), body[p+4:p+4+l]...),
		})
		p += 4 + l
	}
	return ds, nil
}

// LUNames returns the logical unit's designators (association 0) formatted
// by ID, best first: NAA, EUI-64, SCSI name string, T10 vendor ID. This is
// the order the kernel uses to pick the sysfs wwid.
func LUNames(ds []Designator) []string {
	var out []string
	for _, want := range []uint8{DesigNAA, DesigEUI64, DesigSCSIName, DesigT10Vendor} {
		for _, d := range ds {
			if d.Association == AssocLogicalUnit && d.Type == want {
				if id := d.ID(); id != "" {
					out = append(out, id)
				}
			}
		}
	}
	return out
}
