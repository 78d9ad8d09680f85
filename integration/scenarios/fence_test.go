package scenarios

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/lab/labtest"
)

const blockSize = labtest.BlockSize

// pair is a lab with two guests, node-a and node-b, and no disks yet:
// each scenario hot-plugs its own LUN, the way the cloud attaches a disk.
type pair struct {
	l    *lab.Lab
	a, b *lab.Guest
}

func newPair(t *testing.T, ctx context.Context) *pair {
	t.Helper()
	l := labtest.Start(t, ctx, 20, nil)
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a"}, lab.GuestConfig{Name: "node-b"})
	if err != nil {
		t.Fatal(err)
	}
	return &pair{l: l, a: gs[0], b: gs[1]}
}

// newLUN creates a LUN for one scenario.
func (p *pair) newLUN(t *testing.T, ctx context.Context, name string) *lab.LUN {
	t.Helper()
	lun, err := p.l.AddLUN(ctx, name, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	return lun
}

// attach hot-plugs lun into g as a scsi-block disk and returns its device
// node in the guest; the disk is unplugged when the test ends.
func attach(t *testing.T, ctx context.Context, g *lab.Guest, lun *lab.LUN) string {
	t.Helper()
	if err := g.AttachDisk(ctx, lab.Disk{ID: lun.Serial, Kind: lab.SCSIBlock, LUN: lun}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.DetachDisk(context.Background(), lun.Serial); err != nil {
			t.Errorf("unplugging %s from %s: %v", lun.Serial, g.Name, err)
		}
	})
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	d, err := g.WaitDiskBySerial(wctx, lun.Serial)
	if err != nil {
		t.Fatal(err)
	}
	return "/dev/" + d.Name
}

// readBlock reads block n of dev in the guest, without the page cache.
func readBlock(t *testing.T, ctx context.Context, g *lab.Guest, dev string, n int) string {
	t.Helper()
	out, err := g.MustSh(ctx, fmt.Sprintf("dd if=%s bs=%d skip=%d count=1 iflag=direct 2>/dev/null | tr -d '\\000'", dev, blockSize, n))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// backing reads block n of the LUN's backing file on the host: the truth
// about what reached the disk.
func backing(t *testing.T, lun *lab.LUN, n int) string {
	t.Helper()
	f, err := os.ReadFile(lun.File)
	if err != nil {
		t.Fatal(err)
	}
	return string(bytes.TrimRight(f[n*blockSize:(n+1)*blockSize], "\x00"))
}

// backingHas reports whether marker appears anywhere in the LUN.
func backingHas(t *testing.T, lun *lab.LUN, marker string) bool {
	t.Helper()
	f, err := os.ReadFile(lun.File)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(f, []byte(marker))
}

func mustAcquire(t *testing.T, ctx context.Context, d fenceDriver, g *lab.Guest, dev string, grant ...string) outcome {
	t.Helper()
	o, err := d.Acquire(ctx, g, dev, grant...)
	if err != nil {
		t.Fatal(err)
	}
	if !o.Won {
		t.Fatalf("%s: acquire of %s refused (holder %s): %s", g.Name, dev, o.Holder, o.Output)
	}
	return o
}

// mustRefuse asserts that g's acquire is refused and that the refusal names
// the holder's key (and node, where the driver maps keys to nodes).
func mustRefuse(t *testing.T, ctx context.Context, d fenceDriver, g *lab.Guest, dev string, holder *lab.Guest, grant ...string) {
	t.Helper()
	o, err := d.Acquire(ctx, g, dev, grant...)
	if err != nil {
		t.Fatal(err)
	}
	if o.Won {
		t.Fatalf("%s: acquire of %s succeeded while %s holds it: %s", g.Name, dev, holder.Name, o.Output)
	}
	if want := d.Key(holder); o.Holder != want {
		t.Fatalf("%s: refusal names holder key %q, want %s's key %s: %s", g.Name, o.Holder, holder.Name, want, o.Output)
	}
	if d.NamesNodes() && o.HolderNode != holder.Name {
		t.Fatalf("%s: refusal names holder node %q, want %s: %s", g.Name, o.HolderNode, holder.Name, o.Output)
	}
	t.Logf("%s: refused: %s", g.Name, strings.TrimSpace(o.Output))
}

// drivers are the fencing implementations the scenarios run with: the
// project's engine, and sg_persist as the reference it must agree with.
// reservationAsSeenBy reads dev's reservation with sg_persist in g and
// returns the holder key and the type, so every driver's claim is checked
// by the reference tool from the other node.
func reservationAsSeenBy(t *testing.T, ctx context.Context, g *lab.Guest, dev string) (key, typ string) {
	t.Helper()
	out, err := g.MustSh(ctx, "sg_persist -n -i -r "+dev)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		if k, ok := strings.CutPrefix(line, "Key="); ok {
			key = k
		}
		if _, ty, ok := strings.Cut(line, "type: "); ok {
			typ = ty
		}
	}
	return key, typ
}

func drivers(nodes ...*lab.Guest) []fenceDriver {
	return []fenceDriver{agentDriver{nodes: nodes}, sgPersistDriver{}}
}

// TestFenceScenarios runs the fencing scenarios of docs/architecture.md, Safety properties (P1-P4) on
// two guests, once per driver.
func TestFenceScenarios(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	p := newPair(t, ctx)
	a, b := p.a, p.b
	for _, d := range drivers(a, b) {
		ka, kb := d.Key(a), d.Key(b)
		if ka == kb {
			t.Fatalf("%s gives both nodes key %s", d.Name(), ka)
		}
		f := &fenceRun{p: p, d: d, ka: ka, kb: kb}
		t.Run(d.Name()+"/L1 double attach", func(t *testing.T) { f.l1DoubleAttach(t, ctx) })
		t.Run(d.Name()+"/L2 handover", func(t *testing.T) { f.l2Handover(t, ctx) })
		t.Run(d.Name()+"/L3 takeover with grant", func(t *testing.T) { f.l3TakeoverWithGrant(t, ctx) })
		t.Run(d.Name()+"/L4 race", func(t *testing.T) { f.l4Race(t, ctx) })
		t.Run(d.Name()+"/probe", func(t *testing.T) { f.probe(t, ctx) })
	}
}

// fenceRun is one driver's run of the scenarios on the pair, with the
// nodes' keys.
type fenceRun struct {
	p      *pair
	d      fenceDriver
	ka, kb string
}

// lunName names a LUN of this driver's run.
func (f *fenceRun) lunName(s string) string { return strings.ReplaceAll(f.d.Name(), "_", "") + "-" + s }

// l1DoubleAttach: the disk A holds and writes is attached to B as well;
// B sees A's reservation, is refused naming A, and none of its writes
// reach the disk; A's claim stays intact.
func (f *fenceRun) l1DoubleAttach(t *testing.T, ctx context.Context) {
	p, d, a, b, ka := f.p, f.d, f.p.a, f.p.b, f.ka
	lun := p.newLUN(t, ctx, f.lunName("l1"))
	devA := attach(t, ctx, a, lun)
	mustAcquire(t, ctx, d, a, devA)
	labtest.MustWrite(t, ctx, a, devA, 0, "L1-data-of-node-a")
	// The same disk now attached to B as well.
	devB := attach(t, ctx, b, lun)
	// A type under which a registered non-holder cannot write.
	if key, typ := reservationAsSeenBy(t, ctx, b, devB); key != ka || (typ != "Write Exclusive" && typ != "Exclusive Access") {
		t.Fatalf("node-b sees reservation key %q type %q; want node-a's key %s, Write Exclusive or Exclusive Access", key, typ, ka)
	}
	mustRefuse(t, ctx, d, b, devB, a)
	labtest.MustNotWrite(t, ctx, b, devB, 0, "L1-data-of-node-b")
	labtest.MustNotWrite(t, ctx, b, devB, 1, "L1-data-of-node-b")
	if got := backing(t, lun, 0); got != "L1-data-of-node-a" {
		t.Errorf("block 0 of the LUN holds %q, want node-a's data", got)
	}
	if backingHas(t, lun, "L1-data-of-node-b") {
		t.Error("node-b's data reached the LUN")
	}
	if ok, detail, err := d.Check(ctx, a, devA); err != nil || !ok {
		t.Errorf("node-a's claim is not intact after node-b's attempts (%v): %s", err, detail)
	}
	if err := d.Release(ctx, a, devA); err != nil {
		t.Fatal(err)
	}
}

// l2Handover: A writes and releases; B acquires, reads A's data and
// writes its own; a late write of A does not land.
func (f *fenceRun) l2Handover(t *testing.T, ctx context.Context) {
	p, d, a, b := f.p, f.d, f.p.a, f.p.b
	lun := p.newLUN(t, ctx, f.lunName("l2"))
	devA, devB := attach(t, ctx, a, lun), attach(t, ctx, b, lun)
	mustAcquire(t, ctx, d, a, devA)
	labtest.MustWrite(t, ctx, a, devA, 0, "L2-data-of-node-a")
	if err := d.Release(ctx, a, devA); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, ctx, d, b, devB)
	if got := readBlock(t, ctx, b, devB, 0); got != "L2-data-of-node-a" {
		t.Errorf("node-b reads %q from block 0, want node-a's data", got)
	}
	labtest.MustWrite(t, ctx, b, devB, 1, "L2-data-of-node-b")
	if got := backing(t, lun, 1); got != "L2-data-of-node-b" {
		t.Errorf("block 1 of the LUN holds %q, want node-b's data", got)
	}
	labtest.MustNotWrite(t, ctx, a, devA, 2, "L2-late-write-of-node-a")
	if err := d.Release(ctx, b, devB); err != nil {
		t.Fatal(err)
	}
}

// l3TakeoverWithGrant: B, with a grant naming A's key (and not with one
// naming another), takes the disk over from A; A's writes stop landing,
// its check reports the loss, it does not register again, and the data of
// both before and after the takeover is where it belongs.
func (f *fenceRun) l3TakeoverWithGrant(t *testing.T, ctx context.Context) {
	p, d, a, b, ka, kb := f.p, f.d, f.p.a, f.p.b, f.ka, f.kb
	lun := p.newLUN(t, ctx, f.lunName("l3"))
	devA, devB := attach(t, ctx, a, lun), attach(t, ctx, b, lun)
	mustAcquire(t, ctx, d, a, devA)
	labtest.MustWrite(t, ctx, a, devA, 0, "L3-before-of-node-a")
	// A grant that names some other key does not let B in.
	mustRefuse(t, ctx, d, b, devB, a, "0x5643000000000001")
	o := mustAcquire(t, ctx, d, b, devB, ka)
	if d.NamesNodes() && (len(o.Preempted) != 1 || o.Preempted[0] != ka) {
		t.Errorf("the takeover reports preempted keys %v, want node-a's %s: %s", o.Preempted, ka, o.Output)
	}
	// Read on node-b: a read on node-a would consume the unit
	// attention (reservations preempted) that node-a's own fencing
	// is to notice.
	if key, _ := reservationAsSeenBy(t, ctx, b, devB); key != kb {
		t.Errorf("the reservation key after the takeover is %q, want node-b's %s", key, kb)
	}
	labtest.MustNotWrite(t, ctx, a, devA, 1, "L3-after-of-node-a")
	if ok, detail, err := d.Check(ctx, a, devA); err != nil || ok {
		t.Errorf("node-a's check does not report the claim lost (%v): %s", err, detail)
	}
	labtest.MustWrite(t, ctx, b, devB, 2, "L3-after-of-node-b")
	labtest.MustNotWrite(t, ctx, a, devA, 3, "L3-later-of-node-a")
	f.checkAfterTakeover(t, ctx, lun, devA)
	if err := d.Release(ctx, b, devB); err != nil {
		t.Fatal(err)
	}
}

// checkAfterTakeover: A must not have registered again on its own, none of
// its writes after the preempt landed, and the blocks hold A's data from
// before and B's from after.
func (f *fenceRun) checkAfterTakeover(t *testing.T, ctx context.Context, lun *lab.LUN, devA string) {
	t.Helper()
	keys, err := f.p.a.MustSh(ctx, "sg_persist -n -i -k "+devA)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(keys, f.ka) || !strings.Contains(keys, f.kb) {
		t.Errorf("after the takeover the LUN's keys should be node-b's only:\n%s", keys)
	}
	if backingHas(t, lun, "L3-after-of-node-a") || backingHas(t, lun, "L3-later-of-node-a") {
		t.Error("a write of node-a landed after the preempt")
	}
	if got := backing(t, lun, 0); got != "L3-before-of-node-a" {
		t.Errorf("block 0 holds %q, want node-a's data from before the takeover", got)
	}
	if got := backing(t, lun, 2); got != "L3-after-of-node-b" {
		t.Errorf("block 2 holds %q, want node-b's data", got)
	}
}

// l4Race: both acquire at once, 20 rounds; exactly one wins each, and the
// loser's refusal names the winner.
func (f *fenceRun) l4Race(t *testing.T, ctx context.Context) {
	p, d, a, b := f.p, f.d, f.p.a, f.p.b
	lun := p.newLUN(t, ctx, f.lunName("l4"))
	devA, devB := attach(t, ctx, a, lun), attach(t, ctx, b, lun)
	wins := map[string]int{}
	for round := 1; round <= 20; round++ {
		var wg sync.WaitGroup
		var oa, ob outcome
		var ea, eb error
		start := make(chan struct{})
		wg.Add(2)
		go func() { defer wg.Done(); <-start; oa, ea = d.Acquire(ctx, a, devA) }()
		go func() { defer wg.Done(); <-start; ob, eb = d.Acquire(ctx, b, devB) }()
		close(start)
		wg.Wait()
		if ea != nil || eb != nil {
			t.Fatalf("round %d: %v %v", round, ea, eb)
		}
		if oa.Won == ob.Won {
			t.Fatalf("round %d: node-a won %v, node-b won %v; want exactly one winner\nA: %s\nB: %s", round, oa.Won, ob.Won, oa.Output, ob.Output)
		}
		winner, wdev, loser := a, devA, ob
		if ob.Won {
			winner, wdev, loser = b, devB, oa
		}
		if loser.Holder != d.Key(winner) || (d.NamesNodes() && loser.HolderNode != winner.Name) {
			t.Fatalf("round %d: the loser's refusal names %q (node %q), want the winner %s's key %s", round, loser.Holder, loser.HolderNode, winner.Name, d.Key(winner))
		}
		wins[winner.Name]++
		if err := d.Release(ctx, winner, wdev); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("20 rounds, exactly one winner each: %v", wins)
}

// probe: the driver's probe finds persistent reservations on a scsi-block
// LUN, and none on an emulated SCSI disk or a virtio-blk disk.
func (f *fenceRun) probe(t *testing.T, ctx context.Context) {
	p, a := f.p, f.p.a
	pr := p.newLUN(t, ctx, f.lunName("probe-pr"))
	hd := p.newLUN(t, ctx, f.lunName("probe-hd"))
	file := p.l.Dir() + "/" + f.lunName("probe-vblk") + ".img"
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		disk lab.Disk
		pr   bool
	}{
		{lab.Disk{ID: pr.Serial, Kind: lab.SCSIBlock, LUN: pr}, true},
		{lab.Disk{ID: hd.Serial, Kind: lab.SCSIHD, LUN: hd, Serial: hd.Serial}, false},
		{lab.Disk{ID: "vblk-probe", Kind: lab.VirtioBlk, File: file, Serial: "vblk-probe"}, false},
	}
	for _, c := range cases {
		if err := a.AttachDisk(ctx, c.disk); err != nil {
			t.Fatal(err)
		}
		serial := c.disk.Serial
		if serial == "" {
			serial = c.disk.LUN.Serial
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		gd, err := a.WaitDiskBySerial(wctx, serial)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		got, detail, err := f.d.Probe(ctx, a, "/dev/"+gd.Name)
		if err != nil {
			t.Fatal(err)
		}
		if got != c.pr {
			t.Errorf("probe of %s (%s): PR %v, want %v: %s", c.disk.ID, c.disk.Kind, got, c.pr, detail)
		}
		if err := a.DetachDisk(ctx, c.disk.ID); err != nil {
			t.Fatal(err)
		}
	}
}
