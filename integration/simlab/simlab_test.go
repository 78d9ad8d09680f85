package simlab_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

func startEnv(t *testing.T, o simlab.Options) *simlab.Env {
	t.Helper()
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	cfg, err := simlab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	o.Lab = cfg
	o.Log = testWriter{t}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	env, err := simlab.Start(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := env.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return env
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// pciOf returns the PCI slot (as "00:NN") in the sysfs path of the guest's
// block device name.
func pciOf(ctx context.Context, t *testing.T, g *lab.Guest, name string) string {
	t.Helper()
	out, err := g.MustSh(ctx, "readlink -f /sys/block/"+name)
	if err != nil {
		t.Fatal(err)
	}
	for _, part := range strings.Split(strings.TrimSpace(out), "/") {
		if strings.HasPrefix(part, "0000:00:") {
			return strings.TrimPrefix(part, "0000:")[:5]
		}
	}
	t.Fatalf("%s: no PCI function in %s", name, out)
	return ""
}

// TestAttachDetachSnapshotClone drives the simulator's API with the real
// client and checks what the guest sees: the disk at the PCI slot the API
// reports with the disk id as serial, in both presentations; gone after a
// detach; a clone of a snapshot holding the data written before it.
func TestAttachDetachSnapshotClone(t *testing.T) {
	env := startEnv(t, simlab.Options{Guests: []string{"node-a"}, NoNodeStack: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s := &simlabVM{ctx: ctx, env: env, g: env.Guest("node-a"), vm: env.VMs["node-a"], cs: "cs-" + simlab.Location}

	for _, kind := range []lab.DiskKind{lab.SCSIBlock, lab.VirtioBlk} {
		t.Run(string(kind), func(t *testing.T) {
			c := env.Cloud
			id, err := c.CreateDisk(ctx, simlab.Location, cloud.DiskSpec{Name: "t-" + string(kind), Description: "simlab test", SizeGiB: 1})
			if err != nil {
				t.Fatal(err)
			}
			d := s.attachedWhereTheAPISays(t, kind, id)
			// Data written in the guest, a snapshot, a clone: the clone holds it.
			if _, err := s.g.MustSh(ctx, fmt.Sprintf("echo simlab-%s-data | dd of=/dev/%s bs=512 count=1 conv=sync,fsync oflag=direct", kind, d.Name)); err != nil {
				t.Fatal(err)
			}
			snap, clone := s.cloneHoldsTheData(t, kind, id)
			if err := c.DetachDisk(ctx, s.cs, s.vm, id); err != nil {
				t.Fatal(err)
			}
			if _, err := s.g.DiskBySerial(ctx, strconv.FormatInt(id, 10)); err == nil {
				t.Errorf("disk %d still in the guest after detach", id)
			}
			s.cloneAttachesWithTheData(t, kind, clone)
			s.deleteAll(t, id, snap, clone)
		})
	}
}

// simlabVM is the simulator in lab mode and the VM of its one guest.
type simlabVM struct {
	ctx context.Context
	env *simlab.Env
	g   *lab.Guest
	vm  int64
	cs  string
}

// attachedWhereTheAPISays attaches disk id as kind: the guest sees it,
// with the disk id as serial, at the PCI slot the API lists, and a
// scsi-block disk with its SCSI generic node. It returns the guest's
// disk.
func (s *simlabVM) attachedWhereTheAPISays(t *testing.T, kind lab.DiskKind, id int64) *lab.GuestDisk {
	t.Helper()
	ctx, c := s.ctx, s.env.Cloud
	s.env.Backend.SetKind(id, kind)
	if err := c.AttachDisk(ctx, s.cs, s.vm, id); err != nil {
		t.Fatal(err)
	}
	disks, err := c.ListVMDisks(ctx, s.cs, s.vm)
	if err != nil {
		t.Fatal(err)
	}
	slot := -1
	for _, d := range disks {
		if d.ID == id {
			slot = d.PCISlot
		}
	}
	if slot < 0 {
		t.Fatalf("disk %d not listed on VM %d: %+v", id, s.vm, disks)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	d, err := s.g.WaitDiskBySerial(wctx, strconv.FormatInt(id, 10))
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := pciOf(ctx, t, s.g, d.Name), fmt.Sprintf("00:%02x", slot); got != want {
		t.Errorf("disk %d is at PCI %s in the guest; the API says %s", id, got, want)
	}
	if kind == lab.SCSIBlock && d.SG == "" {
		t.Errorf("scsi-block disk %s has no SCSI generic node: PR commands could not reach the target", d.Name)
	}
	return d
}

// cloneHoldsTheData snapshots disk id and clones the snapshot: the
// clone's file starts with the data written before. It returns the
// snapshot and the clone.
func (s *simlabVM) cloneHoldsTheData(t *testing.T, kind lab.DiskKind, id int64) (snap string, clone int64) {
	t.Helper()
	ctx, c := s.ctx, s.env.Cloud
	snap, err := c.CreateSnapshot(ctx, simlab.Location, id, "s1")
	if err != nil {
		t.Fatal(err)
	}
	clone, err = c.CloneSnapshot(ctx, simlab.Location, id, snap, "t-clone-"+string(kind), "clone")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(s.env.Backend.DiskFile(clone))
	if err != nil {
		t.Fatal(err)
	}
	if want := "simlab-" + string(kind) + "-data"; !strings.HasPrefix(string(b[:64]), want) {
		t.Errorf("clone %d starts with %q, want %q", clone, b[:32], want)
	}
	return snap, clone
}

// cloneAttachesWithTheData: the clone attaches in its turn, with its own
// serial, and the guest reads the data from it; then it is detached.
func (s *simlabVM) cloneAttachesWithTheData(t *testing.T, kind lab.DiskKind, clone int64) {
	t.Helper()
	ctx, c := s.ctx, s.env.Cloud
	s.env.Backend.SetKind(clone, kind)
	if err := c.AttachDisk(ctx, s.cs, s.vm, clone); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	cd, err := s.g.WaitDiskBySerial(wctx, strconv.FormatInt(clone, 10))
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	out, err := s.g.MustSh(ctx, "dd if=/dev/"+cd.Name+" bs=512 count=1 iflag=direct 2>/dev/null | head -c 40")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out, "simlab-"+string(kind)+"-data") {
		t.Errorf("clone read in the guest: %q", out)
	}
	if err := c.DetachDisk(ctx, s.cs, s.vm, clone); err != nil {
		t.Fatal(err)
	}
}

// deleteAll deletes the clone, the snapshot and the disk; the deleted
// disk's file goes.
func (s *simlabVM) deleteAll(t *testing.T, id int64, snap string, clone int64) {
	t.Helper()
	ctx, c := s.ctx, s.env.Cloud
	for _, del := range []int64{clone} {
		if err := c.DeleteDisk(ctx, simlab.Location, del); err != nil {
			t.Error(err)
		}
	}
	if err := c.DeleteSnapshot(ctx, simlab.Location, id, snap); err != nil {
		t.Error(err)
	}
	if err := c.DeleteDisk(ctx, simlab.Location, id); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(s.env.Backend.DiskFile(id)); !os.IsNotExist(err) {
		t.Errorf("disk file of deleted disk %d: %v", id, err)
	}
}

// TestResizeRefusedWhileAttached: tgtd cannot grow a LUN in use, and the
// backend says so instead of growing only the file.
func TestResizeRefusedWhileAttached(t *testing.T) {
	env := startEnv(t, simlab.Options{Guests: []string{"node-a"}, NoNodeStack: true})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, vm, cs := env.Cloud, env.VMs["node-a"], "cs-"+simlab.Location
	id, err := c.CreateDisk(ctx, simlab.Location, cloud.DiskSpec{Name: "grow", Description: "", SizeGiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ResizeDisk(ctx, simlab.Location, id, 2); err != nil {
		t.Fatalf("resize of a detached disk: %v", err)
	}
	if st, _ := os.Stat(env.Backend.DiskFile(id)); st == nil || st.Size() != 2<<30 {
		t.Fatalf("disk file after resize: %v", st)
	}
	if err := c.AttachDisk(ctx, cs, vm, id); err != nil {
		t.Fatal(err)
	}
	g := env.Guest("node-a")
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	d, err := g.WaitDiskBySerial(wctx, strconv.FormatInt(id, 10))
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	out, err := g.MustSh(ctx, "cat /sys/block/"+d.Name+"/size")
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != strconv.Itoa(2<<30/512) {
		t.Errorf("guest sees %s sectors, want %d", strings.TrimSpace(out), 2<<30/512)
	}
	err = c.ResizeDisk(ctx, simlab.Location, id, 3)
	if err == nil || !strings.Contains(err.Error(), "while a guest is logged in") {
		t.Errorf("resize of an attached disk: %v, want the lab-mode refusal", err)
	}
}
