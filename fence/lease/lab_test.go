package lease_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

const (
	labUUIDA = "6a1f0c52-3b7e-4d21-9f80-1c2d3e4f5a6b"
	labUUIDB = "0b9e8d7c-6f5a-4e3d-8c2b-1a0f9e8d7c6b"
)

// Lease timing for TCG guests, whose I/O is slow and irregular: two guests
// share the host's cores, and a lease I/O there can take most of a second.
var labLease = lease.Timing{IOTimeout: time.Second, Renew: time.Second, Fail: 4 * time.Second}

var labTiming = []string{"--io-timeout", labLease.IOTimeout.String(), "--renew", labLease.Renew.String(),
	"--fail", labLease.Fail.String(), "--watchdog", labLease.Watchdog.String()}

type labNode struct {
	t    *testing.T
	ctx  context.Context
	g    *lab.Guest
	uuid string
	name string
	dev  string
}

func (n *labNode) argv(sub string, extra ...string) []string {
	a := []string{"/bin/vco-agent", "lease", sub, n.dev, "--uuid", n.uuid, "--name", n.name,
		"--node", "node-a=" + labUUIDA, "--node", "node-b=" + labUUIDB}
	return append(append(a, labTiming...), extra...)
}

// run runs a lease subcommand to completion.
func (n *labNode) run(sub string, extra ...string) (int, string) {
	n.t.Helper()
	r, err := n.g.Exec().Run(n.ctx, 2*time.Minute, n.argv(sub, extra...)...)
	if err != nil {
		n.t.Fatal(err)
	}
	return r.Exit, r.Stdout + r.Stderr
}

// hold starts `lease acquire` in the background and waits until it has
// decided: claimed (true) or ended (false, with its exit code and output).
func (n *labNode) hold(extra ...string) (job int, claimed bool, exit int, out string) {
	n.t.Helper()
	job, err := n.g.Exec().Start(n.ctx, n.argv("acquire", extra...)...)
	if err != nil {
		n.t.Fatal(err)
	}
	deadline := time.Now().Add(90 * time.Second)
	for time.Now().Before(deadline) {
		r, err := n.g.Exec().Wait(n.ctx, job, 500*time.Millisecond)
		if err != nil {
			n.t.Fatal(err)
		}
		if !r.TimedOut {
			return job, false, r.Exit, r.Stdout + r.Stderr
		}
		if strings.Contains(r.Stdout, "claimed") || strings.Contains(r.Stdout, "resumed") {
			return job, true, 0, r.Stdout
		}
	}
	n.t.Fatalf("%s: acquire undecided after 90 s", n.name)
	return
}

// stop ends a holding job with SIGTERM and returns how it ended.
func (n *labNode) stop(job int) (int, string) {
	n.t.Helper()
	if err := n.g.Exec().Kill(n.ctx, job, syscall.SIGTERM); err != nil {
		n.t.Fatal(err)
	}
	return n.wait(job)
}

func (n *labNode) wait(job int) (int, string) {
	n.t.Helper()
	r, err := n.g.Exec().Wait(n.ctx, job, time.Minute)
	if err != nil {
		n.t.Fatal(err)
	}
	if r.TimedOut {
		n.t.Fatalf("%s: job %d still running", n.name, job)
	}
	return r.Exit, r.Stdout + r.Stderr
}

// The lease between two lab guests that share one virtio-blk disk (no
// reservations; the guest tier, skipped unless VCO_LAB is set as make
// test-lease-lab does): L1 a second claim is refused naming the holder,
// L2 handover by release, L3 takeover from a frozen guest after the
// expiry bound, which on resuming reports the loss and stops, L4 both
// guests claiming at once, exactly one winner each round; then a disk A
// holds is hot-plugged into B, whose watcher refuses it unasked.
func TestLeaseBetweenGuests(t *testing.T) {
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cfg, err := lab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	l, err := lab.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	nodes := startSharingGuests(t, ctx, l)
	defer func() {
		if t.Failed() {
			for _, n := range nodes {
				t.Logf("%s console:\n%s", n.name, n.g.ConsoleTail(20))
			}
		}
	}()
	keyA, _ := fence.KeyFromUUID(labUUIDA)
	keyB, _ := fence.KeyFromUUID(labUUIDB)
	s := &leaseStory{t: t, ctx: ctx, a: nodes[0], b: nodes[1], keyA: keyA, keyB: keyB}

	if code, out := s.a.run("format"); code != 0 {
		t.Fatalf("format: %d %s", code, out)
	}
	if code, out := s.b.run("format"); code != 0 || !strings.Contains(out, "nothing written") {
		t.Fatalf("format from the other guest: %d %s", code, out)
	}
	jobA := s.secondClaimRefused()
	s.handoverByRelease(jobA)
	s.takeoverFromFrozenHolder()
	s.bothClaimAtOnce()
	s.grantedTakeoverOfLiveHolder()
	s.hotPluggedHeldDiskRefused()
}

// startSharingGuests starts node-a and node-b sharing one 64 MiB
// virtio-blk disk and returns them as lease nodes on it.
func startSharingGuests(t *testing.T, ctx context.Context, l *lab.Lab) []*labNode {
	t.Helper()
	img := filepath.Join(t.TempDir(), "shared.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	shared := lab.Disk{ID: "shared", Kind: lab.VirtioBlk, File: img, Serial: "5001"}
	gs, err := l.StartGuests(ctx,
		lab.GuestConfig{Name: "node-a", UUID: labUUIDA, MemMB: 384, Disks: []lab.Disk{shared}},
		lab.GuestConfig{Name: "node-b", UUID: labUUIDB, MemMB: 384, Disks: []lab.Disk{shared}})
	if err != nil {
		t.Fatal(err)
	}
	nodes := make([]*labNode, 2)
	for i, g := range gs {
		wctx, wcancel := context.WithTimeout(ctx, time.Minute)
		d, err := g.WaitDiskBySerial(wctx, "5001")
		wcancel()
		if err != nil {
			t.Fatal(err)
		}
		nodes[i] = &labNode{t: t, ctx: ctx, g: g, uuid: []string{labUUIDA, labUUIDB}[i], name: g.Name, dev: "/dev/" + d.Name}
	}
	return nodes
}

// leaseStory is TestLeaseBetweenGuests's two nodes on their shared disk.
type leaseStory struct {
	t          *testing.T
	ctx        context.Context
	a, b       *labNode
	keyA, keyB fence.Key
}

// secondClaimRefused (L1): while A holds, B's acquire and check are
// refused naming A. It returns A's holding job.
func (s *leaseStory) secondClaimRefused() int {
	t, a, b := s.t, s.a, s.b
	t.Helper()
	jobA, ok, code, out := a.hold()
	if !ok {
		t.Fatalf("A acquire: %d %s", code, out)
	}
	t0 := time.Now()
	if code, out := b.run("acquire"); code != 1 || !strings.Contains(out, s.keyA.String()) || !strings.Contains(out, "node-a") {
		t.Fatalf("L1: B's acquire while A holds: %d %s", code, out)
	}
	t.Logf("L1: B refused after %s", time.Since(t0).Round(time.Millisecond))
	if code, out := b.run("check"); code != 1 || !strings.Contains(out, "node-a") {
		t.Fatalf("L1: B's check: %d %s", code, out)
	}
	return jobA
}

// handoverByRelease (L2): once A releases, B acquires, and A's check
// names B.
func (s *leaseStory) handoverByRelease(jobA int) {
	t, a, b := s.t, s.a, s.b
	t.Helper()
	if code, out := a.stop(jobA); code != 0 || !strings.Contains(out, "released") {
		t.Fatalf("L2: A's release: %d %s", code, out)
	}
	jobB, ok, code, out := b.hold()
	if !ok {
		t.Fatalf("L2: B after A released: %d %s", code, out)
	}
	if code, out := a.run("check"); code != 1 || !strings.Contains(out, s.keyB.String()) {
		t.Fatalf("L2: A's check: %d %s", code, out)
	}
	if code, out := b.stop(jobB); code != 0 {
		t.Fatalf("L2: B's release: %d %s", code, out)
	}
}

// takeoverFromFrozenHolder (L3): A holds, then freezes; B takes over
// after the expiry bound; A, resumed, reports the loss naming B and
// stops.
func (s *leaseStory) takeoverFromFrozenHolder() {
	t, ctx, a, b := s.t, s.ctx, s.a, s.b
	t.Helper()
	jobA, ok, code, out := a.hold()
	if !ok {
		t.Fatalf("L3: A acquire: %d %s", code, out)
	}
	if err := a.g.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	jobB, ok, code, out := b.hold()
	if !ok {
		t.Fatalf("L3: B's takeover of the frozen A: %d %s", code, out)
	}
	took := time.Since(t0)
	if took < labLease.Expiry() || !strings.Contains(out, "took over from key(s) ["+s.keyA.String()+"]") {
		t.Fatalf("L3: B claimed after %s (expiry bound %s): %s", took, labLease.Expiry(), out)
	}
	t.Logf("L3: B took over after %s (expiry %s + settle %s)", took.Round(time.Millisecond), labLease.Expiry(), labLease.Settle())
	if err := a.g.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if code, out := a.wait(jobA); code != 3 || !strings.Contains(out, "lost") || !strings.Contains(out, s.keyB.String()) {
		t.Fatalf("L3: A after resuming: %d %s", code, out)
	}
	if code, out := b.run("check"); code != 0 {
		t.Fatalf("L3: B's check after A resumed: %d %s", code, out)
	}
	if code, out := b.stop(jobB); code != 0 {
		t.Fatalf("L3: B's release: %d %s", code, out)
	}
}

// bothClaimAtOnce (L4): both at once; each holds for a while, so the
// loser decides while the winner still holds. Exactly one wins each of
// five rounds; the other is refused.
func (s *leaseStory) bothClaimAtOnce() {
	t := s.t
	t.Helper()
	nodes := []*labNode{s.a, s.b}
	for round := range 5 {
		jobs := make([]int, 2)
		for i, n := range nodes {
			var err error
			jobs[i], err = n.g.Exec().Start(s.ctx, n.argv("acquire", "--hold-for", "8s")...)
			if err != nil {
				t.Fatal(err)
			}
		}
		var won []string
		for i, n := range nodes {
			code, out := n.wait(jobs[i])
			switch code {
			case 0:
				won = append(won, n.name)
			case 1:
				if !strings.Contains(out, "held by another node") {
					t.Fatalf("L4 round %d: %s: %s", round, n.name, out)
				}
			default:
				t.Fatalf("L4 round %d: %s exit %d: %s", round, n.name, code, out)
			}
		}
		if len(won) != 1 {
			t.Fatalf("L4 round %d: winners %v, want exactly one", round, won)
		}
		t.Logf("L4 round %d: %s won", round, won[0])
	}
}

// grantedTakeoverOfLiveHolder (L5): a granted takeover of a live holder,
// both on the default timing: B's acquire with a grant naming A returns
// once A has seen B's claim at its next renewal, stopped and marked its
// slot fenced, within Bounds().GrantLive (plus the guests' I/O and this
// test's half-second polling), under 10 s.
func (s *leaseStory) grantedTakeoverOfLiveHolder() {
	t, a, b := s.t, s.a, s.b
	t.Helper()
	def := lease.DefaultTiming()
	defArgs := []string{"--io-timeout", def.IOTimeout.String(), "--renew", def.Renew.String(),
		"--fail", def.Fail.String(), "--watchdog", def.Watchdog.String()}
	jobA, ok, code, out := a.hold(defArgs...)
	if !ok {
		t.Fatalf("L5: A acquire: %d %s", code, out)
	}
	grant := fmt.Sprintf(`{"disk":"shared","node":%q,"supersedes":[%q]}`, labUUIDB, s.keyA.String())
	t0 := time.Now()
	jobB, ok, code, out := b.hold(append(defArgs, "--disk", "shared", "--grant", grant)...)
	took := time.Since(t0)
	if !ok || !strings.Contains(out, "took over from key(s) ["+s.keyA.String()+"]") {
		t.Fatalf("L5: B's granted takeover of the live A: %d %s", code, out)
	}
	if took >= 10*time.Second {
		t.Fatalf("L5: B's granted takeover of the live A took %s; bound max(2d, R) + d/2 = %s, and under 10 s", took, def.Bounds().GrantLive)
	}
	t.Logf("L5: B took over the live A with a grant after %s (bound max(2d, R) + d/2 = %s)", took.Round(time.Millisecond), def.Bounds().GrantLive)
	if code, out := a.wait(jobA); code != 3 || !strings.Contains(out, s.keyB.String()) {
		t.Fatalf("L5: A after B's granted takeover: %d %s", code, out)
	}
	if code, out := b.stop(jobB); code != 0 {
		t.Fatalf("L5: B's release: %d %s", code, out)
	}
}

// hotPluggedHeldDiskRefused: a disk A holds is plugged into B, whose
// watcher refuses it on the kernel's add event, with no request:
// read-only on B, writes fail, and A keeps the disk.
func (s *leaseStory) hotPluggedHeldDiskRefused() {
	t, ctx, a, b := s.t, s.ctx, s.a, s.b
	t.Helper()
	hotImg := filepath.Join(t.TempDir(), "hot.img")
	if err := os.WriteFile(hotImg, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(hotImg, 64<<20); err != nil {
		t.Fatal(err)
	}
	hot := lab.Disk{ID: "hot", Kind: lab.VirtioBlk, File: hotImg, Serial: "5002"}
	if err := a.g.AttachDisk(ctx, hot); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	hd, err := a.g.WaitDiskBySerial(wctx, "5002")
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	aHot := &labNode{t: t, ctx: ctx, g: a.g, uuid: labUUIDA, name: a.name, dev: "/dev/" + hd.Name}
	if code, out := aHot.run("format"); code != 0 {
		t.Fatalf("hot-plug: format on A: %d %s", code, out)
	}
	jobA, ok, code, out := aHot.hold()
	if !ok {
		t.Fatalf("hot-plug: A acquire: %d %s", code, out)
	}
	watch := startWatcher(t, ctx, b)
	if err := b.g.AttachDisk(ctx, hot); err != nil {
		t.Fatal(err)
	}
	refused := awaitRefusal(t, ctx, b, watch)
	t.Logf("hot-plug: B: %s", refused)
	bHot := strings.Fields(refused)[1]
	if got := strings.TrimSpace(mustSh(t, ctx, b.g, "cat /sys/block/"+filepath.Base(bHot)+"/ro")); got != "1" {
		t.Fatalf("hot-plug: %s on B is not read-only (ro=%s)", bHot, got)
	}
	if r, err := b.g.Exec().Run(ctx, time.Minute, "/bin/sh", "-c", "dd if=/dev/zero of="+bHot+" bs=4096 count=1 seek=1000 oflag=direct"); err != nil || r.Exit == 0 {
		t.Fatalf("hot-plug: a write to the refused disk on B succeeded: %v %v", r, err)
	}
	if err := b.g.Exec().Kill(ctx, watch, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, out := aHot.run("check"); code != 0 {
		t.Fatalf("hot-plug: A lost the disk: %d %s", code, out)
	}
	if code, out := aHot.stop(jobA); code != 0 {
		t.Fatalf("hot-plug: A's release: %d %s", code, out)
	}
}

// startWatcher starts `lease watch` on n and waits until it watches.
func startWatcher(t *testing.T, ctx context.Context, n *labNode) int {
	t.Helper()
	watch, err := n.g.Exec().Start(ctx, append([]string{"/bin/vco-agent", "lease", "watch", "--uuid", labUUIDB,
		"--node", "node-a=" + labUUIDA, "--hold-for", "2m"}, labTiming...)...)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		r, err := n.g.Exec().Wait(ctx, watch, 500*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if !r.TimedOut {
			t.Fatalf("hot-plug: B's watcher ended: %d %s %s", r.Exit, r.Stdout, r.Stderr)
		}
		if strings.Contains(r.Stdout, "watching") {
			return watch
		}
		if i > 60 {
			t.Fatal("hot-plug: B's watcher did not start")
		}
	}
}

// awaitRefusal waits up to a minute for the watcher's refusal line, which
// must name node-a and the add event.
func awaitRefusal(t *testing.T, ctx context.Context, n *labNode, watch int) string {
	t.Helper()
	var refused string
	for i := 0; refused == "" && i < 120; i++ {
		r, err := n.g.Exec().Wait(ctx, watch, 500*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(r.Stdout, "\n") {
			if strings.HasPrefix(line, "refused ") {
				refused = line
			}
		}
		if !r.TimedOut {
			break
		}
	}
	if refused == "" || !strings.Contains(refused, "node node-a") || !strings.Contains(refused, "add event") {
		t.Fatalf("hot-plug: B's watcher did not refuse the disk: %q", refused)
	}
	return refused
}

func mustSh(t *testing.T, ctx context.Context, g *lab.Guest, script string) string {
	t.Helper()
	out, err := g.MustSh(ctx, script)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
