package scenarios

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/lab/labtest"
)

// watchdogConfig holds leases with the host watchdog the package ships
// (watchdog_device: auto, the default, finds softdog, loaded at boot as
// modules-load.d does on a node), and times
// scaled for TCG guests: W = 12s (the device gets W/2 = 6s), so a taker
// waits max(F+W+d, R+6d) = 21s.
const watchdogConfig = `dbus:
  enabled: false
volumes:
  check_interval: 1s
  lease:
    io_timeout: 1s
    renew: 2s
    fail: 8s
    watchdog: 12s
`

const watchdogW = 12 * time.Second

// watchdogDev is the device's timeout: half of W (agent/watchdog).
const watchdogDev = watchdogW / 2

var seqRe = regexp.MustCompile(`WDSEQ-A-(\d{8})`)

// maxSeq is the highest sequence number node-a's writer got onto the disk.
func maxSeq(t *testing.T, img string) int {
	t.Helper()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	best := -1
	for _, m := range seqRe.FindAllSubmatch(b, -1) {
		if n, _ := strconv.Atoi(string(m[1])); n > best {
			best = n
		}
	}
	return best
}

// TestWatchdogResetsAStoppedHolder is the host watchdog's proof (docs/
// fencing.md, "Host watchdog"): node-a's agent holds a lease and a writer
// writes sequence-numbered blocks through its filesystem; the agent is
// SIGSTOPped, so nothing renews the lease and nothing stops the writer
// but the watchdog. node-a's guest must reset (QEMU exits: -no-reboot)
// before node-b's takeover completes, and no block of node-a's may land
// after that. Then node-b's agent is killed and restarted while it holds
// the lease (no reset: the new process takes the device over), and after
// its unstage its watchdog is stopped (no reset either).
func TestWatchdogResetsAStoppedHolder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	l := labtest.Start(t, ctx, 30, func(cfg *lab.Config) {
		cfg.HostTools = append(append([]string{}, lab.DefaultHostTools...), "/usr/sbin/losetup")
		cfg.Modules = append(append([]string{}, lab.DefaultModules...), "softdog")
	})
	began := time.Now()
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 512}, lab.GuestConfig{Name: "node-b", MemMB: 512})
	if err != nil {
		t.Fatal(err)
	}
	a, b := gs[0], gs[1]
	t.Cleanup(func() {
		if t.Failed() {
			for _, g := range gs {
				t.Logf("%s agent log:\n%s", g.Name, agentLog(context.Background(), g))
			}
		}
	})
	for _, g := range gs {
		startAgentWith(t, ctx, g, watchdogConfig)
	}
	img := (&leasePair{l: l}).sharedDisk(t, "wd")
	// node-a's disk is not unplugged at the end: its guest is gone.
	if err := a.AttachDisk(ctx, lab.Disk{ID: "wd", Kind: lab.VirtioBlk, File: img, Serial: "wd"}); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	_, err = a.WaitDiskBySerial(wctx, "wd")
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	plug(t, ctx, b, "wd", img)
	mustStage(t, ctx, a, "vol-wd", "wd")

	if w := hostWatchdog(t, ctx, a); !w.Armed || w.Device != "/dev/watchdog0" || w.Timeout != "6s" || w.Leases != 1 {
		t.Fatalf("node-a's host watchdog while it holds the lease: %+v", w)
	}
	startSeqWriter(t, ctx, a, img)
	s := stoppedHolderIsReset(t, ctx, a, b, img)
	takeoverAfterTheReset(t, ctx, b, img, s)
	restartedHolderIsNotReset(t, ctx, b)
	mustUnstage(t, ctx, b, "vol-wd")
	watchdogDisarmedAfterUnstage(t, ctx, b)
	t.Logf("whole test after the lab was up: %s", time.Since(began).Round(time.Second))
}

// hostWatchdogStatus is the host watchdog's part of `vco-agent status`.
type hostWatchdogStatus struct {
	Armed   bool   `json:"armed"`
	Device  string `json:"device"`
	Timeout string `json:"timeout"`
	Leases  int    `json:"leases"`
}

// hostWatchdog asks g's agent for its host watchdog's state.
func hostWatchdog(t *testing.T, ctx context.Context, g *lab.Guest) hostWatchdogStatus {
	t.Helper()
	var st struct {
		HostWatchdog hostWatchdogStatus `json:"host_watchdog"`
	}
	if err := agentJSON(ctx, g, &st, "status"); err != nil {
		t.Fatal(err)
	}
	return st.HostWatchdog
}

// startSeqWriter starts node-a's writer: one O_DIRECT block per record,
// each at its own offset; it waits until a few reached the disk.
func startSeqWriter(t *testing.T, ctx context.Context, a *lab.Guest, img string) {
	t.Helper()
	if _, err := a.MustSh(ctx, fmt.Sprintf(`cat >/run/writer.sh <<'EOF'
i=0
while :; do
	printf 'WDSEQ-A-%%08d\n' $i | dd of=%s/seq bs=4096 seek=$i conv=notrunc,sync oflag=direct 2>/dev/null
	i=$((i+1))
done
EOF
setsid sh /run/writer.sh </dev/null >/dev/null 2>&1 &`, stagingOf("vol-wd"))); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); maxSeq(t, img) < 5; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("node-a's writer wrote nothing to the disk")
		}
	}
}

// stoppedHolder is what stoppedHolderIsReset saw: when node-a's agent
// stopped and its guest reset, the last block at the reset, and node-b's
// stage under way.
type stoppedHolder struct {
	stopped, reset time.Time
	atReset        int
	staged         chan error
}

// stoppedHolderIsReset freezes node-a's agent (no renewal, no
// self-fencing, no feeding) while node-b stages the volume: node-a's
// guest must reset before node-b's takeover completes, within W of the
// stop, after its writer went on writing.
func stoppedHolderIsReset(t *testing.T, ctx context.Context, a, b *lab.Guest, img string) stoppedHolder {
	t.Helper()
	if _, err := a.MustSh(ctx, "kill -STOP $(cat /run/agent.pid)"); err != nil {
		t.Fatal(err)
	}
	s := stoppedHolder{stopped: time.Now(), staged: make(chan error, 1)}
	atStop := maxSeq(t, img)
	go func() {
		_, err := stage(ctx, b, "vol-wd", "wd")
		s.staged <- err
	}()

	select {
	case <-a.Proc.Exited():
		s.reset = time.Now()
	case err := <-s.staged:
		tookOver := time.Now()
		before := maxSeq(t, img)
		time.Sleep(3 * time.Second)
		t.Fatalf("node-b took the disk over (%v) %s after node-a's agent stopped, and node-a's guest is still running: its writer went on from block %d to %d while node-b held the disk",
			err, tookOver.Sub(s.stopped).Round(time.Millisecond), before, maxSeq(t, img))
	case <-time.After(2 * time.Minute):
		t.Fatal("neither a reset of node-a nor node-b's takeover within 2 minutes")
	}
	s.atReset = maxSeq(t, img)
	t.Logf("node-a's guest reset %s after its agent was stopped (device timeout %s); its writer got blocks %d to %d onto the disk meanwhile",
		s.reset.Sub(s.stopped).Round(time.Millisecond), watchdogDev, atStop, s.atReset)
	if s.atReset <= atStop {
		t.Fatalf("node-a's writer wrote nothing after its agent stopped (blocks %d, %d): the test shows nothing", atStop, s.atReset)
	}
	// Reset within the device's timeout (W/2) of the last feed, which came
	// at most a feed interval (1s) before the stop; TCG adds a little.
	if late := s.reset.Sub(s.stopped); late > watchdogDev+5*time.Second {
		t.Fatalf("node-a's guest reset %s after its agent stopped; the device's timeout is %s (W/2)", late, watchdogDev)
	}
	if !strings.Contains(a.ConsoleTail(200), "softdog") && !strings.Contains(a.ConsoleTail(200), "watchdog") {
		t.Logf("node-a's console does not name the watchdog:\n%s", a.ConsoleTail(20))
	}
	return s
}

// takeoverAfterTheReset: node-b's stage completes; none of node-a's
// blocks lands after its reset; node-b reads node-a's earlier blocks and
// its own write reaches the disk.
func takeoverAfterTheReset(t *testing.T, ctx context.Context, b *lab.Guest, img string, s stoppedHolder) {
	t.Helper()
	var tookOver time.Time
	select {
	case err := <-s.staged:
		tookOver = time.Now()
		if err != nil {
			t.Fatalf("node-b's takeover: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("node-b did not take the disk over")
	}
	t.Logf("node-b took over %s after node-a's agent stopped, %s after node-a's reset", tookOver.Sub(s.stopped).Round(time.Millisecond),
		tookOver.Sub(s.reset).Round(time.Millisecond))
	if err := writeFile(ctx, b, "vol-wd", "b", "WDSEQ-B-after-takeover"); err != nil {
		t.Fatal(err)
	}
	if got := maxSeq(t, img); got != s.atReset {
		t.Fatalf("node-a's block %d landed after its reset (last at reset: %d)", got, s.atReset)
	}
	out, err := b.MustSh(ctx, "grep -c WDSEQ-A "+stagingOf("vol-wd")+"/seq")
	if err != nil || strings.TrimSpace(out) == "0" {
		t.Fatalf("node-b does not read node-a's blocks from before the takeover: %q %v", out, err)
	}
	if !fileHas(t, img, "WDSEQ-B-after-takeover") {
		t.Fatal("node-b's write did not reach the disk")
	}
}

// restartedHolderIsNotReset: node-b's agent is killed while it holds the
// lease and comes back at once (a crash, an upgrade): the new process
// takes the device over before it runs out, resumes the lease and feeds
// it; no reset.
func restartedHolderIsNotReset(t *testing.T, ctx context.Context, b *lab.Guest) {
	t.Helper()
	if _, err := b.MustSh(ctx, "kill -KILL $(cat /run/agent.pid)"); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	startAgentWith(t, ctx, b, watchdogConfig)
	back := time.Since(killed)
	time.Sleep(watchdogW + 3*time.Second)
	select {
	case <-b.Proc.Exited():
		t.Fatalf("node-b's guest reset after its agent was killed and back in %s", back.Round(time.Millisecond))
	default:
	}
	if w := hostWatchdog(t, ctx, b); !w.Armed || w.Leases != 1 {
		t.Fatalf("node-b's host watchdog after its agent restarted: %+v", w)
	}
	if err := writeFile(ctx, b, "vol-wd", "b2", "WDSEQ-B-after-restart"); err != nil {
		t.Fatal(err)
	}
	t.Logf("node-b's agent killed and back in %s: the device taken over, the lease resumed, no reset", back.Round(time.Millisecond))
}

// watchdogDisarmedAfterUnstage: node-b's watchdog, armed for its lease,
// is stopped by the magic close once no lease has been held for an
// acquisition's time (Expiry + Settle + 3d = 26s): its guest then lives
// on past W.
func watchdogDisarmedAfterUnstage(t *testing.T, ctx context.Context, b *lab.Guest) {
	t.Helper()
	unstaged := time.Now()
	for {
		w := hostWatchdog(t, ctx, b)
		if !w.Armed {
			break
		}
		if time.Since(unstaged) > time.Minute {
			t.Fatalf("node-b's watchdog still armed a minute after its last unstage: %+v", w)
		}
		time.Sleep(time.Second)
	}
	disarmed := time.Now()
	time.Sleep(watchdogW + 3*time.Second)
	select {
	case <-b.Proc.Exited():
		t.Fatalf("node-b's guest reset after its watchdog was disarmed")
	default:
	}
	if _, err := b.MustSh(ctx, "true"); err != nil {
		t.Fatalf("node-b after its watchdog was disarmed: %v", err)
	}
	t.Logf("node-b's watchdog disarmed %s after its unstage; the guest lives on past W", disarmed.Sub(unstaged).Round(time.Millisecond))
}
