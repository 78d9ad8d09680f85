package volume

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// Claim records as the released agent wrote them (json.MarshalIndent, two
// spaces): a virtio-blk disk on the lease, a SCSI disk under reservations
// and a loop device of the simulator's host backend.
var releasedRecords = []struct {
	volume, record string
	want           Locator
}{
	{"loc-1/4242", `{
  "volume": "loc-1/4242",
  "locator": {
    "disk": "pci=0000:00:07,serial=4242"
  },
  "device": "/dev/vdb",
  "devnum": "252:16",
  "serial": "4242",
  "staging_path": "/var/lib/kubelet/plugins/kubernetes.io/csi/vco.whitesky.cloud/0f3c/globalmount",
  "fs_type": "ext4",
  "data_offset": 1048576,
  "data_device": "/dev/mapper/vco-data-4242",
  "fence_method": "disk-lease",
  "key": "0x7663a1b2c3d4e5f6",
  "phase": "staged",
  "state": "held",
  "formatted": true,
  "fence_formatted": true,
  "publications": [
    "/var/lib/kubelet/pods/p/volumes/v/mount"
  ],
  "updated": "2026-11-30T12:00:00Z"
}`, Locator{Disk: discovery.Locator{PCI: &discovery.PCIAddress{Slot: 7, AnyFunction: true}, Serial: "4242"}}},
	{"loc-1/7", `{
  "volume": "loc-1/7",
  "locator": {
    "disk": "pci=0000:00:05.0,wwn=naa.6001405fa83b1c2d0011223344556677"
  },
  "device": "/dev/sdb",
  "devnum": "8:16",
  "staging_path": "/var/lib/kubelet/s",
  "block": true,
  "fence_method": "scsi-pr",
  "key": "0x7663000000000001",
  "phase": "staged",
  "state": "held",
  "updated": "2026-11-30T12:00:00Z"
}`, Locator{Disk: discovery.Locator{PCI: &discovery.PCIAddress{Slot: 5}, WWN: "naa.6001405fa83b1c2d0011223344556677"}}},
	{"sim/3", `{
  "volume": "sim/3",
  "locator": {
    "loop_backing_file": "/var/lib/vco-sim/disks/3.img"
  },
  "device": "/dev/loop3",
  "devnum": "7:3",
  "staging_path": "/var/lib/kubelet/s3",
  "fs_type": "xfs",
  "fence_method": "none",
  "phase": "staged",
  "state": "unfenced",
  "updated": "2026-11-30T12:00:00Z"
}`, Locator{BackingFile: "/var/lib/vco-sim/disks/3.img"}},
}

// TestReleasedClaimRecordsLoad reads records the released agent wrote:
// each loads with its locator parsed, and is written back byte for byte
// as it was, so an agent upgraded and then downgraded reads its records.
func TestReleasedClaimRecordsLoad(t *testing.T) {
	s, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range releasedRecords {
		if err := os.WriteFile(s.file(r.volume), []byte(r.record+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := s.Get(r.volume)
		if err != nil || c == nil {
			t.Fatalf("%s: %v", r.volume, err)
		}
		if !c.Locator.Equal(r.want) {
			t.Errorf("%s: locator %+v (%s), want %+v (%s)", r.volume, c.Locator, c.Locator, r.want, r.want)
		}
		b, err := json.MarshalIndent(c, "", "  ")
		if err != nil {
			t.Fatalf("%s: %v", r.volume, err)
		}
		if string(b) != r.record {
			t.Errorf("%s: written back as\n%s\nnot as the released agent wrote it:\n%s", r.volume, b, r.record)
		}
	}
	if claims, errs := s.List(); len(claims) != len(releasedRecords) || len(errs) != 0 {
		t.Fatalf("list: %d claims, errors %v; want %d claims", len(claims), errs, len(releasedRecords))
	}
}

// TestClaimRecordWithABadLocatorIsDamaged: a locator that does not parse
// makes the record damaged, as a record that is not JSON is: Get says so
// and List reports it; it is never read as a claim without a device.
func TestClaimRecordWithABadLocatorIsDamaged(t *testing.T) {
	for _, disk := range []string{`"pci=zz,serial=1"`, `"serial="`, `"colour=red"`, `""`, `7`} {
		s, err := OpenStore(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		record := strings.Replace(releasedRecords[0].record, `"pci=0000:00:07,serial=4242"`, disk, 1)
		if err := os.WriteFile(s.file("loc-1/4242"), []byte(record), 0o600); err != nil {
			t.Fatal(err)
		}
		if c, err := s.Get("loc-1/4242"); err == nil || !strings.Contains(err.Error(), "is damaged") {
			t.Errorf("disk %s: Get = %+v, %v; want a damaged record", disk, c, err)
		}
		claims, errs := s.List()
		if len(claims) != 0 || len(errs) != 1 || !strings.Contains(errs[0].Error(), filepath.Base(s.file("loc-1/4242"))) {
			t.Errorf("disk %s: List = %d claims, errors %v; want the record reported damaged", disk, len(claims), errs)
		}
	}
}

// TestClaimLocatorRoundTrip: a locator a stage records reads back equal.
func TestClaimLocatorRoundTrip(t *testing.T) {
	s, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []Locator{
		{Disk: discovery.Locator{Serial: "abc"}},
		{Disk: discovery.Locator{PCI: &discovery.PCIAddress{Domain: 1, Bus: 0x1a, Slot: 0x1f, Function: 7}, Serial: "s", WWN: "naa.6001"}},
		{BackingFile: "/srv/disk-1.img"},
		{Disk: discovery.Locator{Serial: "x"}, BackingFile: "/srv/disk-2.img"},
	} {
		if err := s.Put(&Claim{Volume: "v", Locator: l}); err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		c, err := s.Get("v")
		if err != nil || !c.Locator.Equal(l) {
			t.Errorf("%s: read back %+v, %v", l, c, err)
		}
	}
	// A locator whose text would not read back is never written.
	if err := s.Put(&Claim{Volume: "w", Locator: Locator{Disk: discovery.Locator{Serial: "a,b"}}}); err == nil {
		t.Error("a locator with a comma in its serial was written")
	}
}

// TestAnUnreadableClaimRecordIsListed: a claim record that cannot be read
// is listed among the disks as unreadable, under the volume its file name
// gives, with why: the start-up check leaves its disk alone, and the
// listing is where an operator looks.
func TestAnUnreadableClaimRecordIsListed(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if err := os.WriteFile(e.m.Store().file("loc-1/77"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A file the store did not name, whose name decodes to bytes that
	// are not text: listed under its file name.
	if err := os.WriteFile(filepath.Join(filepath.Dir(e.m.Store().file("x")), "backup.json"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	disks, err := e.m.Disks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []DiskInfo
	for _, d := range disks {
		if d.State == "unreadable" {
			got = append(got, d)
		}
	}
	sort.Slice(got, func(i, j int) bool { return got[i].Volume < got[j].Volume })
	if len(got) != 2 || got[0].Volume != "backup.json" || got[1].Volume != "loc-1/77" || got[0].Device != "" ||
		!strings.Contains(got[0].Detail, "is damaged") || !strings.Contains(got[1].Detail, "is damaged") {
		t.Fatalf("the unreadable records are listed as %+v (all: %+v)", got, disks)
	}
}
