package discovery

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// sysfs is a fixture tree laid out as the kernel lays out /sys for
// virtio-blk and virtio-scsi disks.
type sysfs struct {
	t    *testing.T
	root string
}

func newSysfs(t *testing.T) *sysfs {
	root := t.TempDir()
	for _, d := range []string{"block", "dev/block", "devices"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return &sysfs{t: t, root: root}
}

func (s *sysfs) write(p, content string) {
	s.t.Helper()
	p = filepath.Join(s.root, p)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		s.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		s.t.Fatal(err)
	}
}

func (s *sysfs) link(target, p string) {
	s.t.Helper()
	p = filepath.Join(s.root, p)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		s.t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		s.t.Fatal(err)
	}
}

// block adds a disk whose device directory is devPath (relative to
// /sys/devices) and whose block directory is devPath/block/name.
func (s *sysfs) block(name, devPath, devnum, devname string) string {
	bdir := filepath.Join("devices", devPath, "block", name)
	s.write(filepath.Join(bdir, "dev"), devnum+"\n")
	s.write(filepath.Join(bdir, "uevent"), fmt.Sprintf("MAJOR=%s\nDEVNAME=%s\nDEVTYPE=disk\n", strings.Split(devnum, ":")[0], devname))
	s.link("../"+bdir, filepath.Join("block", name))
	s.link("../../"+bdir, filepath.Join("dev/block", devnum))
	s.link("../../../"+filepath.Base(devPath), filepath.Join(bdir, "device"))
	return bdir
}

func (s *sysfs) virtioBlk(name, pciFunc, virtio, devnum, serial string) {
	bdir := s.block(name, filepath.Join("pci0000:00", pciFunc, virtio), devnum, name)
	s.write(filepath.Join(bdir, "serial"), serial+"\n")
}

func vpd80(serial string) string {
	return string(append([]byte{0, 0x80, 0, byte(len(serial))}, serial...))
}

func vpd83naa(naa []byte) string {
	body := append([]byte{0x01, 0x03, 0, byte(len(naa))}, naa...)
	return string(append([]byte{0, 0x83, 0, byte(len(body))}, body...))
}

func (s *sysfs) scsiDisk(name, pciFunc, hctl, devnum, devname, serial, wwid string, naa []byte) string {
	h := strings.Split(hctl, ":")
	devPath := filepath.Join("pci0000:00", pciFunc, "virtio3", "host"+h[0], "target"+h[0]+":"+h[1]+":"+h[2], hctl)
	bdir := s.block(name, devPath, devnum, devname)
	ddir := filepath.Join("devices", devPath)
	s.write(filepath.Join(ddir, "scsi_level"), "7\n")
	if serial != "" {
		s.write(filepath.Join(ddir, "vpd_pg80"), vpd80(serial))
	}
	if wwid != "" {
		s.write(filepath.Join(ddir, "wwid"), wwid+"\n")
	}
	if naa != nil {
		s.write(filepath.Join(ddir, "vpd_pg83"), vpd83naa(naa))
	}
	return bdir
}

var naa1 = []byte{0x60, 0x01, 0x40, 0x5f, 0xa8, 0x3b, 0x1c, 0x2d, 0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77}

func TestParsePCIAddressAndLocator(t *testing.T) {
	for in, want := range map[string]string{
		"0000:00:07.0": "0000:00:07.0", "00:07.1": "0000:00:07.1", "00:07": "0000:00:07", "0001:1a:1f.7": "0001:1a:1f.7",
	} {
		a, err := ParsePCIAddress(in)
		if err != nil || a.String() != want {
			t.Errorf("ParsePCIAddress(%q) = %s, %v", in, a, err)
		}
	}
	for _, bad := range []string{"", "7", "00:20.0", "00:07.8", "x:07.0", "0000:00:07.0.1"} {
		if _, err := ParsePCIAddress(bad); err == nil {
			t.Errorf("ParsePCIAddress(%q) accepted", bad)
		}
	}
	a, _ := PCIFromAPI(0, 7)
	b, _ := ParsePCIAddress("0000:00:07.0")
	c, _ := ParsePCIAddress("0000:00:07.1")
	if !a.Matches(b) || !a.Matches(c) || b.Matches(c) {
		t.Fatal("PCI matching")
	}
	if _, err := PCIFromAPI(1, 32); err == nil {
		t.Fatal("slot 32 accepted")
	}
	l, err := ParseLocator("pci=00:07,serial=abc,wwn=naa.6001")
	if err != nil || l.String() != "pci=0000:00:07,serial=abc,wwn=naa.6001" {
		t.Fatalf("locator %s, %v", l, err)
	}
	for _, bad := range []string{"", "serial", "serial=", "color=red", "pci=zz"} {
		if _, err := ParseLocator(bad); err == nil {
			t.Errorf("ParseLocator(%q) accepted", bad)
		}
	}
}

func TestLocatorText(t *testing.T) {
	l := Locator{PCI: &PCIAddress{Slot: 7, AnyFunction: true}, Serial: "abc", WWN: "naa.6001"}
	b, err := l.MarshalText()
	if err != nil || string(b) != "pci=0000:00:07,serial=abc,wwn=naa.6001" {
		t.Fatalf("MarshalText = %q, %v", b, err)
	}
	var back Locator
	if err := back.UnmarshalText(b); err != nil || !back.Equal(l) {
		t.Fatalf("UnmarshalText(%q) = %+v, %v", b, back, err)
	}
	if err := back.UnmarshalText([]byte("pci=zz")); err == nil {
		t.Fatal("UnmarshalText accepted a bad PCI address")
	}
	for _, bad := range []Locator{{}, {Serial: "a,b"}, {WWN: "x=y"}, {Serial: "a\nb"}, {Serial: " a"}} {
		if _, err := bad.MarshalText(); err == nil {
			t.Errorf("MarshalText(%+v) accepted a locator that would not read back", bad)
		}
	}
	// Equal compares the addresses, not where they are kept.
	other := Locator{PCI: &PCIAddress{Slot: 7, AnyFunction: true}, Serial: "abc", WWN: "naa.6001"}
	for _, c := range []struct {
		a, b Locator
		want bool
	}{
		{l, other, true},
		{Locator{}, Locator{}, true},
		{l, Locator{PCI: &PCIAddress{Slot: 7}, Serial: "abc", WWN: "naa.6001"}, false},
		{l, Locator{Serial: "abc", WWN: "naa.6001"}, false},
		{Locator{Serial: "a"}, Locator{Serial: "b"}, false},
		{Locator{WWN: "a"}, Locator{WWN: "b"}, false},
	} {
		if c.a.Equal(c.b) != c.want || c.b.Equal(c.a) != c.want {
			t.Errorf("%+v equal to %+v: want %v", c.a, c.b, c.want)
		}
	}
}

func TestListAndFind(t *testing.T) {
	s := newSysfs(t)
	s.virtioBlk("vda", "0000:00:04.0", "virtio1", "254:0", "root-disk")
	s.virtioBlk("vdb", "0000:00:05.0", "virtio2", "254:16", "3f2a6c1e-disk-000000")
	s.scsiDisk("sda", "0000:00:07.0", "2:0:0:1", "8:0", "sda", "beaf11", "naa.6001405fa83b1c2d0011223344556677", naa1)
	s.scsiDisk("sdb", "0000:00:07.0", "2:0:0:2", "8:16", "sdb", "beaf12", "", nil)
	// A loop device has no "device" link and is not a candidate.
	s.write("devices/virtual/block/loop0/dev", "7:0\n")
	s.link("../devices/virtual/block/loop0", "block/loop0")

	f := Finder{SysfsRoot: s.root, DevRoot: "/dev"}
	all, err := f.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 {
		t.Fatalf("listed %d disks: %+v", len(all), all)
	}
	find := func(loc string) (Disk, error) {
		l, err := ParseLocator(loc)
		if err != nil {
			t.Fatal(err)
		}
		return f.Find(l)
	}
	d, err := find("pci=00:05")
	if err != nil || d.Name != "vdb" || d.Kind != KindVirtioBlk || d.DevPath != "/dev/vdb" || d.Major != 254 || d.Minor != 16 {
		t.Fatalf("by PCI: %+v, %v", d, err)
	}
	// virtio-blk serials arrive cut to 20 bytes; the full serial still finds
	// the disk, a different one does not.
	if d, err = find("serial=3f2a6c1e-disk-0000000001"); err != nil || d.Name != "vdb" {
		t.Fatalf("by long serial: %+v, %v", d, err)
	}
	if _, err = find("serial=3f2a6c1e-disk-00"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("short prefix of a serial matched: %v", err)
	}
}

func TestFindSCSI(t *testing.T) {
	s := newSysfs(t)
	s.virtioBlk("vda", "0000:00:04.0", "virtio1", "254:0", "root-disk")
	s.virtioBlk("vdb", "0000:00:05.0", "virtio2", "254:16", "3f2a6c1e-disk-000000")
	s.scsiDisk("sda", "0000:00:07.0", "2:0:0:1", "8:0", "sda", "beaf11", "naa.6001405fa83b1c2d0011223344556677", naa1)
	s.scsiDisk("sdb", "0000:00:07.0", "2:0:0:2", "8:16", "sdb", "beaf12", "", nil)
	f := Finder{SysfsRoot: s.root}
	find := func(loc string) (Disk, error) {
		l, err := ParseLocator(loc)
		if err != nil {
			t.Fatal(err)
		}
		return f.Find(l)
	}
	d, err := find("serial=beaf11")
	if err != nil || d.Name != "sda" || d.Kind != KindSCSI || d.PCI.String() != "0000:00:07.0" {
		t.Fatalf("by serial: %+v, %v", d, err)
	}
	if d.WWNs[0] != "naa.6001405fa83b1c2d0011223344556677" {
		t.Fatalf("wwns %v", d.WWNs)
	}
	for _, loc := range []string{"wwn=naa.6001405FA83B1C2D0011223344556677", "wwn=6001405fa83b1c2d0011223344556677", "pci=00:07,serial=beaf11"} {
		if d, err := find(loc); err != nil || d.Name != "sda" {
			t.Fatalf("%s: %+v, %v", loc, d, err)
		}
	}
	if d, err := find("serial=3f2a6c1e-disk-0000000001"); err != nil || d.Name != "vdb" {
		t.Fatalf("truncated virtio serial: %+v, %v", d, err)
	}
	// Two LUNs behind one virtio-scsi controller: PCI alone is ambiguous.
	_, err = find("pci=00:07")
	if !errors.Is(err, ErrAmbiguous) || !strings.Contains(err.Error(), "sda") || !strings.Contains(err.Error(), "sdb") {
		t.Fatalf("ambiguous: %v", err)
	}
	// Not found: the message says what was looked for and what exists.
	_, err = find("pci=00:09,serial=nope")
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("not found: %v", err)
	}
	for _, want := range []string{"pci=0000:00:09", "serial=nope", "vda", "serial root-disk", "sda (scsi, pci 0000:00:07.0, serial beaf11"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	if _, err := find("serial=beaf11,wwn=naa.0000"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("serial right, wwn wrong: %v", err)
	}
}

// One scan resolves many locators, with Find's answers and errors; it is
// a snapshot, so a disk attached after it is found only by a new scan.
func TestInventory(t *testing.T) {
	s := newSysfs(t)
	s.virtioBlk("vda", "0000:00:04.0", "virtio1", "254:0", "root-disk")
	s.scsiDisk("sda", "0000:00:07.0", "2:0:0:1", "8:0", "sda", "beaf11", "naa.6001405fa83b1c2d0011223344556677", naa1)
	s.scsiDisk("sdb", "0000:00:07.0", "2:0:0:2", "8:16", "sdb", "beaf12", "", nil)
	f := Finder{SysfsRoot: s.root}
	inv, err := f.Scan()
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Disks) != 3 {
		t.Fatalf("scanned %d disks: %+v", len(inv.Disks), inv.Disks)
	}
	for loc, want := range map[string]string{"serial=beaf11": "sda", "serial=beaf12": "sdb", "pci=00:04": "vda", "wwn=6001405fa83b1c2d0011223344556677": "sda"} {
		l, err := ParseLocator(loc)
		if err != nil {
			t.Fatal(err)
		}
		d, err := inv.Find(l)
		if err != nil || d.Name != want {
			t.Errorf("%s in the inventory: %+v, %v; want %s", loc, d, err, want)
		}
		if fd, err := f.Find(l); err != nil || fd.Name != d.Name || fd.Major != d.Major || fd.Minor != d.Minor {
			t.Errorf("%s: the inventory says %+v, a scan of its own %+v, %v", loc, d, fd, err)
		}
	}
	if _, err := inv.Find(Locator{PCI: &PCIAddress{Slot: 7, AnyFunction: true}}); !errors.Is(err, ErrAmbiguous) {
		t.Fatalf("ambiguous in the inventory: %v", err)
	}
	if _, err := inv.Find(Locator{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("empty locator: %v", err)
	}
	s.scsiDisk("sdc", "0000:00:08.0", "3:0:0:1", "8:32", "sdc", "beaf13", "", nil)
	_, err = inv.Find(Locator{Serial: "beaf13"})
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), s.root) || !strings.Contains(err.Error(), "sdb (scsi") {
		t.Fatalf("a disk attached after the scan, in the old inventory: %v", err)
	}
	if d, err := f.Find(Locator{Serial: "beaf13"}); err != nil || d.Name != "sdc" {
		t.Fatalf("a disk attached after the scan, in a new scan: %+v, %v", d, err)
	}
	if _, err := (Finder{SysfsRoot: filepath.Join(s.root, "nope")}).Scan(); err == nil {
		t.Fatal("a scan of a missing sysfs succeeded")
	}
}

// loopDevice attaches a loop device to a small file, for tests that need a
// real block device node. It needs root.
func loopDevice(t *testing.T) (path string, major, minor uint32) {
	t.Helper()
	hosttest.NeedRoot(t, "needs root to attach a loop device")
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	path = strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", path).Run() })
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return path, unix.Major(st.Rdev), unix.Minor(st.Rdev)
}

func TestOpenVerifiesVirtioIdentity(t *testing.T) {
	loop, ma, mi := loopDevice(t)
	name := filepath.Base(loop)
	s := newSysfs(t)
	bdir := s.block(name, "pci0000:00/0000:00:05.0/virtio2", fmt.Sprintf("%d:%d", ma, mi), name)
	s.write(filepath.Join(bdir, "serial"), "vol-1\n")
	f := Finder{SysfsRoot: s.root, DevRoot: "/dev"}
	ctx := context.Background()

	d, err := f.Find(Locator{Serial: "vol-1"})
	if err != nil {
		t.Fatal(err)
	}
	o, err := f.Open(ctx, d, Locator{Serial: "vol-1"})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := o.Verify(ctx); err != nil {
		t.Fatal(err)
	}
	// The serial changes under us (another disk now has this name).
	s.write(filepath.Join(bdir, "serial"), "vol-2\n")
	if err := o.Verify(ctx); !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), `"vol-2"`) {
		t.Fatalf("after serial change: %v", err)
	}
	s.write(filepath.Join(bdir, "serial"), "vol-1\n")
	// sysfs now gives the name another device number: the open node is
	// stale.
	s.write(filepath.Join(bdir, "dev"), fmt.Sprintf("%d:%d\n", ma, mi+1000))
	if err := o.Verify(ctx); !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), "replaced") {
		t.Fatalf("after renumbering: %v", err)
	}
	// A disk description whose numbers do not match the node is refused at
	// open: the node is not the disk.
	stale := d
	stale.Minor += 1000
	if _, err := f.Open(ctx, stale, Locator{}); !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), "stale") {
		t.Fatalf("open of a stale node: %v", err)
	}
}

func TestByDevice(t *testing.T) {
	loop, ma, mi := loopDevice(t)
	name := filepath.Base(loop)
	s := newSysfs(t)
	bdir := s.block(name, "pci0000:00/0000:00:05.0/virtio2", fmt.Sprintf("%d:%d", ma, mi), name)
	s.write(filepath.Join(bdir, "serial"), "vol-1\n")
	// A by-id style symlink to the node resolves through major:minor.
	byid := filepath.Join(t.TempDir(), "virtio-vol-1")
	if err := os.Symlink(loop, byid); err != nil {
		t.Fatal(err)
	}
	f := Finder{SysfsRoot: s.root, DevRoot: "/dev"}
	d, err := f.ByDevice(byid)
	if err != nil || d.Name != name || d.Serial != "vol-1" || d.DevPath != loop {
		t.Fatalf("ByDevice: %+v, %v", d, err)
	}
	if _, err := f.ByDevice(filepath.Join(t.TempDir())); err == nil {
		t.Fatal("a directory accepted as a device")
	}
}

func TestOpenVerifiesSCSIIdentityOverTheDevice(t *testing.T) {
	loop, ma, mi := loopDevice(t)
	name := filepath.Base(loop)
	s := newSysfs(t)
	s.scsiDisk(name, "0000:00:07.0", "2:0:0:1", fmt.Sprintf("%d:%d", ma, mi), name, "beaf11", "naa.6001405fa83b1c2d0011223344556677", naa1)
	// The loop device stands in for the node; the identity commands go to
	// a model target (SG_IO needs a SCSI device, which the lab provides).
	tgt := scsitest.New(scsitest.Options{Serial: "beaf11", NAA: naa1})
	f := Finder{SysfsRoot: s.root, DevRoot: "/dev", SCSI: func(*os.File) scsi.Transport { return tgt.Initiator("me") }}
	ctx := context.Background()
	want := Locator{Serial: "beaf11", WWN: "naa.6001405fa83b1c2d0011223344556677"}
	d, err := f.Find(want)
	if err != nil {
		t.Fatal(err)
	}
	o, err := f.Open(ctx, d, want)
	if err != nil {
		t.Fatal(err)
	}
	o.Close()
	// The kernel's cached VPD still says beaf11, but the device answers
	// otherwise: the device wins.
	tgt.Opts.Serial = "other"
	if _, err := f.Open(ctx, d, want); !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), `"other"`) {
		t.Fatalf("serial from device differs: %v", err)
	}
	tgt.Opts.Serial = "beaf11"
	tgt.Opts.NAA = []byte{0x60, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
	if _, err := f.Open(ctx, d, want); !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), "WWN") {
		t.Fatalf("WWN from device differs: %v", err)
	}
}

func TestSetReadOnly(t *testing.T) {
	loop, ma, mi := loopDevice(t)
	name := filepath.Base(loop)
	s := newSysfs(t)
	bdir := s.block(name, "pci0000:00/0000:00:05.0/virtio2", fmt.Sprintf("%d:%d", ma, mi), name)
	s.write(filepath.Join(bdir, "serial"), "vol-1\n")
	f := Finder{SysfsRoot: s.root, DevRoot: "/dev"}
	d, err := f.Find(Locator{Serial: "vol-1"})
	if err != nil {
		t.Fatal(err)
	}
	o, err := f.Open(context.Background(), d, Locator{})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := o.SetReadOnly(true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.SetReadOnly(false) })
	if ro, err := o.ReadOnly(); err != nil || !ro {
		t.Fatalf("ReadOnly() = %v, %v", ro, err)
	}
	// The kernel now refuses writes to the node (at open or at write,
	// depending on the kernel version).
	if w, err := os.OpenFile(loop, os.O_WRONLY, 0); err == nil {
		_, werr := w.Write(make([]byte, 512))
		w.Close()
		if werr == nil {
			t.Fatal("write to a read-only disk succeeded")
		}
	}
	if b, _ := os.ReadFile(filepath.Join("/sys/block", name, "ro")); strings.TrimSpace(string(b)) != "1" {
		t.Fatalf("sysfs ro = %q", b)
	}
	if err := o.SetReadOnly(false); err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(loop, os.O_WRONLY, 0)
	if err != nil {
		t.Fatalf("writable open after clearing read-only: %v", err)
	}
	defer w.Close()
	if _, err := w.Write(make([]byte, 512)); err != nil {
		t.Fatalf("write after clearing read-only: %v", err)
	}
}
