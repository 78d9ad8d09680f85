// Package discovery finds the block device of a cloud disk inside the VM and
// proves, each time it is about to be used, that the device node still is
// that disk.
//
// A whitesky.cloud disk is named by the API with its PCI bus and slot (for
// virtio-scsi, the controller's PCI function), and the guest sees its serial
// (virtio-blk "serial" attribute, SCSI VPD page 0x80) and, on SCSI, its WWN
// (VPD page 0x83, the kernel's "wwid"). Discovery reads sysfs (its root is a
// parameter, so tests use a fixture tree) and never trusts /dev/disk/by-*
// links, which udev may not have updated after a hot-unplug and replug:
// after opening the node it compares the descriptor's major:minor with
// sysfs and reads the serial again from the open device.
package discovery

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// PCIAddress is a PCI function, domain:bus:slot.function.
type PCIAddress struct {
	Domain   uint16 `json:"domain"`
	Bus      uint8  `json:"bus"`
	Slot     uint8  `json:"slot"`
	Function uint8  `json:"function"`
	// AnyFunction: the address was given as bus and slot only (as the
	// cloud API does); every function of the slot matches.
	AnyFunction bool `json:"-"`
}

func (a PCIAddress) String() string {
	s := fmt.Sprintf("%04x:%02x:%02x", a.Domain, a.Bus, a.Slot)
	if a.AnyFunction {
		return s
	}
	return fmt.Sprintf("%s.%x", s, a.Function)
}

// Matches reports whether b (a concrete function) is the device a names.
func (a PCIAddress) Matches(b PCIAddress) bool {
	return a.Domain == b.Domain && a.Bus == b.Bus && a.Slot == b.Slot && (a.AnyFunction || a.Function == b.Function)
}

var pciRE = regexp.MustCompile(`^(?:([0-9a-fA-F]{4}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?$`)

// ParsePCIAddress reads "dddd:bb:ss.f", "bb:ss.f" or "bb:ss" (hexadecimal,
// as lspci prints; domain defaults to 0). Use PCIFromAPI for the cloud API's
// decimal pci_bus/pci_slot numbers.
func ParsePCIAddress(s string) (PCIAddress, error) {
	m := pciRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return PCIAddress{}, fmt.Errorf("PCI address %q: want [domain:]bus:slot[.function] in hexadecimal, e.g. 0000:00:07.0", s)
	}
	var a PCIAddress
	if m[1] != "" {
		v, _ := strconv.ParseUint(m[1], 16, 16)
		a.Domain = uint16(v)
	}
	b, _ := strconv.ParseUint(m[2], 16, 8)
	sl, _ := strconv.ParseUint(m[3], 16, 8)
	a.Bus, a.Slot = uint8(b), uint8(sl)
	if sl > 0x1f {
		return PCIAddress{}, fmt.Errorf("PCI address %q: slot 0x%x is above 0x1f", s, sl)
	}
	if m[4] == "" {
		a.AnyFunction = true
	} else {
		f, _ := strconv.ParseUint(m[4], 10, 8)
		a.Function = uint8(f)
	}
	return a, nil
}

// PCIFromAPI builds the address of a disk from the whitesky.cloud API's
// pci_bus and pci_slot (numbers, domain 0, any function).
func PCIFromAPI(bus, slot int) (PCIAddress, error) {
	if bus < 0 || bus > 0xff || slot < 0 || slot > 0x1f {
		return PCIAddress{}, fmt.Errorf("PCI bus %d / slot %d out of range", bus, slot)
	}
	return PCIAddress{Bus: uint8(bus), Slot: uint8(slot), AnyFunction: true}, nil
}

// Locator says how to find a disk. Every field that is set must match.
// Its text form, String and ParseLocator's, is "pci=…,serial=…,wwn=…";
// MarshalText and UnmarshalText use it, so a locator kept in JSON (the
// agent's claim records) is that string.
type Locator struct {
	PCI    *PCIAddress
	Serial string
	WWN    string
}

func (l Locator) String() string {
	var p []string
	if l.PCI != nil {
		p = append(p, "pci="+l.PCI.String())
	}
	if l.Serial != "" {
		p = append(p, "serial="+l.Serial)
	}
	if l.WWN != "" {
		p = append(p, "wwn="+l.WWN)
	}
	return strings.Join(p, ",")
}

// IsZero reports whether l names nothing.
func (l Locator) IsZero() bool { return l.PCI == nil && l.Serial == "" && l.WWN == "" }

// Equal reports whether l and o name the same disk the same way.
func (l Locator) Equal(o Locator) bool {
	if (l.PCI == nil) != (o.PCI == nil) || l.PCI != nil && *l.PCI != *o.PCI {
		return false
	}
	return l.Serial == o.Serial && l.WWN == o.WWN
}

// Check refuses a locator whose text form would not read back as the same
// locator: one naming nothing, or a serial or WWN with a comma, '=', a
// control character or surrounding spaces (no real one has them; targets
// pad serials with spaces, which Describe trims).
func (l Locator) Check() error {
	if l.IsZero() {
		return errors.New("the disk locator names nothing to look for (pci, serial, wwn)")
	}
	for _, f := range []struct{ k, v string }{{"serial", l.Serial}, {"wwn", l.WWN}} {
		if strings.ContainsAny(f.v, ",=") || strings.IndexFunc(f.v, unicode.IsControl) >= 0 || strings.TrimSpace(f.v) != f.v {
			return fmt.Errorf("device %s %q holds a comma, '=', a control character or surrounding spaces", f.k, f.v)
		}
	}
	return nil
}

// MarshalText is l's text form; a locator that fails Check has none.
func (l Locator) MarshalText() ([]byte, error) {
	if err := l.Check(); err != nil {
		return nil, err
	}
	return []byte(l.String()), nil
}

// UnmarshalText reads l's text form with ParseLocator.
func (l *Locator) UnmarshalText(b []byte) error {
	p, err := ParseLocator(string(b))
	if err != nil {
		return err
	}
	*l = p
	return nil
}

// ParseLocator reads "pci=00:07,serial=abc,wwn=naa.600..." (any subset, at
// least one).
func ParseLocator(s string) (Locator, error) {
	var l Locator
	for _, part := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok || v == "" {
			return Locator{}, fmt.Errorf("disk locator %q: want key=value pairs (pci=, serial=, wwn=) separated by commas", s)
		}
		switch k {
		case "pci":
			a, err := ParsePCIAddress(v)
			if err != nil {
				return Locator{}, err
			}
			l.PCI = &a
		case "serial":
			l.Serial = v
		case "wwn":
			l.WWN = v
		default:
			return Locator{}, fmt.Errorf("disk locator %q: unknown key %q (pci, serial, wwn)", s, k)
		}
	}
	if l.IsZero() {
		return Locator{}, fmt.Errorf("disk locator %q names nothing to look for", s)
	}
	return l, nil
}

// Kind is the driver family of a disk.
type Kind string

const (
	KindSCSI      Kind = "scsi"
	KindVirtioBlk Kind = "virtio-blk"
	KindOther     Kind = "other"
)

// Disk is a whole-disk block device as sysfs describes it.
type Disk struct {
	Name    string      `json:"name"`     // kernel name, e.g. "sda"
	DevPath string      `json:"dev_path"` // device node under the dev root
	SysPath string      `json:"sys_path"` // resolved sysfs directory of the block device
	Major   uint32      `json:"major"`
	Minor   uint32      `json:"minor"`
	Kind    Kind        `json:"kind"`
	PCI     *PCIAddress `json:"pci,omitempty"` // nearest PCI function above the disk
	Serial  string      `json:"serial,omitempty"`
	WWNs    []string    `json:"wwns,omitempty"`
}

func (d Disk) describe() string {
	s := fmt.Sprintf("%s (%s", d.Name, d.Kind)
	if d.PCI != nil {
		s += ", pci " + d.PCI.String()
	}
	if d.Serial != "" {
		s += ", serial " + d.Serial
	}
	if len(d.WWNs) > 0 {
		s += ", wwn " + d.WWNs[0]
	}
	return s + ")"
}

// Finder looks disks up under a sysfs root and opens them under a dev root.
type Finder struct {
	SysfsRoot string // default "/sys"
	DevRoot   string // default "/dev"
	// SCSI returns the transport used to re-read identity from an open SCSI
	// disk; nil means SG_IO on the descriptor.
	SCSI func(f *os.File) scsi.Transport
}

func (f Finder) sys() string {
	if f.SysfsRoot == "" {
		return "/sys"
	}
	return f.SysfsRoot
}

func (f Finder) dev() string {
	if f.DevRoot == "" {
		return "/dev"
	}
	return f.DevRoot
}

// virtioSerialMax is what virtio-blk can carry of a serial
// (VIRTIO_BLK_ID_BYTES); longer serials arrive truncated.
const virtioSerialMax = 20

func readAttr(p string) (string, bool) {
	b, err := os.ReadFile(p)
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

func exists(p string) bool { _, err := os.Lstat(p); return err == nil }

var pciFuncRE = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// Describe reads one whole disk's identity from sysfs.
func (f Finder) Describe(name string) (Disk, error) {
	blk := filepath.Join(f.sys(), "block", name)
	real, err := filepath.EvalSymlinks(blk)
	if err != nil {
		return Disk{}, fmt.Errorf("disk %s: %w", name, err)
	}
	d := Disk{Name: name, SysPath: real, Kind: KindOther}
	devnum, ok := readAttr(filepath.Join(blk, "dev"))
	if !ok {
		return Disk{}, fmt.Errorf("disk %s: no %s", name, filepath.Join(blk, "dev"))
	}
	if d.Major, d.Minor, err = parseDevnum(devnum); err != nil {
		return Disk{}, fmt.Errorf("disk %s: %w", name, err)
	}
	d.DevPath = filepath.Join(f.dev(), devName(blk, name))
	d.PCI = nearestPCI(real)
	devdir := filepath.Join(blk, "device")
	switch {
	case exists(filepath.Join(devdir, "scsi_level")) || subsystem(devdir) == "scsi":
		d.Kind = KindSCSI
		d.Serial, d.WWNs = scsiIdentity(devdir)
	case exists(filepath.Join(blk, "serial")) || subsystem(devdir) == "virtio":
		d.Kind = KindVirtioBlk
		d.Serial, _ = readAttr(filepath.Join(blk, "serial"))
	}
	return d, nil
}

// devName is the disk's node name under /dev as its uevent's DEVNAME
// gives it, or name when the uevent gives none that stays under /dev.
func devName(blk, name string) string {
	devname := name
	if ue, ok := readAttr(filepath.Join(blk, "uevent")); ok {
		for _, line := range strings.Split(ue, "\n") {
			if v, ok := strings.CutPrefix(line, "DEVNAME="); ok && v != "" && !strings.Contains(v, "..") {
				devname = v
			}
		}
	}
	return devname
}

// nearestPCI is the last PCI function in the disk's sysfs path, the one
// nearest the disk, or nil when it sits on none.
func nearestPCI(real string) *PCIAddress {
	var pci *PCIAddress
	for _, c := range strings.Split(real, string(filepath.Separator)) {
		if pciFuncRE.MatchString(c) {
			a, err := ParsePCIAddress(c)
			if err == nil {
				pci = &a
			}
		}
	}
	return pci
}

// scsiIdentity reads a SCSI disk's unit serial (VPD page 0x80) and its
// names: the kernel's wwid first, then each logical-unit name of VPD page
// 0x83 not already among them. A page that cannot be read or parsed
// gives nothing.
func scsiIdentity(devdir string) (serial string, wwns []string) {
	if b, err := os.ReadFile(filepath.Join(devdir, "vpd_pg80")); err == nil {
		if s, err := scsi.ParseUnitSerial(b); err == nil {
			serial = s
		}
	}
	if w, ok := readAttr(filepath.Join(devdir, "wwid")); ok && w != "" {
		wwns = append(wwns, w)
	}
	b, err := os.ReadFile(filepath.Join(devdir, "vpd_pg83"))
	if err != nil {
		return serial, wwns
	}
	ds, err := scsi.ParseDeviceID(b)
	if err != nil {
		return serial, wwns
	}
	for _, n := range scsi.LUNames(ds) {
		if !slices.ContainsFunc(wwns, func(w string) bool { return strings.EqualFold(w, n) }) {
			wwns = append(wwns, n)
		}
	}
	return serial, wwns
}

func subsystem(dir string) string {
	t, err := os.Readlink(filepath.Join(dir, "subsystem"))
	if err != nil {
		return ""
	}
	return filepath.Base(t)
}

func parseDevnum(s string) (uint32, uint32, error) {
	a, b, ok := strings.Cut(s, ":")
	ma, err1 := strconv.ParseUint(a, 10, 32)
	mi, err2 := strconv.ParseUint(b, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("device number %q is not major:minor", s)
	}
	return uint32(ma), uint32(mi), nil
}

// List returns every whole disk that sits on a device (loop, ram, zram and
// device-mapper nodes have none and are left out).
func (f Finder) List() ([]Disk, error) {
	ents, err := os.ReadDir(filepath.Join(f.sys(), "block"))
	if err != nil {
		return nil, fmt.Errorf("listing disks: %w", err)
	}
	var out []Disk
	for _, e := range ents {
		if !exists(filepath.Join(f.sys(), "block", e.Name(), "device")) {
			continue
		}
		d, err := f.Describe(e.Name())
		if err != nil {
			continue
		}
		out = append(out, d)
	}
	return out, nil
}

func serialMatches(want string, d Disk) bool {
	if d.Serial == want {
		return true
	}
	return d.Kind == KindVirtioBlk && len(want) > virtioSerialMax && len(d.Serial) == virtioSerialMax && strings.HasPrefix(want, d.Serial)
}

func wwnMatches(want string, names []string) bool {
	w := strings.ToLower(strings.TrimSpace(want))
	for _, n := range names {
		n = strings.ToLower(n)
		if n == w {
			return true
		}
		if !strings.Contains(w, ".") {
			if _, v, ok := strings.Cut(n, "."); ok && v == w {
				return true
			}
		}
	}
	return false
}

// Matches reports whether d is the disk l describes.
func (l Locator) Matches(d Disk) bool {
	if l.PCI != nil && (d.PCI == nil || !l.PCI.Matches(*d.PCI)) {
		return false
	}
	if l.Serial != "" && !serialMatches(l.Serial, d) {
		return false
	}
	if l.WWN != "" && !wwnMatches(l.WWN, d.WWNs) {
		return false
	}
	return true
}

// ErrNotFound is wrapped when no disk matches a locator.
var ErrNotFound = errors.New("disk not found")

// ErrAmbiguous is wrapped when several disks match a locator.
var ErrAmbiguous = errors.New("disk locator is ambiguous")

// ErrIdentity is wrapped when a device node turns out not to be the disk
// discovery found (replaced, stale, or changed serial).
var ErrIdentity = errors.New("device identity check failed")

// Inventory is what one scan of sysfs found: every whole disk, as List
// returns them. A caller resolving many locators at once (the agent
// re-verifying all its claims) scans once and finds each locator in the
// inventory instead of scanning once per locator. It is a snapshot: a disk
// found in it is still proved by Open before use, and one missing from it
// may have been attached since.
type Inventory struct {
	Disks []Disk
	root  string
}

// Scan lists every whole disk once.
func (f Finder) Scan() (*Inventory, error) {
	all, err := f.List()
	if err != nil {
		return nil, err
	}
	return &Inventory{Disks: all, root: f.sys()}, nil
}

// Find returns the one disk of the inventory matching l. Its error says
// what was looked for and lists what was found instead.
func (inv *Inventory) Find(l Locator) (Disk, error) {
	if l.PCI == nil && l.Serial == "" && l.WWN == "" {
		return Disk{}, fmt.Errorf("%w: the locator names nothing to look for", ErrNotFound)
	}
	var hits []Disk
	for _, d := range inv.Disks {
		if l.Matches(d) {
			hits = append(hits, d)
		}
	}
	switch len(hits) {
	case 1:
		return hits[0], nil
	case 0:
		found := "no disks"
		if len(inv.Disks) > 0 {
			seen := make([]string, len(inv.Disks))
			for i, d := range inv.Disks {
				seen[i] = d.describe()
			}
			found = strings.Join(seen, "; ")
		}
		return Disk{}, fmt.Errorf("%w: looked for %s under %s; found %s", ErrNotFound, l, inv.root, found)
	}
	names := make([]string, len(hits))
	for i, d := range hits {
		names[i] = d.describe()
	}
	return Disk{}, fmt.Errorf("%w: %s matches %d disks: %s; add the serial or WWN", ErrAmbiguous, l, len(hits), strings.Join(names, "; "))
}

// Find scans sysfs and returns the one disk matching l (Inventory.Find).
func (f Finder) Find(l Locator) (Disk, error) {
	inv, err := f.Scan()
	if err != nil {
		return Disk{}, err
	}
	return inv.Find(l)
}

// ByDevice describes the disk behind a device path (which may be a symlink
// such as /dev/disk/by-id/...): the path is only used for its major:minor,
// which sysfs then names.
func (f Finder) ByDevice(path string) (Disk, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Disk{}, fmt.Errorf("device %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return Disk{}, fmt.Errorf("device %s is not a block device", path)
	}
	ma, mi := unix.Major(st.Rdev), unix.Minor(st.Rdev)
	link := filepath.Join(f.sys(), "dev", "block", fmt.Sprintf("%d:%d", ma, mi))
	real, err := filepath.EvalSymlinks(link)
	if err != nil {
		return Disk{}, fmt.Errorf("device %s (%d:%d): not in %s: %w", path, ma, mi, filepath.Join(f.sys(), "dev", "block"), err)
	}
	if exists(filepath.Join(real, "partition")) {
		return Disk{}, fmt.Errorf("device %s is a partition (%s); fencing acts on whole disks", path, filepath.Base(real))
	}
	return f.Describe(filepath.Base(real))
}

// Opened is a disk's device node, opened and verified.
type Opened struct {
	Disk Disk
	File *os.File
	// SCSI is the transport to the disk when it is a SCSI disk, else nil.
	SCSI scsi.Transport
	// Identify re-reads a SCSI disk's identity in Verify. Open sets it to a
	// plain scsi.Device on SCSI; a caller that also fences the disk should
	// set it to the fencing engine's device, so that a unit attention
	// consumed by an identity read is still seen by the engine.
	Identify Identifier
	finder   Finder
	want     Locator
}

// Identifier reads a SCSI disk's identity from the device.
type Identifier interface {
	UnitSerial(ctx context.Context) (string, error)
	DeviceIDs(ctx context.Context) ([]scsi.Designator, error)
}

// Open opens d's device node read-only and verifies that it is d (and
// matches want, when set). Read-only: reservation commands need
// CAP_SYS_RAWIO, not a writable descriptor, and a refused disk has been set
// read-only.
func (f Finder) Open(ctx context.Context, d Disk, want Locator) (*Opened, error) {
	fh, err := os.OpenFile(d.DevPath, os.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening disk %s: %w", d.DevPath, err)
	}
	o := &Opened{Disk: d, File: fh, finder: f, want: want}
	if d.Kind == KindSCSI {
		if f.SCSI != nil {
			o.SCSI = f.SCSI(fh)
		} else {
			o.SCSI = scsi.NewSGIO(fh)
		}
		o.Identify = scsi.NewDevice(d.DevPath, o.SCSI)
	}
	if err := o.Verify(ctx); err != nil {
		fh.Close()
		return nil, err
	}
	return o, nil
}

// Close closes the device.
func (o *Opened) Close() error { return o.File.Close() }

// Verify checks that the open descriptor still is the disk: its major:minor
// equals what sysfs says for the disk's name now, and the serial (and WWN,
// if one was asked for) read again from the device match. Call it before
// every use of the device.
func (o *Opened) Verify(ctx context.Context) error {
	d := o.Disk
	var st unix.Stat_t
	if err := unix.Fstat(int(o.File.Fd()), &st); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrIdentity, d.DevPath, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%w: %s is not a block device", ErrIdentity, d.DevPath)
	}
	if ma, mi := unix.Major(st.Rdev), unix.Minor(st.Rdev); ma != d.Major || mi != d.Minor {
		return fmt.Errorf("%w: %s is device %d:%d, but sysfs says %s is %d:%d; the node is stale or was replaced",
			ErrIdentity, d.DevPath, ma, mi, d.Name, d.Major, d.Minor)
	}
	now, err := o.finder.Describe(d.Name)
	if err != nil {
		return fmt.Errorf("%w: %s disappeared from sysfs: %v", ErrIdentity, d.Name, err)
	}
	if now.Major != d.Major || now.Minor != d.Minor {
		return fmt.Errorf("%w: %s is now %d:%d in sysfs, was %d:%d; the disk was replaced", ErrIdentity, d.Name, now.Major, now.Minor, d.Major, d.Minor)
	}
	if o.want.PCI != nil && (now.PCI == nil || !o.want.PCI.Matches(*now.PCI)) {
		return fmt.Errorf("%w: %s now sits at PCI %v, want %s", ErrIdentity, d.Name, now.PCI, o.want.PCI)
	}
	serial, wwns := now.Serial, now.WWNs
	if dev := o.Identify; dev != nil {
		if serial, err = dev.UnitSerial(ctx); err != nil {
			return fmt.Errorf("%w: reading the serial of %s: %v", ErrIdentity, d.DevPath, err)
		}
		if o.want.WWN != "" {
			ds, err := dev.DeviceIDs(ctx)
			if err != nil {
				return fmt.Errorf("%w: reading the device identification of %s: %v", ErrIdentity, d.DevPath, err)
			}
			wwns = scsi.LUNames(ds)
		}
	}
	wantSerial := o.want.Serial
	if wantSerial == "" {
		wantSerial = d.Serial
	}
	if wantSerial != "" && !serialMatches(wantSerial, Disk{Kind: d.Kind, Serial: serial}) {
		return fmt.Errorf("%w: %s reports serial %q, want %q", ErrIdentity, d.DevPath, serial, wantSerial)
	}
	if o.want.WWN != "" && !wwnMatches(o.want.WWN, wwns) {
		return fmt.Errorf("%w: %s reports WWN %v, want %s", ErrIdentity, d.DevPath, wwns, o.want.WWN)
	}
	return nil
}

func fmtDevnum(ma, mi uint32) string {
	return strconv.FormatUint(uint64(ma), 10) + ":" + strconv.FormatUint(uint64(mi), 10)
}

// SetReadOnly sets or clears the kernel's read-only flag of the whole disk
// (BLKROSET), the refusal of docs/architecture.md P2: once set, the kernel rejects
// writes to the disk from this host, whatever the target allows. It needs
// CAP_SYS_ADMIN.
func (o *Opened) SetReadOnly(ro bool) error {
	v := 0
	if ro {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(int(o.File.Fd()), unix.BLKROSET, v); err != nil {
		return fmt.Errorf("setting %s read-only=%v: %w", o.Disk.DevPath, ro, err)
	}
	return nil
}

// ReadOnly reports the kernel's read-only flag of the disk (BLKROGET).
func (o *Opened) ReadOnly() (bool, error) {
	v, err := unix.IoctlGetInt(int(o.File.Fd()), unix.BLKROGET)
	if err != nil {
		return false, fmt.Errorf("reading the read-only flag of %s: %w", o.Disk.DevPath, err)
	}
	return v != 0, nil
}
