package faults

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// nowMS defines a guest shell function printing milliseconds since boot
// (busybox date has no %N).
const nowMS = "now() { awk '{printf \"%d\", $1*1000}' /proc/uptime; }\n"

const (
	loadDisks  = 64
	loadEvents = 200
)

// loadAgentConfig checks every claim each second and serves metrics on
// the guest's loopback, where the test reads the check cost. Its reclaim
// wait gives TestTargetRestart room to resume a paused holder while the
// other node waits; the blank disks of TestManyDisks never wait. The
// guests load no watchdog driver: leases are held without one.
const loadAgentConfig = `dbus:
  enabled: false
volumes:
  check_interval: 1s
  reclaim_wait: 30s
  lease:
    watchdog_device: none-unsafe
metrics:
  listen: 127.0.0.1:9101
`

// startLoadAgent starts the agent in g and returns how long it took to
// answer on its socket: the agent re-verifies every recorded claim before
// it serves, so with claims on record this is the start-up reconcile.
func startLoadAgent(t *testing.T, ctx context.Context, g *lab.Guest) time.Duration {
	t.Helper()
	// The guest boots with loopback down; the metrics listen there.
	script := nowMS + fmt.Sprintf(`ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
mkdir -p /etc/vco-agent /var/lib/kubelet /run/vco-agent
cat > /etc/vco-agent/config.yaml <<'EOF'
%sEOF
s=$(now)
setsid /bin/vco-agent serve --config /etc/vco-agent/config.yaml >>/run/agent.log 2>&1 </dev/null &
echo $! > /run/agent.pid
for i in $(seq 3000); do /bin/vco-agent status >/dev/null 2>&1 && { echo $(( $(now) - s )); exit 0; }; sleep 0.1; done
echo "the agent did not come up:" >&2; tail -n 30 /run/agent.log >&2; exit 1`, loadAgentConfig)
	out, err := g.MustSh(ctx, script)
	if err != nil {
		t.Fatal(err)
	}
	ms, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("start-up time %q: %v", out, err)
	}
	return time.Duration(ms) * time.Millisecond
}

func stopLoadAgent(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	if _, err := g.MustSh(ctx, `p=$(cat /run/agent.pid); kill -TERM $p
for i in $(seq 300); do kill -0 $p 2>/dev/null || exit 0; sleep 0.1; done
kill -QUIT $p; sleep 2
echo "the agent did not stop within 30 s of SIGTERM; its log, ending with its goroutines (SIGQUIT):" >&2
tail -n 400 /run/agent.log >&2; exit 1`); err != nil {
		t.Fatal(err)
	}
}

// metric reads one series of the guest agent's /metrics (0 when absent).
func metric(t *testing.T, ctx context.Context, g *lab.Guest, series string) float64 {
	t.Helper()
	out, err := g.MustSh(ctx, "wget -qO- http://127.0.0.1:9101/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %q: %v", series, v, err)
			}
			return f
		}
	}
	return 0
}

// TestManyDisks gives one guest 64 iSCSI disks with persistent
// reservations, has the agent claim them all, and measures what the
// agent's start-up reconcile and its periodic check of 64 claims cost;
// then fires 200 disk add uevents in a burst at the disk watcher and
// checks that each one was classified.
func TestManyDisks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	g, serials := guestWithManyDisks(t, ctx)

	base := startLoadAgent(t, ctx, g)
	figure(t, "load_agent_start_0_claims_ms", base.Milliseconds())
	stageEveryDisk(t, ctx, g, serials)
	reconcileOfManyClaims(t, ctx, g, base)
	periodicCheckOfManyClaims(t, ctx, g)
	stopLoadAgent(t, ctx, g)
	ueventBurstClassified(t, ctx, g)
}

// guestWithManyDisks starts node-a with loadDisks iSCSI disks and waits
// until it sees them all; it returns the guest and the disks' serials.
func guestWithManyDisks(t *testing.T, ctx context.Context) (*lab.Guest, []string) {
	t.Helper()
	l := newLab(t, ctx)
	var disks []lab.Disk
	serials := make([]string, loadDisks)
	for i := range loadDisks {
		lun, err := l.AddLUN(ctx, fmt.Sprintf("load%02d", i), 8<<20)
		if err != nil {
			t.Fatal(err)
		}
		serials[i] = lun.Serial
		disks = append(disks, lab.Disk{ID: lun.Serial, Kind: lab.SCSIBlock, LUN: lun})
	}
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 384, Disks: disks})
	if err != nil {
		t.Fatal(err)
	}
	g := gs[0]
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Minute)
	defer wcancel()
	for {
		ds, err := g.Disks(wctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(ds) >= loadDisks {
			return g, serials
		}
		time.Sleep(time.Second)
	}
}

// stageEveryDisk stages every disk as a raw block volume: fenced with a
// PR claim, recorded, nothing mounted (mkfs of 64 disks under TCG would
// measure mkfs). The agent holds them all, and sg_persist sees each
// reserved.
func stageEveryDisk(t *testing.T, ctx context.Context, g *lab.Guest, serials []string) {
	t.Helper()
	stage := nowMS + fmt.Sprintf(`s=$(now)
for ser in %s; do
  /bin/vco-agent volume stage v-$ser --serial $ser --block --staging /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/v-$ser >/dev/null || { echo "stage of $ser failed" >&2; exit 1; }
done
echo $(( $(now) - s ))`, strings.Join(serials, " "))
	out, err := g.MustSh(ctx, stage)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	figure(t, "load_stage_64_disks_ms", strings.TrimSpace(out))
	if held := metric(t, ctx, g, `vco_agent_claims{state="held"}`); held != loadDisks {
		t.Fatalf("the agent reports %v held claims, want %d", held, loadDisks)
	}
	// Each of the 64 disks as sg_persist sees it: reserved by our key.
	if out, err := g.MustSh(ctx, `n=0; for b in /sys/block/sd*; do sg_persist -n -i -r /dev/${b##*/} | grep -q 'Key=' && n=$((n+1)); done; echo $n`); err != nil || strings.TrimSpace(out) != strconv.Itoa(loadDisks) {
		t.Fatalf("disks with a reservation: %q (%v), want %d", out, err, loadDisks)
	}
}

// reconcileOfManyClaims restarts the agent with 64 claims on record: each
// one is re-verified before the socket serves. base is the start-up time
// with none.
func reconcileOfManyClaims(t *testing.T, ctx context.Context, g *lab.Guest, base time.Duration) {
	t.Helper()
	stopLoadAgent(t, ctx, g)
	out, err := g.MustSh(ctx, "wc -l < /run/agent.log")
	if err != nil {
		t.Fatal(err)
	}
	logged := strings.TrimSpace(out)
	reconcile := startLoadAgent(t, ctx, g)
	figure(t, "load_agent_start_64_claims_ms", reconcile.Milliseconds())
	figure(t, "load_reconcile_per_claim_ms", fmt.Sprintf("%.1f", float64(reconcile.Milliseconds()-base.Milliseconds())/loadDisks))
	// Each claim's fence was checked on its disk at start (not only its
	// record kept), and none was cleaned up, marked missing or lost.
	restartLog, err := g.MustSh(ctx, "tail -n +$(( "+logged+" + 1 )) /run/agent.log")
	if err != nil {
		t.Fatal(err)
	}
	if held := metric(t, ctx, g, `vco_agent_claims{state="held"}`); held != loadDisks {
		t.Fatalf("after the restart the agent reports %v held claims, want %d; its log:\n%s", held, loadDisks, lastLines(restartLog, 30))
	}
	if n := strings.Count(restartLog, `msg="claim re-verified at start"`); n != loadDisks {
		t.Fatalf("%d claims re-verified at start, want %d:\n%s", n, loadDisks, lastLines(restartLog, 30))
	}
	for _, line := range strings.Split(restartLog, "\n") {
		if strings.Contains(line, " volume=") && (strings.Contains(line, "level=ERROR") || strings.Contains(line, "level=WARN")) {
			t.Fatalf("the start-up check logged a problem with a claim: %s", line)
		}
	}
}

// periodicCheckOfManyClaims: a few rounds of the periodic check at 1 s,
// each passing for every claim, none finding one lost, missing or in
// error.
func periodicCheckOfManyClaims(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	c0, s0 := metric(t, ctx, g, "vco_agent_claim_check_seconds_count"), metric(t, ctx, g, "vco_agent_claim_check_seconds_sum")
	time.Sleep(8 * time.Second)
	c1, s1 := metric(t, ctx, g, "vco_agent_claim_check_seconds_count"), metric(t, ctx, g, "vco_agent_claim_check_seconds_sum")
	if c1 <= c0 {
		t.Fatalf("no periodic check of the claims ran in 8 s (count %v -> %v)", c0, c1)
	}
	figure(t, "load_check_rounds", c1-c0)
	figure(t, "load_check_64_claims_ms", fmt.Sprintf("%.1f", (s1-s0)/(c1-c0)*1000))
	if lost := metric(t, ctx, g, `vco_agent_claim_checks_total{result="lost"}`); lost != 0 {
		t.Fatalf("%v claim checks found a claim lost; nothing touched the disks", lost)
	}
	if okc := metric(t, ctx, g, `vco_agent_claim_checks_total{result="ok"}`); okc < loadDisks*(1+c1-c0) {
		t.Fatalf("only %v claim checks passed, want one per claim at start and in each of %v rounds (%v)", okc, c1-c0, loadDisks*(1+c1-c0))
	}
	for _, r := range []string{"missing", "error"} {
		if n := metric(t, ctx, g, `vco_agent_claim_checks_total{result="`+r+`"}`); n != 0 {
			t.Fatalf("%v claim checks ended %q; nothing touched the disks", n, r)
		}
	}
	if held := metric(t, ctx, g, `vco_agent_claims{state="held"}`); held != loadDisks {
		t.Fatalf("after %v check rounds the agent reports %v held claims, want %d", c1-c0, held, loadDisks)
	}
}

// ueventBurstClassified fires the uevent burst. The daemon has no uevent
// watcher of its own on this branch; `vco-agent lease watch` runs the
// same watcher (fence/uevent) with the lease classifier. Each round
// synthesizes a remove and an add of a disk, so the watcher must decide
// each add afresh: every add is classified, every remove seen, and every
// disk classified at least once.
func ueventBurstClassified(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	if _, err := g.MustSh(ctx, `setsid /bin/vco-agent lease watch --hold-for 10m >/run/watch.log 2>&1 </dev/null &
echo $! > /run/watch.pid
for i in $(seq 100); do grep -q 'watching for disks' /run/watch.log && exit 0; sleep 0.1; done
cat /run/watch.log >&2; exit 1`); err != nil {
		t.Fatal(err)
	}
	defer g.Sh(context.Background(), "kill $(cat /run/watch.pid)")
	// The watcher classifies the disks already present before it says it
	// is watching (its start-up scan); those lines are not the burst's.
	startLog, err := g.MustSh(ctx, "cat /run/watch.log")
	if err != nil {
		t.Fatal(err)
	}
	a0, r0, rm0, e0 := countWatchLines(startLog)
	out, err := g.MustSh(ctx, nowMS+fmt.Sprintf(`set -- $(cd /sys/block && ls -d sd*)
s=$(now); i=0
while [ $i -lt %d ]; do
  n=$(( i %% $# + 1 )); eval d=\${$n}
  echo remove > /sys/block/$d/uevent; echo add > /sys/block/$d/uevent
  i=$((i+1))
done
echo $(( $(now) - s ))`, loadEvents))
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "load_uevent_burst_adds", loadEvents)
	figure(t, "load_uevent_burst_ms", strings.TrimSpace(out))
	// Wait for the decisions.
	var accepted, refused, removed, errs int
	var log string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		log, err = g.MustSh(ctx, "cat /run/watch.log")
		if err != nil {
			t.Fatal(err)
		}
		accepted, refused, removed, errs = countWatchLines(log)
		accepted, refused, removed, errs = accepted-a0, refused-r0, removed-rm0, errs-e0
		if accepted+refused+errs >= loadEvents || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	figure(t, "load_uevent_classified", accepted+refused)
	figure(t, "load_uevent_removes_seen", removed)
	figure(t, "load_uevent_lost", loadEvents-(accepted+refused+errs))
	if strings.Contains(log, "overrun") {
		t.Errorf("the watcher's socket overran in the burst:\n%s", lastLines(log, 20))
	}
	if errs > 0 || accepted+refused != loadEvents || removed != loadEvents {
		t.Fatalf("burst of %d remove+add pairs: %d accepted, %d refused, %d errors, %d removes seen; want every add classified and every remove seen:\n%s",
			loadEvents, accepted, refused, errs, removed, lastLines(log, 30))
	}
	// Every disk classified at least once.
	for _, d := range mustDisks(t, ctx, g) {
		if !strings.Contains(log, "/dev/"+d.Name+" (") {
			t.Errorf("disk %s was never classified", d.Name)
		}
	}
}

func mustDisks(t *testing.T, ctx context.Context, g *lab.Guest) []lab.GuestDisk {
	t.Helper()
	ds, err := g.Disks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return ds
}

// countWatchLines counts the decisions in `vco-agent lease watch` output.
func countWatchLines(log string) (accepted, refused, removed, errs int) {
	for _, line := range strings.Split(log, "\n") {
		switch {
		case strings.HasPrefix(line, "accepted "):
			accepted++
		case strings.HasPrefix(line, "refused "):
			refused++
		case strings.HasPrefix(line, "removed "):
			removed++
		case strings.HasPrefix(line, "error "):
			errs++
		}
	}
	return
}
