package reliability

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
)

// crashRounds is 20 under `make test`; `make soak` sets VCO_CRASH_ROUNDS=200.
func crashRounds(t *testing.T) int {
	if s := os.Getenv("VCO_CRASH_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("VCO_CRASH_ROUNDS=%q is not a positive number", s)
		}
		return n
	}
	return 20
}

// TestCrashLoop stages, writes and unstages one volume on a real loop
// device for many rounds, SIGKILLing `vco-agent serve` (with the mount,
// mkfs and fsck helpers it runs, as systemd kills the unit's cgroup when
// the daemon dies) at a random moment
// in each round (mid-stage, mid-unstage, between calls, or while it starts
// up), restarting it and retrying the call that was cut off. After every
// round: every marker file written in an earlier round reads back, the
// filesystem's UUID is the one made in round 1 (no second mkfs), and no
// mount, claim record or loop device is left behind.
func TestCrashLoop(t *testing.T) {
	h := newHost(t)
	rounds := crashRounds(t)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("VCO_CRASH_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	t.Logf("crash loop: %d rounds, seed %d (VCO_CRASH_SEED repeats it)", rounds, seed)

	baseLoops := h.loopDevices()
	h.start()
	staging := filepath.Join(h.kubelet, "plugins", "kubernetes.io", "csi", "cloud.whitesky.csi", "vol-crash", "globalmount")
	l := &crashLoop{t: t, h: h, baseLoops: baseLoops, staging: staging, kills: map[string]int{}, roundDur: 300 * time.Millisecond,
		req: &api.StageVolumeRequest{VolumeId: "loc-1/4711", Device: &api.DeviceLocator{LoopBackingFile: h.img},
			StagingPath: staging, FsType: "ext4", AllowUnfenced: true}}
	for round := 1; round <= rounds; round++ {
		l.round(round, rng)
	}
	// A stage killed after mkfs and before its answer leaves the retry
	// to find the filesystem made; so at most one stage reports making
	// it, and the unchanged UUID shows no second mkfs ran.
	if l.formats > 1 {
		t.Fatalf("%d stages reported making the filesystem, want at most one", l.formats)
	}
	l.finalStageReadsEveryMarker(rounds)
	l.report(rounds)
}

// crashLoop is TestCrashLoop's volume, agent and tallies.
type crashLoop struct {
	t         *testing.T
	h         *host
	req       *api.StageVolumeRequest
	staging   string
	baseLoops []string

	killMu   sync.Mutex
	killed   bool // the timer fired in this round
	phase    string
	kills    map[string]int
	fsUUID   string
	formats  int
	retries  int
	busy     int // ABORTED answers while the claim check ran
	checks   int
	roundDur time.Duration
}

func (l *crashLoop) setPhase(p string) {
	l.killMu.Lock()
	l.phase = p
	l.killMu.Unlock()
}

// call retries op until it succeeds, restarting an agent that died under
// it. Any error from a live agent fails the test.
func (l *crashLoop) call(what string, op func(ctx context.Context, c api.AgentClient) error) {
	t, h := l.t, l.h
	t.Helper()
	restarts := 0
	for attempt := 0; ; attempt++ {
		if h.cmd == nil {
			h.start()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err := op(ctx, h.c)
		cancel()
		if err == nil {
			return
		}
		if status.Code(err) == codes.Aborted && attempt < 200 {
			// The periodic claim check holds the volume; a CO retries.
			l.busy++
			time.Sleep(20 * time.Millisecond)
			continue
		}
		select {
		case <-h.done:
		case <-time.After(3 * time.Second):
			t.Fatalf("%s failed with the agent running: %v", what, err)
		}
		h.closeClient()
		l.retries++
		if restarts++; restarts > 5 {
			t.Fatalf("%s: still failing after %d restarts: %v", what, restarts, err)
		}
	}
}

// round runs one round: a kill timer armed at a random moment, stage,
// write, unstage; then the agent killed if the timer did not fire, and
// the invariants with the volume unstaged.
func (l *crashLoop) round(round int, rng *rand.Rand) {
	t, h := l.t, l.h
	t.Helper()
	start := time.Now()
	l.killMu.Lock()
	l.killed = false
	l.killMu.Unlock()
	delay := time.Duration(rng.Int64N(int64(l.roundDur)*11/10 + 1))
	cmd := h.cmd
	timer := time.AfterFunc(delay, func() {
		l.killMu.Lock()
		defer l.killMu.Unlock()
		if cmd != nil && cmd.Process != nil {
			killGroup(cmd)
			l.killed = true
			l.kills[l.phase]++
		}
	})

	l.stageAndWrite(round)
	l.setPhase("unstage")
	l.call("unstage", func(ctx context.Context, c api.AgentClient) error {
		_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: l.req.VolumeId, StagingPath: l.staging})
		return err
	})
	l.setPhase("idle")
	timer.Stop()
	callDur := time.Since(start)
	l.killMu.Lock()
	fired := l.killed
	l.killMu.Unlock()
	l.killIfAlive(round, fired, cmd)
	l.checkUnstaged(round)
	// The kill window follows the calls' own duration, measured in
	// rounds the agent lived through.
	if !fired {
		if round == 1 {
			l.roundDur = callDur
		} else {
			l.roundDur = (l.roundDur*3 + callDur) / 4
		}
	}
}

// stageAndWrite stages the volume, checks it is the filesystem of round 1,
// mounted once, with every earlier round's marker, and writes this
// round's.
func (l *crashLoop) stageAndWrite(round int) {
	t, h := l.t, l.h
	t.Helper()
	l.setPhase("stage")
	var res *api.StageVolumeResponse
	l.call("stage", func(ctx context.Context, c api.AgentClient) error {
		r, err := c.StageVolume(ctx, l.req)
		if err == nil {
			res = r
		}
		return err
	})
	if res.Formatted {
		l.formats++
	}
	l.setPhase("write")
	id := blkidUUID(t, h.loop)
	if l.fsUUID == "" {
		l.fsUUID = id
	} else if id != l.fsUUID {
		t.Fatalf("round %d: the filesystem UUID changed from %s to %s: the volume was formatted again", round, l.fsUUID, id)
	}
	if n := countMountsAt(l.staging); n != 1 {
		t.Fatalf("round %d: %d mounts at the staging path after stage, want 1", round, n)
	}
	for i := 1; i < round; i++ {
		b, err := os.ReadFile(filepath.Join(l.staging, fmt.Sprintf("marker-%04d", i)))
		if err != nil || string(b) != markerText(i) {
			t.Fatalf("round %d: marker of round %d lost: %q %v", round, i, b, err)
		}
		l.checks++
	}
	writeMarker(t, l.staging, round)
}

// killIfAlive: if the round ended before the timer, the agent dies
// between rounds instead, with nothing staged; if the timer killed the
// agent while it sat idle (during the write), it must be dead. An agent
// is running again afterwards.
func (l *crashLoop) killIfAlive(round int, fired bool, cmd *exec.Cmd) {
	t, h := l.t, l.h
	t.Helper()
	if !fired {
		l.killMu.Lock()
		l.kills["between rounds"]++
		l.killMu.Unlock()
		h.kill()
	} else if h.cmd != nil && h.cmd == cmd {
		select {
		case <-h.done:
			h.closeClient()
		case <-time.After(3 * time.Second):
			t.Fatalf("round %d: the agent survived SIGKILL", round)
		}
	}
	if h.cmd == nil {
		h.start()
	}
}

// checkUnstaged: the invariants with the volume unstaged: no mount, no
// new loop device, no claim record.
func (l *crashLoop) checkUnstaged(round int) {
	t, h := l.t, l.h
	t.Helper()
	if m := h.snap().mounts; len(m) != 0 {
		t.Fatalf("round %d: mounts left: %v", round, m)
	}
	// A leak is a loop device on our image that was not there before.
	// (Other tests on a shared machine detach loop devices too; ours
	// going away shows up as a failed stage instead.)
	for _, lo := range h.loopDevices() {
		if !slices.Contains(l.baseLoops, lo) {
			t.Fatalf("round %d: loop device %s left behind (before the loop: %v)", round, lo, l.baseLoops)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(h.state, "volumes")); len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("round %d: claim records left after unstage: %v", round, names)
	}
}

// finalStageReadsEveryMarker: a last stage, by a freshly started agent,
// reads every marker back.
func (l *crashLoop) finalStageReadsEveryMarker(rounds int) {
	t, h := l.t, l.h
	t.Helper()
	h.stop()
	h.start()
	if err := h.stage(context.Background(), l.req); err != nil {
		t.Fatalf("final stage: %v", err)
	}
	for i := 1; i <= rounds; i++ {
		if b, err := os.ReadFile(filepath.Join(l.staging, fmt.Sprintf("marker-%04d", i))); err != nil || string(b) != markerText(i) {
			t.Fatalf("after the loop: marker of round %d lost: %q %v", i, b, err)
		}
		l.checks++
	}
	if err := h.unstage(context.Background(), l.req.VolumeId, l.staging); err != nil {
		t.Fatalf("final unstage: %v", err)
	}
}

// report logs and records the loop's figures.
func (l *crashLoop) report(rounds int) {
	total := 0
	var where []string
	for _, p := range []string{"stage", "write", "unstage", "idle", "between rounds"} {
		total += l.kills[p]
		where = append(where, fmt.Sprintf("%s %d", p, l.kills[p]))
	}
	summary := fmt.Sprintf("%d rounds, %d SIGKILLs of vco-agent serve and its helpers (%s), %d calls retried after a restart, %d retried after ABORTED (claim check busy); "+
		"invariants checked every round: marker files of all earlier rounds read back (%d reads, 0 lost), filesystem UUID %s unchanged (1 mkfs), "+
		"exactly one mount at the staging path while staged, no mount under the test root, no claim record and no new loop device after unstage",
		rounds, total, strings.Join(where, ", "), l.retries, l.busy, l.checks, l.fsUUID)
	l.t.Log(summary)
	fmt.Println("crash loop:", summary)
	figures.add("crash loop rounds", rounds)
	figures.add("crash loop SIGKILLs of the agent", total)
	figures.add("crash loop calls retried after a restart", l.retries)
	figures.add("crash loop marker reads (data lost: 0)", l.checks)
	figures.add("crash loop filesystem UUIDs seen (want 1)", 1)
	figures.note("Crash loop", summary)
}

func markerText(round int) string { return fmt.Sprintf("round %d\n", round) }

func writeMarker(t *testing.T, dir string, round int) {
	t.Helper()
	p := filepath.Join(dir, fmt.Sprintf("marker-%04d", round))
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(markerText(round)); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d, err := os.Open(dir)
	if err == nil {
		d.Sync()
		d.Close()
	}
}

func blkidUUID(t *testing.T, dev string) string {
	t.Helper()
	out, err := exec.Command("blkid", "-p", "-o", "value", "-s", "UUID", dev).Output()
	if err != nil || strings.TrimSpace(string(out)) == "" {
		t.Fatalf("blkid %s: %v %q", dev, err, out)
	}
	return strings.TrimSpace(string(out))
}

func countMountsAt(p string) int {
	n := 0
	for _, mp := range mountPoints() {
		if mp == p {
			n++
		}
	}
	return n
}
