package volume

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// fakeSysfs is a sysfs tree in which real loop devices appear as
// virtio-blk disks with a serial, so that claims located by serial go
// through discovery on this host, which has no such disks to spare. The
// device nodes are the real /dev/loopN, so opening and verifying them is
// real.
type fakeSysfs struct {
	tb   testing.TB
	root string
	n    int
}

func newFakeSysfs(tb testing.TB) *fakeSysfs {
	root := tb.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "block"), 0o755); err != nil {
		tb.Fatal(err)
	}
	return &fakeSysfs{tb: tb, root: root}
}

// add shows the loop device dev as disk name with serial, on a PCI
// function of its own.
func (s *fakeSysfs) add(name, serial, dev string) {
	s.tb.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		s.tb.Fatal(err)
	}
	s.n++
	virtio := fmt.Sprintf("virtio%d", s.n)
	bdir := filepath.Join("devices", "pci0000:00", fmt.Sprintf("0000:%02x:01.0", s.n), virtio, "block", name)
	for f, content := range map[string]string{
		"dev":    fmt.Sprintf("%d:%d\n", unix.Major(st.Rdev), unix.Minor(st.Rdev)),
		"uevent": fmt.Sprintf("DEVNAME=%s\nDEVTYPE=disk\n", filepath.Base(dev)),
		"serial": serial + "\n",
	} {
		p := filepath.Join(s.root, bdir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			s.tb.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			s.tb.Fatal(err)
		}
	}
	for link, target := range map[string]string{
		filepath.Join(s.root, bdir, "device"): "../../../" + virtio,
		filepath.Join(s.root, "block", name):  "../" + bdir,
	} {
		if err := os.Symlink(target, link); err != nil {
			s.tb.Fatal(err)
		}
	}
}

// remove takes disk name away, as a hot-unplug does.
func (s *fakeSysfs) remove(name string) {
	s.tb.Helper()
	if err := os.Remove(filepath.Join(s.root, "block", name)); err != nil {
		s.tb.Fatal(err)
	}
}

func (s *fakeSysfs) finder() discovery.Finder {
	return discovery.Finder{SysfsRoot: s.root, DevRoot: "/dev"}
}

func bySerial(serial string) Locator { return Locator{Disk: discovery.Locator{Serial: serial}} }

// The claims of one pass share one scan while it holds; a disk the scan
// does not have, or no longer has as it saw it, is looked up afresh, with
// the answer a scan of its own gives.
func TestClaimsOfOnePassShareOneScan(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	s := newFakeSysfs(t)
	_, devA := loop(t, 1)
	_, devB := loop(t, 1)
	_, devC := loop(t, 1)
	s.add("vda", "ser-a", devA)
	s.add("vdb", "ser-b", devB)
	s.add("vdx", "ser-x", devC)
	pass := &diskScan{f: s.finder()}
	open := func(serial string) (*Device, error) {
		t.Helper()
		dev, err := pass.locate(ctx, bySerial(serial), false)
		if err == nil {
			t.Cleanup(func() { dev.Close() })
		}
		return dev, err
	}
	if d, err := open("ser-a"); err != nil || d.Path != devA {
		t.Fatalf("first claim: %+v, %v", d, err)
	}
	first := pass.inv
	if first == nil || len(first.Disks) != 3 {
		t.Fatalf("the first claim left no scan of the 3 disks: %+v", first)
	}
	// vdx goes: a scan now would not list it, the pass's scan still does.
	s.remove("vdx")
	if d, err := open("ser-b"); err != nil || d.Path != devB || pass.inv != first {
		t.Fatalf("second claim: %+v, %v; scanned again: %v", d, err, pass.inv != first)
	}

	// ser-b's disk is unplugged and comes back as vdc on another node: the
	// pass's scan names vdb, which no longer verifies; a fresh scan finds
	// vdc.
	s.remove("vdb")
	s.add("vdc", "ser-b", devC)
	d, err := open("ser-b")
	if err != nil || d.Path != devC || d.Name != "vdc" {
		t.Fatalf("a disk renamed since the scan: %+v, %v", d, err)
	}
	if pass.inv == first {
		t.Fatal("a disk that failed to verify did not bring a fresh scan")
	}
	second := pass.inv
	// A disk attached after the scan is found by a fresh one.
	_, devD := loop(t, 1)
	s.add("vdd", "ser-d", devD)
	if d, err := open("ser-d"); err != nil || d.Path != devD || pass.inv == second {
		t.Fatalf("a disk attached since the scan: %+v, %v", d, err)
	}
	// A disk that is gone is not found, with locate's own answer.
	s.remove("vda")
	_, err = open("ser-a")
	_, alone := locate(ctx, s.finder(), bySerial("ser-a"), false)
	if agenterr.KindOf(err) != agenterr.NotFound || agenterr.KindOf(alone) != agenterr.NotFound {
		t.Fatalf("a gone disk: %v; alone: %v", err, alone)
	}
	if _, err := open("ser-nothing,"); agenterr.KindOf(err) != agenterr.InvalidArgument {
		t.Fatalf("a malformed locator: %v", err)
	}
}

// At start every claim is re-verified from one pass over the disks: those
// present are held again, one whose disk is gone is cleaned up, and the
// periodic check then finds all held ones well.
func TestReconcileOfClaimsLocatedBySerial(t *testing.T) {
	e := newEnvWith(t, &perDiskTargets{})
	e.sysfs = newFakeSysfs(t)
	e.cfg.AllowUnfenced = false
	e.start()
	ctx := context.Background()
	const n = 5
	for i := range n {
		_, dev := loop(t, 1)
		e.sysfs.add(fmt.Sprintf("vd%c", 'a'+i), fmt.Sprintf("ser-%d", i), dev)
		req := StageRequest{Volume: fmt.Sprintf("vol-%d", i), Locator: bySerial(fmt.Sprintf("ser-%d", i)), Block: true,
			StagingPath: e.blockStaging(fmt.Sprintf("%d", i))}
		if _, err := e.m.Stage(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	e.m.Close()
	e.sysfs.remove("vdc")
	e.start()
	e.m.Reconcile(ctx)
	for i := range n {
		vol := fmt.Sprintf("vol-%d", i)
		c, err := e.m.Store().Get(vol)
		if i == 2 {
			if c != nil || err != nil {
				t.Fatalf("the claim of a gone disk is kept: %+v, %v", c, err)
			}
			continue
		}
		if err != nil || c == nil || c.State != StateHeld || c.Missing || e.m.getLive(vol) == nil || e.m.getLive(vol).fencer == nil {
			t.Fatalf("%s after restart: %+v, %v", vol, c, err)
		}
	}
	if ev := e.event(events.DiskReleased); ev.Volume != "vol-2" || ev.Reason != "device-gone" {
		t.Fatalf("gone event: %+v", ev)
	}
	e.m.CheckAll(ctx)
	if ok := metric(t, e.m, "vco_agent_claim_checks_total", "result", "ok"); ok != 2*(n-1) {
		t.Fatalf("%v checks ok after reconcile and one periodic check, want %d", ok, 2*(n-1))
	}
}
