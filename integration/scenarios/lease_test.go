package scenarios

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// The lease scenarios run L1-L4 of the reservation scenarios again on a
// shared virtio-blk disk (share-rw=on), which has no reservations: the
// agent daemon in each guest fences it with the on-disk lease. Each step
// goes through the agent as the CSI node plugin would (`vco-agent volume
// ...`), and what reached the disk is read from its backing file on the
// host. The lease is not enforced by the storage: a node's writes stop
// because its own agent stops them, which is what these scenarios check.

type leasePair struct {
	l    *lab.Lab
	a, b *lab.Guest
}

func newLeasePair(t *testing.T, ctx context.Context) *leasePair {
	t.Helper()
	l := agentLab(t, ctx)
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 512}, lab.GuestConfig{Name: "node-b", MemMB: 512})
	if err != nil {
		t.Fatal(err)
	}
	p := &leasePair{l: l, a: gs[0], b: gs[1]}
	startAgent(t, ctx, p.a)
	startAgent(t, ctx, p.b)
	return p
}

// sharedDisk is a blank disk image for one scenario.
func (p *leasePair) sharedDisk(t *testing.T, name string) string {
	t.Helper()
	f := filepath.Join(p.l.Dir(), name+".img")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(f, 64<<20); err != nil {
		t.Fatal(err)
	}
	return f
}

// plug hot-plugs the image into g as a virtio-blk disk with serial id
// and returns its device node; it is unplugged when the test ends.
func plug(t *testing.T, ctx context.Context, g *lab.Guest, id, file string) string {
	t.Helper()
	if err := g.AttachDisk(ctx, lab.Disk{ID: id, Kind: lab.VirtioBlk, File: file, Serial: id}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.DetachDisk(context.Background(), id); err != nil {
			t.Errorf("unplugging %s from %s: %v", id, g.Name, err)
		}
	})
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	d, err := g.WaitDiskBySerial(wctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return "/dev/" + d.Name
}

func stagingOf(vol string) string {
	return "/var/lib/kubelet/plugins/kubernetes.io/csi/cloud.whitesky.csi/" + vol + "/globalmount"
}

// stage stages vol (the disk with serial id) through g's agent.
func stage(ctx context.Context, g *lab.Guest, vol, id string, grant ...string) (stageReply, error) {
	argv := []string{"volume", "stage", vol, "--serial", id, "--staging", stagingOf(vol)}
	for _, k := range grant {
		argv = append(argv, "--grant-node", g.UUID, "--grant-supersedes", k)
	}
	var st stageReply
	err := agentJSON(ctx, g, &st, argv...)
	return st, err
}

func mustStage(t *testing.T, ctx context.Context, g *lab.Guest, vol, id string, grant ...string) stageReply {
	t.Helper()
	st, err := stage(ctx, g, vol, id, grant...)
	if err != nil {
		t.Fatalf("%s: %v", g.Name, err)
	}
	if st.Fencing != "FENCING_METHOD_DISK_LEASE" {
		t.Fatalf("%s: %s staged with %s, want the disk lease", g.Name, vol, st.Fencing)
	}
	return st
}

// mustRefuseStage asserts that g's stage is refused naming holder.
func mustRefuseStage(t *testing.T, ctx context.Context, g *lab.Guest, vol, id string, holder *lab.Guest) {
	t.Helper()
	_, err := stage(ctx, g, vol, id)
	var ce *cliError
	if !errors.As(err, &ce) {
		t.Fatalf("%s: stage of %s while %s holds it: %v", g.Name, vol, holder.Name, err)
	}
	if !strings.Contains(ce.stderr, "FailedPrecondition") || !strings.Contains(ce.stderr, keyOf(holder)) || !strings.Contains(ce.stderr, holder.Name) {
		t.Fatalf("%s: the refusal does not name %s (key %s): %s", g.Name, holder.Name, keyOf(holder), ce.stderr)
	}
	t.Logf("%s: refused: %s", g.Name, ce.stderr)
}

func mustUnstage(t *testing.T, ctx context.Context, g *lab.Guest, vol string) {
	t.Helper()
	if err := agentJSON(ctx, g, nil, "volume", "unstage", vol, "--staging", stagingOf(vol)); err != nil {
		t.Fatalf("%s: %v", g.Name, err)
	}
}

func keyOf(g *lab.Guest) string {
	k, err := fence.KeyFromUUID(g.UUID)
	if err != nil {
		panic(err)
	}
	return k.String()
}

// writeFile writes marker into file in the volume's filesystem and syncs;
// it reports the shell's failure instead of failing the test.
func writeFile(ctx context.Context, g *lab.Guest, vol, file, marker string) error {
	r, err := g.Sh(ctx, fmt.Sprintf("printf %%s %s > %s/%s && sync", marker, stagingOf(vol), file))
	if err != nil {
		return err
	}
	if r.Exit != 0 {
		return fmt.Errorf("%s: writing %s: %s", g.Name, file, r)
	}
	return nil
}

func fileHas(t *testing.T, file, marker string) bool {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(b, []byte(marker))
}

// agentEvent is one line of `vco-agent events --json`.
type agentEvent struct {
	Type       string `json:"type"`
	Volume     string `json:"volume"`
	Device     string `json:"device"`
	Serial     string `json:"serial"`
	HolderKey  string `json:"holder_key"`
	HolderNode string `json:"holder_node"`
	Message    string `json:"message"`
	Time       string `json:"time"`
}

// waitEvent polls g's recent events until one of type typ matches.
func waitEvent(t *testing.T, ctx context.Context, g *lab.Guest, typ string, match func(agentEvent) bool, within time.Duration) agentEvent {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		r, err := g.Exec().Run(ctx, 0, "/bin/vco-agent", "events", "--json")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
			var e agentEvent
			if json.Unmarshal([]byte(line), &e) == nil && e.Type == typ && match(e) {
				return e
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %s event within %s; events:\n%s", g.Name, typ, within, r.Stdout)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func roFlag(t *testing.T, ctx context.Context, g *lab.Guest, dev string) string {
	t.Helper()
	out, err := g.MustSh(ctx, "cat /sys/block/"+strings.TrimPrefix(dev, "/dev/")+"/ro")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// TestLeaseScenarios: L1-L4, the hot-plug refusal and the agent restarts
// on a shared virtio-blk disk fenced by the on-disk lease.
func TestLeaseScenarios(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	p := newLeasePair(t, ctx)
	a, b := p.a, p.b

	t.Run("L1 double attach and hot-plug refusal", func(t *testing.T) { leaseL1DoubleAttachAndHotPlugRefusal(t, ctx, p, a, b) })

	t.Run("L2 handover", func(t *testing.T) { leaseL2Handover(t, ctx, p, a, b) })

	t.Run("L3 takeover with grant", func(t *testing.T) { leaseL3TakeoverWithGrant(t, ctx, p, a, b) })

	t.Run("L4 race", func(t *testing.T) { leaseL4Race(t, ctx, p, a, b) })

	t.Run("agent restarts", func(t *testing.T) { leaseAgentRestarts(t, ctx, p, a, b) })
}

func leaseL1DoubleAttachAndHotPlugRefusal(t *testing.T, ctx context.Context, p *leasePair, a *lab.Guest, b *lab.Guest) {
	img := p.sharedDisk(t, "lease-l1")
	plug(t, ctx, a, "lease-l1", img)
	mustStage(t, ctx, a, "vol-l1", "lease-l1")
	if err := writeFile(ctx, a, "vol-l1", "a", "L1-data-of-node-a"); err != nil {
		t.Fatal(err)
	}
	// The platform attaches the disk to B as well: B's agent refuses
	// it by itself, within a second of the disk's arrival.
	plugged := time.Now()
	devB := plug(t, ctx, b, "lease-l1", img)
	ev := waitEvent(t, ctx, b, "EVENT_TYPE_DISK_REFUSED", func(e agentEvent) bool { return e.Device == devB }, 30*time.Second)
	if ev.HolderKey != strings.TrimPrefix(keyOf(a), "0x") || ev.HolderNode != "node-a" || ev.Serial != "lease-l1" {
		t.Fatalf("node-b's refusal event does not name node-a: %+v", ev)
	}
	// The watcher's own measure, from the add uevent to the refusal
	// (the guest's clock is not the host's).
	lat, _ := b.MustSh(ctx, "grep 'disk held by another node refused' /run/agent.log | grep -o 'latency=[^ ]*' | tail -n1")
	t.Logf("node-b refused %s (%s after the uevent; hot-plug requested %s before the check): %s", devB, strings.TrimSpace(lat),
		time.Since(plugged).Round(time.Millisecond), ev.Message)
	if ro := roFlag(t, ctx, b, devB); ro != "1" {
		t.Fatalf("the refused disk is not read-only on node-b (ro=%s)", ro)
	}
	var disks struct {
		Disks []struct {
			Device     string `json:"device"`
			State      string `json:"state"`
			Fencing    string `json:"fencing"`
			HolderNode string `json:"holder_node"`
		} `json:"disks"`
	}
	if err := agentJSON(ctx, b, &disks, "disks"); err != nil {
		t.Fatal(err)
	}
	listed := false
	for _, d := range disks.Disks {
		listed = listed || (d.Device == devB && d.State == "CLAIM_STATE_REFUSED" && d.Fencing == "FENCING_METHOD_DISK_LEASE" && d.HolderNode == "node-a")
	}
	if !listed {
		t.Fatalf("node-b's disk list does not show the refused disk: %+v", disks)
	}
	mustRefuseStage(t, ctx, b, "vol-l1", "lease-l1", a)
	// Nothing B tries reaches the disk.
	if r, err := b.Sh(ctx, fmt.Sprintf("printf L1-data-of-node-b | dd of=%s bs=4096 seek=4000 conv=sync,fsync oflag=direct 2>&1", devB)); err != nil || r.Exit == 0 {
		t.Fatalf("node-b wrote to the refused disk: %v %v", r, err)
	}
	if !fileHas(t, img, "L1-data-of-node-a") || fileHas(t, img, "L1-data-of-node-b") {
		t.Fatal("the disk does not hold node-a's data only")
	}
	if err := writeFile(ctx, a, "vol-l1", "a2", "L1-more-of-node-a"); err != nil {
		t.Fatalf("node-a's claim is not intact after node-b's attempts: %v", err)
	}
	mustUnstage(t, ctx, a, "vol-l1")
}

func leaseL2Handover(t *testing.T, ctx context.Context, p *leasePair, a *lab.Guest, b *lab.Guest) {
	img := p.sharedDisk(t, "lease-l2")
	plug(t, ctx, a, "lease-l2", img)
	plug(t, ctx, b, "lease-l2", img)
	mustStage(t, ctx, a, "vol-l2", "lease-l2")
	if err := writeFile(ctx, a, "vol-l2", "a", "L2-data-of-node-a"); err != nil {
		t.Fatal(err)
	}
	mustUnstage(t, ctx, a, "vol-l2")
	mustStage(t, ctx, b, "vol-l2", "lease-l2")
	out, err := b.MustSh(ctx, "cat "+stagingOf("vol-l2")+"/a")
	if err != nil || out != "L2-data-of-node-a" {
		t.Fatalf("node-b reads %q (%v), want node-a's data", out, err)
	}
	if err := writeFile(ctx, b, "vol-l2", "b", "L2-data-of-node-b"); err != nil {
		t.Fatal(err)
	}
	mustRefuseStage(t, ctx, a, "vol-l2", "lease-l2", b)
	if !fileHas(t, img, "L2-data-of-node-b") {
		t.Fatal("node-b's data did not reach the disk")
	}
	mustUnstage(t, ctx, b, "vol-l2")
}

func leaseL3TakeoverWithGrant(t *testing.T, ctx context.Context, p *leasePair, a *lab.Guest, b *lab.Guest) {
	img := p.sharedDisk(t, "lease-l3")
	devA := plug(t, ctx, a, "lease-l3", img)
	plug(t, ctx, b, "lease-l3", img)
	mustStage(t, ctx, a, "vol-l3", "lease-l3")
	if err := writeFile(ctx, a, "vol-l3", "a", "L3-before-of-node-a"); err != nil {
		t.Fatal(err)
	}
	// A grant naming another key does not let B in.
	if _, err := stage(ctx, b, "vol-l3", "lease-l3", "0x5643000000000001"); err == nil || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("node-b's stage with a grant for another key: %v", err)
	}
	st := mustStage(t, ctx, b, "vol-l3", "lease-l3", keyOf(a))
	t.Logf("node-b took over: %+v", st)
	// A is alive: B's stage ended on A's fenced mark, which A's agent
	// wrote once it had stopped and drained A's I/O, not on the
	// expiry bound.
	logHas := func(g *lab.Guest, line string) bool {
		out, err := g.MustSh(ctx, "grep '"+line+"' /run/agent.log | grep -c 'volume=vol-l3' || true")
		return err == nil && strings.TrimSpace(out) != "0"
	}
	if !logHas(b, "superseded holder acknowledged the takeover") || !logHas(a, "lease slot marked fenced") {
		t.Fatalf("the takeover of a live holder did not end on its fenced mark\nnode-a:\n%s\nnode-b:\n%s", agentLog(ctx, a), agentLog(ctx, b))
	}
	waitEvent(t, ctx, b, "EVENT_TYPE_TAKEOVER_GRANTED", func(e agentEvent) bool { return e.Volume == "vol-l3" }, 10*time.Second)
	// A's agent finds the higher claim at its next renewal and stops
	// I/O on its own.
	fev := waitEvent(t, ctx, a, "EVENT_TYPE_DISK_FENCED", func(e agentEvent) bool { return e.Volume == "vol-l3" }, 30*time.Second)
	t.Logf("node-a fenced itself: %s", fev.Message)
	if ro := roFlag(t, ctx, a, devA); ro != "1" {
		t.Fatalf("node-a's disk is writable after it lost the lease (ro=%s)", ro)
	}
	if err := writeFile(ctx, a, "vol-l3", "late", "L3-after-of-node-a"); err == nil {
		t.Fatal("node-a could still write its filesystem after losing the lease")
	}
	if err := writeFile(ctx, b, "vol-l3", "b", "L3-after-of-node-b"); err != nil {
		t.Fatal(err)
	}
	// A never claims again by itself, nor without a grant.
	time.Sleep(4 * time.Second)
	if _, err := stage(ctx, a, "vol-l3", "lease-l3"); err == nil || !strings.Contains(err.Error(), "FailedPrecondition") || !strings.Contains(err.Error(), "grant") {
		t.Fatalf("node-a's stage after losing the lease: %v", err)
	}
	if fileHas(t, img, "L3-after-of-node-a") || !fileHas(t, img, "L3-before-of-node-a") || !fileHas(t, img, "L3-after-of-node-b") {
		t.Fatal("the disk does not hold exactly node-a's data from before and node-b's from after the takeover")
	}
	mustUnstage(t, ctx, b, "vol-l3")
	mustUnstage(t, ctx, a, "vol-l3")
}

func leaseL4Race(t *testing.T, ctx context.Context, p *leasePair, a *lab.Guest, b *lab.Guest) {
	img := p.sharedDisk(t, "lease-l4")
	plug(t, ctx, a, "lease-l4", img)
	plug(t, ctx, b, "lease-l4", img)
	wins := map[string]int{}
	for round := 1; round <= 4; round++ {
		var wg sync.WaitGroup
		var ea, eb error
		wg.Add(2)
		go func() { defer wg.Done(); _, ea = stage(ctx, a, "vol-l4", "lease-l4") }()
		go func() { defer wg.Done(); _, eb = stage(ctx, b, "vol-l4", "lease-l4") }()
		wg.Wait()
		if (ea == nil) == (eb == nil) {
			t.Fatalf("round %d: node-a: %v; node-b: %v; want exactly one winner", round, ea, eb)
		}
		winner, loserErr := a, eb
		if eb == nil {
			winner, loserErr = b, ea
		}
		if !strings.Contains(loserErr.Error(), keyOf(winner)) || !strings.Contains(loserErr.Error(), winner.Name) {
			t.Fatalf("round %d: the loser's refusal does not name the winner %s: %v", round, winner.Name, loserErr)
		}
		wins[winner.Name]++
		mustUnstage(t, ctx, winner, "vol-l4")
	}
	t.Logf("4 rounds, exactly one winner each: %v", wins)
}

func leaseAgentRestarts(t *testing.T, ctx context.Context, p *leasePair, a *lab.Guest, b *lab.Guest) {
	img := p.sharedDisk(t, "lease-rs")
	devA := plug(t, ctx, a, "lease-rs", img)
	mustStage(t, ctx, a, "vol-rs", "lease-rs")
	if err := writeFile(ctx, a, "vol-rs", "first", "RS-first-of-node-a"); err != nil {
		t.Fatal(err)
	}
	// The disk is attached to B while B's agent is down (at boot, or
	// during a restart) and A holds it: B's agent refuses it at start,
	// before it serves, with no uevent to go by.
	began := time.Now()
	stopAgent(t, ctx, b)
	devB := plug(t, ctx, b, "lease-rs", img)
	if ro := roFlag(t, ctx, b, devB); ro != "0" {
		t.Fatalf("precondition: the disk is read-only on node-b before its agent starts (ro=%s)", ro)
	}
	startAgent(t, ctx, b)
	if ro := roFlag(t, ctx, b, devB); ro != "1" {
		t.Fatalf("node-b's agent serves, and the disk node-a holds is writable on node-b (ro=%s)", ro)
	}
	ev := waitEvent(t, ctx, b, "EVENT_TYPE_DISK_REFUSED", func(e agentEvent) bool { return e.Device == devB }, 10*time.Second)
	if ev.HolderNode != "node-a" || !strings.Contains(agentLog(ctx, b), "start-up scan") {
		t.Fatalf("node-b's refusal at start does not name node-a or the start-up scan: %+v\n%s", ev, agentLog(ctx, b))
	}
	if r, err := b.Sh(ctx, fmt.Sprintf("printf RS-raw-of-node-b | dd of=%s bs=4096 seek=4000 conv=sync,fsync oflag=direct 2>&1", devB)); err != nil || r.Exit == 0 {
		t.Fatalf("node-b wrote to the disk node-a holds: %v %v", r, err)
	}
	t.Logf("node-b's agent restarted with the held disk attached and refused it at start (%s for this step)", time.Since(began).Round(time.Millisecond))
	// A's agent restarts while it holds the claim: re-verified, kept,
	// renewed by the new process.
	stopAgent(t, ctx, a)
	startAgent(t, ctx, a)
	time.Sleep(10 * time.Second) // beyond the 8s fail bound
	var disks struct {
		Disks []struct {
			VolumeID string `json:"volume_id"`
			State    string `json:"state"`
		} `json:"disks"`
	}
	if err := agentJSON(ctx, a, &disks, "disks"); err != nil {
		t.Fatal(err)
	}
	held := false
	for _, d := range disks.Disks {
		held = held || (d.VolumeID == "vol-rs" && d.State == "CLAIM_STATE_HELD")
	}
	if !held {
		t.Fatalf("node-a's claim is not held after its agent restarted: %+v", disks)
	}
	if err := writeFile(ctx, a, "vol-rs", "a", "RS-data-of-node-a"); err != nil {
		t.Fatal(err)
	}
	mustRefuseStage(t, ctx, b, "vol-rs", "lease-rs", a)
	// A's agent is down when B takes over with the grant: B waits out
	// the expiry bound; A's agent, back, reports the loss at start.
	stopAgent(t, ctx, a)
	mustStage(t, ctx, b, "vol-rs", "lease-rs", keyOf(a))
	startAgent(t, ctx, a)
	fev := waitEvent(t, ctx, a, "EVENT_TYPE_DISK_FENCED", func(e agentEvent) bool { return e.Volume == "vol-rs" }, 15*time.Second)
	if fev.HolderKey != strings.TrimPrefix(keyOf(b), "0x") {
		t.Fatalf("node-a's fenced event does not name node-b's key: %+v", fev)
	}
	if ro := roFlag(t, ctx, a, devA); ro != "1" {
		t.Fatalf("node-a's disk is writable after its claim was found lost at start (ro=%s)", ro)
	}
	if err := writeFile(ctx, a, "vol-rs", "late", "RS-late-of-node-a"); err == nil {
		t.Fatal("node-a could still write after its claim was found lost")
	}
	mustUnstage(t, ctx, b, "vol-rs")
	mustUnstage(t, ctx, a, "vol-rs")
	if fileHas(t, img, "RS-late-of-node-a") || fileHas(t, img, "RS-raw-of-node-b") || !fileHas(t, img, "RS-first-of-node-a") {
		t.Fatal("a late write of node-a, or node-b's raw write while node-a held the disk, reached the disk")
	}
}
