package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// Device is a volume's disk, open and verified.
type Device struct {
	Path         string
	Name         string
	Major, Minor uint32
	Kind         discovery.Kind
	PCI          string
	Serial       string
	WWNs         []string
	// File is the open device node (read-only; enough for reservations
	// and for BLKROSET).
	File *os.File
	// SCSI is the transport to a SCSI disk, else nil.
	SCSI scsi.Transport
	// Verify proves the node still is the disk it was opened as.
	Verify func(ctx context.Context) error
}

// DevNum is major:minor.
func (d *Device) DevNum() string { return fmt.Sprintf("%d:%d", d.Major, d.Minor) }

// Close closes the device node.
func (d *Device) Close() error {
	if d == nil || d.File == nil {
		return nil
	}
	return d.File.Close()
}

// Locate finds the disk a locator names and opens it. allowLoop admits
// loop devices named by their backing file.
func locate(ctx context.Context, f discovery.Finder, loc Locator, allowLoop bool) (*Device, error) {
	return (&diskScan{f: f}).locate(ctx, loc, allowLoop)
}

// diskScan is the view of the attached disks shared by the claims of one
// pass over them (the start-up check, or one periodic check). The first
// claim scans sysfs; each further one is looked up in that scan and
// opened, which proves the disk still is the one the scan saw. A claim the
// scan does not resolve to an open, verified disk (its disk is not in it,
// or changed since) is looked up again in a fresh scan, which then serves
// the rest of the pass. So every claim gets the answer a scan of its own
// would give, at the cost of one scan per pass while nothing changes
// instead of one per claim.
type diskScan struct {
	f discovery.Finder
	// mu serialises the claims the start-up check takes back side by
	// side: they share one scan.
	mu  sync.Mutex
	inv *discovery.Inventory
	// open, when set, stands for the whole lookup (the manager
	// simulation's modelled disks, Manager.scanOpen).
	open func(ctx context.Context, loc Locator) (*Device, error)
}

func (s *diskScan) locate(ctx context.Context, loc Locator, allowLoop bool) (*Device, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.open != nil {
		return s.open(ctx, loc)
	}
	if loc.BackingFile != "" {
		if !allowLoop {
			return nil, agenterr.New(agenterr.InvalidArgument,
				"the locator names a loop device (backing file %s), which this agent does not accept: loop devices are for the simulator's host mode and tests (volumes.allow_loop_devices)", loc.BackingFile)
		}
		return openLoop(ctx, s.f, loc.BackingFile)
	}
	dl := loc.Disk
	if err := dl.Check(); err != nil {
		return nil, agenterr.New(agenterr.InvalidArgument, "%v", err)
	}
	if s.inv != nil {
		if d, err := s.inv.Find(dl); err == nil {
			if o, err := s.f.Open(ctx, d, dl); err == nil {
				return openedDevice(d, o), nil
			}
		}
		// Whatever went wrong is judged on a fresh scan below.
	}
	inv, err := s.f.Scan()
	if err != nil {
		return nil, agenterr.New(agenterr.FailedPrecondition, "%v", err)
	}
	s.inv = inv
	d, err := inv.Find(dl)
	switch {
	case errors.Is(err, discovery.ErrNotFound):
		return nil, agenterr.New(agenterr.NotFound, "%v; is the disk attached to this node?", err)
	case err != nil:
		return nil, agenterr.New(agenterr.FailedPrecondition, "%v", err)
	}
	o, err := s.f.Open(ctx, d, dl)
	if err != nil {
		return nil, agenterr.New(agenterr.FailedPrecondition, "%v", err)
	}
	return openedDevice(d, o), nil
}

func openedDevice(d discovery.Disk, o *discovery.Opened) *Device {
	dev := &Device{Path: d.DevPath, Name: d.Name, Major: d.Major, Minor: d.Minor, Kind: d.Kind,
		Serial: d.Serial, WWNs: d.WWNs, File: o.File, SCSI: o.SCSI, Verify: o.Verify}
	if d.PCI != nil {
		dev.PCI = d.PCI.String()
	}
	return dev
}

func sysfsRoot(f discovery.Finder) string {
	if f.SysfsRoot == "" {
		return "/sys"
	}
	return f.SysfsRoot
}

func devRoot(f discovery.Finder) string {
	if f.DevRoot == "" {
		return "/dev"
	}
	return f.DevRoot
}

// loopByBacking returns the loop device whose backing file is backing.
func loopByBacking(f discovery.Finder, backing string) (name string, major, minor uint32, err error) {
	want := filepath.Clean(backing)
	ents, err := os.ReadDir(filepath.Join(sysfsRoot(f), "block"))
	if err != nil {
		return "", 0, 0, fmt.Errorf("listing block devices: %w", err)
	}
	var hits []string
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(sysfsRoot(f), "block", e.Name(), "loop", "backing_file"))
		if err != nil {
			continue
		}
		if filepath.Clean(strings.TrimSpace(string(b))) == want {
			hits = append(hits, e.Name())
		}
	}
	switch len(hits) {
	case 0:
		return "", 0, 0, agenterr.New(agenterr.NotFound, "no loop device has the backing file %s; attach it (losetup) first", backing)
	case 1:
	default:
		return "", 0, 0, agenterr.New(agenterr.FailedPrecondition, "loop devices %s all have the backing file %s; detach all but one", strings.Join(hits, ", "), backing)
	}
	dn, err := os.ReadFile(filepath.Join(sysfsRoot(f), "block", hits[0], "dev"))
	if err != nil {
		return "", 0, 0, fmt.Errorf("loop device %s: %w", hits[0], err)
	}
	ma, mi, ok := strings.Cut(strings.TrimSpace(string(dn)), ":")
	a, err1 := strconv.ParseUint(ma, 10, 32)
	b, err2 := strconv.ParseUint(mi, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return "", 0, 0, fmt.Errorf("loop device %s: device number %q is not major:minor", hits[0], dn)
	}
	return hits[0], uint32(a), uint32(b), nil
}

func openLoop(ctx context.Context, f discovery.Finder, backing string) (*Device, error) {
	name, ma, mi, err := loopByBacking(f, backing)
	if err != nil {
		return nil, err
	}
	p := filepath.Join(devRoot(f), name)
	fh, err := os.OpenFile(p, os.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, agenterr.New(agenterr.FailedPrecondition, "opening loop device %s: %v", p, err)
	}
	dev := &Device{Path: p, Name: name, Major: ma, Minor: mi, Kind: discovery.KindOther, File: fh}
	dev.Verify = func(context.Context) error {
		var st unix.Stat_t
		if err := unix.Fstat(int(fh.Fd()), &st); err != nil {
			return fmt.Errorf("%w: %s: %v", discovery.ErrIdentity, p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != ma || unix.Minor(st.Rdev) != mi {
			return fmt.Errorf("%w: %s is no longer loop device %d:%d", discovery.ErrIdentity, p, ma, mi)
		}
		n2, ma2, mi2, err := loopByBacking(f, backing)
		if err != nil {
			return fmt.Errorf("%w: %v", discovery.ErrIdentity, err)
		}
		if n2 != name || ma2 != ma || mi2 != mi {
			return fmt.Errorf("%w: the backing file %s is now on %s, not %s", discovery.ErrIdentity, backing, n2, name)
		}
		return nil
	}
	if err := dev.Verify(ctx); err != nil {
		fh.Close()
		return nil, agenterr.New(agenterr.FailedPrecondition, "%v", err)
	}
	return dev, nil
}

// setReadOnly sets or clears the block layer's read-only flag (BLKROSET),
// which refuses every write to the device from this host, whoever opens it.
func setReadOnly(f *os.File, ro bool) error {
	v := 0
	if ro {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, v); err != nil {
		return fmt.Errorf("BLKROSET %d on %s: %w", v, f.Name(), err)
	}
	return nil
}

// readOnly reports the block layer's read-only flag (BLKROGET).
func readOnly(f *os.File) (bool, error) {
	v, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET)
	if err != nil {
		return false, fmt.Errorf("BLKROGET on %s: %w", f.Name(), err)
	}
	return v != 0, nil
}

// deviceSize is the size in bytes of the block device at path.
func deviceSize(path string) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var n uint64
	if err := ioctlGetUint64(f, unix.BLKGETSIZE64, &n); err != nil {
		return 0, fmt.Errorf("BLKGETSIZE64 on %s: %w", path, err)
	}
	return int64(n), nil
}
