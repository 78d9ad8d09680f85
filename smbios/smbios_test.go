package smbios

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// sysfsTree writes files below a temporary sysfs root. A nil value makes a
// directory at that path, which no one (root included) can read as a file:
// the tests run as root, so file modes cannot make anything unreadable.
func sysfsTree(t *testing.T, files map[string][]byte) string {
	t.Helper()
	root := t.TempDir()
	for rel, data := range files {
		p := filepath.Join(root, rel)
		if data == nil {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o444); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestReadSysfs(t *testing.T) {
	ep, tab := table3(3, 2, testUUIDRaw)
	root := sysfsTree(t, map[string][]byte{
		pathUUID:       []byte("4C4C4544-0042-3510-8056-B4C04F564433\n"),
		pathVendor:     []byte("Dell Inc.\n"),
		pathProduct:    []byte("PowerEdge R650\n"),
		pathSerial:     []byte("  ABC1234 \n"),
		pathEntryPoint: ep,
		pathDMITable:   tab,
	})
	info, err := Read(root)
	if err != nil {
		t.Fatal(err)
	}
	want := Info{
		UUID:          "4c4c4544-0042-3510-8056-b4c04f564433",
		Manufacturer:  "Dell Inc.",
		ProductName:   "PowerEdge R650",
		Serial:        "ABC1234",
		SMBIOSVersion: "3.2",
		Source:        SourceSysfs,
	}
	if info != want {
		t.Fatalf("got %+v\nwant %+v", info, want)
	}
}

// Only product_uuid is required on the sysfs path; the descriptive
// attributes and the version are best effort.
func TestReadSysfsAttributesOnly(t *testing.T) {
	root := sysfsTree(t, map[string][]byte{
		pathUUID:    []byte("4c4c4544-0042-3510-8056-b4c04f564433\n"),
		pathVendor:  []byte("QEMU\n"),
		pathProduct: []byte("bad\x01text\n"),
		pathSerial:  nil, // unreadable
	})
	info, err := Read(root)
	if err != nil {
		t.Fatal(err)
	}
	if info.Source != SourceSysfs || info.SMBIOSVersion != "" || info.Manufacturer != "QEMU" || info.ProductName != "" || info.Serial != "" {
		t.Fatalf("got %+v", info)
	}
}

func TestReadFallsBackToTable(t *testing.T) {
	ep, tab := table2(2, 4, testUUIDRaw)
	for name, uuidFile := range map[string]map[string][]byte{
		"product_uuid missing":    {},
		"product_uuid unreadable": {pathUUID: nil},
	} {
		t.Run(name, func(t *testing.T) {
			files := map[string][]byte{pathEntryPoint: ep, pathDMITable: tab, pathVendor: []byte("ignored\n")}
			for k, v := range uuidFile {
				files[k] = v
			}
			info, err := Read(sysfsTree(t, files))
			if err != nil {
				t.Fatal(err)
			}
			want := Info{
				UUID:          testUUIDBE,
				Manufacturer:  "whitesky.cloud",
				ProductName:   "VCO Virtual Machine",
				Serial:        "SN-0042",
				SMBIOSVersion: "2.4",
				Source:        SourceDMITable,
			}
			if info != want {
				t.Fatalf("got %+v\nwant %+v", info, want)
			}
		})
	}
}

func TestReadErrors(t *testing.T) {
	ep, tab := table3(3, 2, testUUIDRaw)
	badEP := clone(ep)
	badEP[0x07]++
	cases := []struct {
		name  string
		files map[string][]byte
		is    error
		want  []string
	}{
		{
			name:  "no sysfs at all",
			files: map[string][]byte{},
			want:  []string{pathUUID + ": missing", pathEntryPoint + ": missing", "CONFIG_DMI_SYSFS"},
		},
		{
			name:  "DMI table missing",
			files: map[string][]byte{pathEntryPoint: ep},
			want:  []string{pathDMITable + ": missing"},
		},
		{
			name:  "DMI table unreadable",
			files: map[string][]byte{pathEntryPoint: ep, pathDMITable: nil},
			want:  []string{pathDMITable + ": unreadable", "is a directory"},
		},
		{
			name:  "entry point checksum",
			files: map[string][]byte{pathEntryPoint: badEP, pathDMITable: tab},
			is:    ErrInvalidEntryPoint,
			want:  []string{pathEntryPoint + ": invalid SMBIOS entry point: 64-bit entry point checksum mismatch", "entry point is damaged"},
		},
		{
			name:  "truncated table",
			files: map[string][]byte{pathEntryPoint: ep, pathDMITable: tab[:50]},
			is:    ErrInvalidTable,
			want:  []string{pathDMITable + ": invalid SMBIOS structure table", "table is damaged"},
		},
		{
			name:  "table UUID not present",
			files: map[string][]byte{pathEntryPoint: ep, pathDMITable: concat(systemInfo([16]byte{}), endOfTable())},
			is:    ErrUUIDNotPresent,
			want:  []string{pathDMITable, "all bytes 0x00"},
		},
		{
			name:  "sysfs UUID malformed",
			files: map[string][]byte{pathUUID: []byte("not-a-uuid\n"), pathEntryPoint: ep, pathDMITable: tab},
			is:    ErrInvalidUUID,
			want:  []string{pathUUID + `: malformed SMBIOS system UUID: "not-a-uuid"`},
		},
		{
			name:  "sysfs UUID not present",
			files: map[string][]byte{pathUUID: []byte("ffffffff-ffff-ffff-ffff-ffffffffffff\n"), pathEntryPoint: ep, pathDMITable: tab},
			is:    ErrUUIDNotPresent,
			want:  []string{pathUUID, "all bytes 0xFF"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			info, err := Read(sysfsTree(t, c.files))
			if err == nil {
				t.Fatalf("want an error, got %+v", info)
			}
			if c.is != nil && !errors.Is(err, c.is) {
				t.Fatalf("error %q does not wrap %v", err, c.is)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}
