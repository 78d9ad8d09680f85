package faults

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	fencekey "github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/lab/labtest"
)

// restartTarget restarts the lab's tgtd (lab.Target.Restart: its
// reservations are lost, the same LUNs are served again) and returns how
// long that took.
func restartTarget(t *testing.T, ctx context.Context, l *lab.Lab, luns ...*lab.LUN) time.Duration {
	t.Helper()
	start := time.Now()
	if err := l.Target.Restart(ctx, luns...); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}

// untilDeviceAnswers retries a harmless read of dev in g until the
// initiator has reconnected to the restarted target.
func untilDeviceAnswers(t *testing.T, ctx context.Context, g *lab.Guest, dev string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		r, err := g.Sh(ctx, "dd if="+dev+" of=/dev/null bs=4096 count=1 iflag=direct 2>&1")
		if err != nil {
			t.Fatal(err)
		}
		if r.Exit == 0 {
			return time.Since(start)
		}
		if time.Since(start) > 3*time.Minute {
			t.Fatalf("%s: %s does not answer after the target restart: %s", g.Name, dev, r)
		}
		time.Sleep(time.Second)
	}
}

// restartVolume is the volume the agents stage in TestTargetRestart, as
// the CSI node plugin would (a raw block volume: the test writes to the
// device itself).
const (
	restartVolume  = "vol-restart"
	restartStaging = "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/vol-restart"
)

// stageRestartVolume asks g's agent to stage the LUN with serial as
// restartVolume, without a grant. An ABORTED answer (the agent's claim
// check holds the volume at that moment) is retried, as kubelet retries.
func stageRestartVolume(t *testing.T, ctx context.Context, g *lab.Guest, serial string) *guestexec.Result {
	t.Helper()
	argv := []string{"/bin/vco-agent", "volume", "stage", restartVolume, "--serial", serial, "--block", "--staging", restartStaging}
	for i := 0; ; i++ {
		r, err := g.Exec().Run(ctx, 0, argv...)
		if err != nil {
			t.Fatal(err)
		}
		if r.Exit == 0 || !strings.Contains(r.Stderr, "Aborted") || i == 30 {
			return r
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// agentEvent is one line of `vco-agent events --json`.
type agentEvent struct {
	Type      string `json:"type"`
	Volume    string `json:"volume"`
	HolderKey string `json:"holder_key"`
	Reason    string `json:"reason"`
	Message   string `json:"message"`
}

// agentEvents returns the events g's agent keeps of type typ (the API's
// name, e.g. EVENT_TYPE_DISK_FENCED) for restartVolume.
func agentEvents(t *testing.T, ctx context.Context, g *lab.Guest, typ string) []agentEvent {
	t.Helper()
	r, err := g.Exec().Run(ctx, 0, "/bin/vco-agent", "events", "--json")
	if err != nil {
		t.Fatal(err)
	}
	if r.Exit != 0 {
		t.Fatalf("%s: vco-agent events: %s", g.Name, r)
	}
	var out []agentEvent
	for _, line := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
		var e agentEvent
		if json.Unmarshal([]byte(line), &e) == nil && e.Type == typ && e.Volume == restartVolume {
			out = append(out, e)
		}
	}
	return out
}

// waitAgentEvent polls g's agent until it has published n events of type
// typ for restartVolume, and returns the n-th.
func waitAgentEvent(t *testing.T, ctx context.Context, g *lab.Guest, typ string, n int, within time.Duration) agentEvent {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		if evs := agentEvents(t, ctx, g, typ); len(evs) >= n {
			return evs[n-1]
		}
		if time.Now().After(deadline) {
			log, _ := g.MustSh(ctx, "tail -n 30 /run/agent.log")
			t.Fatalf("%s: no %s event #%d for %s within %s; agent log:\n%s", g.Name, typ, n, restartVolume, within, log)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// hexKey is a node's fence key as events carry it (16 hex digits).
func hexKey(t *testing.T, g *lab.Guest) string {
	t.Helper()
	k, err := fencekey.KeyFromUUID(g.UUID)
	if err != nil {
		t.Fatalf("%s: %v", g.Name, err)
	}
	return strings.TrimPrefix(k.String(), "0x")
}

// prState is the PR generation of dev, and how many keys are registered,
// as g reads them (vco-agent fence show).
func prState(t *testing.T, ctx context.Context, g *lab.Guest, dev string) (generation uint32, keys int) {
	t.Helper()
	r, err := g.Exec().Run(ctx, 0, "/bin/vco-agent", "fence", "show", dev, "--json")
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Status struct {
			Generation uint32            `json:"generation"`
			Keys       []json.RawMessage `json:"keys"`
		} `json:"status"`
	}
	if r.Exit != 0 || json.Unmarshal([]byte(r.Stdout), &rep) != nil {
		t.Fatalf("%s: vco-agent fence show %s: %s", g.Name, dev, r)
	}
	return rep.Status.Generation, len(rep.Status.Keys)
}

// targetRefusesWrite clears the block layer's read-only flag the agent
// set on a refused or fenced disk, so that the write reaches the target,
// and asserts that the target refuses it (the fence is the target's, not
// only the host's flag).
func targetRefusesWrite(t *testing.T, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	if _, err := g.MustSh(ctx, "blockdev --setrw "+dev); err != nil {
		t.Fatal(err)
	}
	labtest.MustNotWrite(t, ctx, g, dev, n, marker)
}

// TestTargetRestart restarts the iSCSI target while node-a's agent holds
// a disk that node-b also sees. The restart wipes every registration and
// reservation. The contract (docs/fencing.md): the holder re-establishes its claim
// only if no other key appeared, otherwise it fences itself; the other
// node never gains access without a grant.
//
// Both nodes run the agent, and every claim goes through it, as the CSI
// node plugin's would. While node-a holds the disk (before the restarts,
// and once its agent re-established the claim) node-b's agent refuses to
// stage it without a grant, naming node-a's key, and the target refuses
// node-b's writes; so does the low-level `vco-agent fence acquire`, which
// an operator runs by hand. Between a restart and node-a's next check the
// target holds no reservation; node-b's agent, asked to stage the disk
// then (the second sub-test pauses node-a's agent so that it is), finds
// no registration since the target started on a disk with data, and waits
// (volumes.reclaim_wait) instead of claiming it: node-a re-establishes
// during the wait and node-b is refused. The third sub-test has node-b
// claim the restarted target by hand, which does not wait: node-a then
// fences itself, never takes the disk back without a grant, and the
// target refuses its writes. Once node-b releases, tgt shows the target
// empty at a PR generation above 0, and node-b's stage claims it at once.
func TestTargetRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	l := newLab(t, ctx)
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 256}, lab.GuestConfig{Name: "node-b", MemMB: 256})
	if err != nil {
		t.Fatal(err)
	}
	a, b := gs[0], gs[1]
	lun, err := l.AddLUN(ctx, "restart", 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	s := &restartStory{ctx: ctx, l: l, lun: lun, a: a, b: b, nodes: []*lab.Guest{a, b}}
	s.devA, s.devB = attach(t, ctx, a, lun), attach(t, ctx, b, lun)
	startLoadAgent(t, ctx, a)
	startLoadAgent(t, ctx, b)
	s.keyA, s.keyB = hexKey(t, a), hexKey(t, b)

	if r := stageRestartVolume(t, ctx, a, lun.Serial); r.Exit != 0 {
		t.Fatalf("node-a: stage: %s", r)
	}
	labtest.MustWrite(t, ctx, a, s.devA, 0, "restart-a-before")
	s.refused(t, 1, "restart-b-before")

	t.Run("no other key: the agent re-establishes by itself", s.holderReestablishesAlone)
	t.Run("the other node asks first: it waits, the holder re-establishes, it is refused", s.otherNodeWaitsAndIsRefused)
	t.Run("another key appeared: the holder fences itself", s.holderFencesItself)
	figure(t, "target_restart_faults", s.restarts)
	figure(t, "target_restart_losses_noticed", s.lost)
	dataLost := 0
	if backingBlock(t, lun.File, 0) != "restart-a-before" {
		dataLost++
	}
	figure(t, "target_restart_blocks_lost", dataLost)
	if dataLost > 0 {
		t.Error("node-a's data written before the restarts is gone")
	}
}

// restartStory is TestTargetRestart's lab, LUN and nodes, and its tallies.
type restartStory struct {
	ctx        context.Context
	l          *lab.Lab
	lun        *lab.LUN
	a, b       *lab.Guest
	nodes      []*lab.Guest
	devA, devB string
	keyA, keyB string
	restarts   int
	lost       int
}

// refused asserts that node-b gets no access without a grant while
// node-a holds the disk: its agent refuses the stage naming node-a's
// key, the operator's acquire is refused naming node-a, and the
// target refuses its write.
func (s *restartStory) refused(t *testing.T, block int, marker string) {
	t.Helper()
	ctx, b := s.ctx, s.b
	r := stageRestartVolume(t, ctx, b, s.lun.Serial)
	if r.Exit == 0 || !strings.Contains(r.Stderr, "held by another node") || !strings.Contains(r.Stderr, s.keyA) {
		t.Fatalf("node-b: stage without a grant while node-a holds the disk: want a refusal naming key %s, got %s", s.keyA, r)
	}
	rep, code, out, err := fence(ctx, b, s.nodes, "acquire", s.devB)
	if err != nil {
		t.Fatal(err)
	}
	if code == 0 || !rep.Refused || rep.HolderNode != s.a.Name {
		t.Fatalf("node-b: fence acquire %s without a grant: want a refusal naming node-a, got exit %d: %s", s.devB, code, out)
	}
	targetRefusesWrite(t, ctx, b, s.devB, block, marker)
}

// holderReestablishesAlone: after a restart with no other key, node-a's
// agent re-establishes its claim by itself, without fencing itself; it
// keeps writing and node-b still gets nothing without a grant.
func (s *restartStory) holderReestablishesAlone(t *testing.T) {
	ctx, a := s.ctx, s.a
	d := restartTarget(t, ctx, s.l, s.lun)
	s.restarts++
	figure(t, "target_restart_ms", d.Milliseconds())
	restarted := time.Now()
	figure(t, "target_reconnect_a_ms", untilDeviceAnswers(t, ctx, a, s.devA).Milliseconds())
	answered := time.Now()
	// The agent checks every second (loadAgentConfig); polling the
	// events through the guest adds its own delay, so allow a few.
	ev := waitAgentEvent(t, ctx, a, "EVENT_TYPE_DISK_CLAIMED", 2, 15*time.Second)
	figure(t, "target_restart_reestablished_ms", time.Since(restarted).Milliseconds())
	figure(t, "target_restart_reestablished_after_reconnect_ms", time.Since(answered).Milliseconds())
	if ev.Reason != "reservation-reestablished" || ev.HolderKey != s.keyA {
		t.Fatalf("node-a's second DiskClaimed: %+v, want the re-established claim with key %s", ev, s.keyA)
	}
	t.Logf("node-a: %s", ev.Message)
	if evs := agentEvents(t, ctx, a, "EVENT_TYPE_DISK_FENCED"); len(evs) != 0 {
		t.Fatalf("node-a fenced itself although no other key appeared: %+v", evs)
	}
	if n := metric(t, ctx, a, `vco_agent_reestablishes_total{result="ok"}`); n != 1 {
		t.Fatalf("node-a counts %v re-established claims, want 1", n)
	}
	// node-a keeps writing; node-b still gets nothing without a grant.
	labtest.MustWrite(t, ctx, a, s.devA, 2, "restart-a-after-reestablish")
	untilDeviceAnswers(t, ctx, s.b, s.devB)
	s.refused(t, 3, "restart-b-after-reestablish")
	if got := backingBlock(t, s.lun.File, 2); got != "restart-a-after-reestablish" {
		t.Errorf("block 2 holds %q, want node-a's write after the re-establish", got)
	}
}

// restartWithHolderPaused stops node-a's agent (SIGSTOP) and restarts
// the target, so that node-b moves before node-a's next check. The
// agent runs again when resume is called, or the sub-test ends.
func (s *restartStory) restartWithHolderPaused(t *testing.T) (resume func()) {
	t.Helper()
	ctx, a := s.ctx, s.a
	if _, err := a.MustSh(ctx, "kill -STOP $(cat /run/agent.pid)"); err != nil {
		t.Fatal(err)
	}
	paused := true
	resume = func() {
		if paused {
			paused = false
			if _, err := a.MustSh(ctx, "kill -CONT $(cat /run/agent.pid)"); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(resume)
	d := restartTarget(t, ctx, s.l, s.lun)
	s.restarts++
	figure(t, "target_restart_ms", d.Milliseconds())
	untilDeviceAnswers(t, ctx, s.b, s.devB)
	return resume
}

// restartStaged is how node-b's stage of the restart volume ended.
type restartStaged struct {
	r    *guestexec.Result
	err  error
	took time.Duration
}

// otherNodeWaitsAndIsRefused: node-b's stage finds the restarted target
// empty at PR generation 0, and a disk with data on it: it waits for a
// holder, node-a re-establishes, and node-b is refused naming node-a's
// key; node-a keeps its claim and its writes.
func (s *restartStory) otherNodeWaitsAndIsRefused(t *testing.T) {
	ctx, a, b := s.ctx, s.a, s.b
	resume := s.restartWithHolderPaused(t)
	done := make(chan restartStaged, 1)
	go func() {
		start := time.Now()
		r, err := b.Exec().Run(ctx, 0, "/bin/vco-agent", "volume", "stage", restartVolume, "--serial", s.lun.Serial, "--block", "--staging", restartStaging)
		done <- restartStaged{r, err, time.Since(start)}
	}()
	s.untilWaitingForAHolder(t, done)
	resume()
	ev := waitAgentEvent(t, ctx, a, "EVENT_TYPE_DISK_CLAIMED", 3, time.Minute)
	if ev.Reason != "reservation-reestablished" || ev.HolderKey != s.keyA {
		t.Fatalf("node-a's third DiskClaimed: %+v, want the re-established claim with key %s", ev, s.keyA)
	}
	var st restartStaged
	select {
	case st = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("node-b's stage did not end after node-a re-established")
	}
	if st.err != nil {
		t.Fatal(st.err)
	}
	figure(t, "target_restart_other_node_stage_ms", st.took.Milliseconds())
	if st.r.Exit == 0 || !strings.Contains(st.r.Stderr, "held by another node") || !strings.Contains(st.r.Stderr, s.keyA) {
		t.Fatalf("node-b: stage that waited while node-a re-established: want a refusal naming key %s, got %s", s.keyA, st.r)
	}
	t.Logf("node-b: %s", strings.TrimSpace(st.r.Stderr))
	if n := metric(t, ctx, b, `vco_agent_reclaim_waits_total{result="refused"}`); n != 1 {
		t.Fatalf("node-b counts %v waits ended by a holder, want 1", n)
	}
	if evs := agentEvents(t, ctx, a, "EVENT_TYPE_DISK_FENCED"); len(evs) != 0 {
		t.Fatalf("node-a fenced itself although node-b only waited: %+v", evs)
	}
	if n := metric(t, ctx, a, `vco_agent_reestablishes_total{result="ok"}`); n != 2 {
		t.Fatalf("node-a counts %v re-established claims, want 2", n)
	}
	// node-a keeps its claim and its writes; node-b gets nothing.
	labtest.MustWrite(t, ctx, a, s.devA, 4, "restart-a-after-b-waited")
	s.refused(t, 5, "restart-b-after-waiting")
	if got := backingBlock(t, s.lun.File, 4); got != "restart-a-after-b-waited" {
		t.Errorf("block 4 holds %q, want node-a's write", got)
	}
}

// untilWaitingForAHolder waits up to two minutes for node-b's agent to
// say it waits for a holder to re-establish; its stage must not end
// before.
func (s *restartStory) untilWaitingForAHolder(t *testing.T, done <-chan restartStaged) {
	t.Helper()
	ctx, b := s.ctx, s.b
	deadline := time.Now().Add(2 * time.Minute)
	for {
		out, err := b.MustSh(ctx, "grep -c 'waiting for a holder to re-establish' /run/agent.log || true")
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(out) != "0" {
			return
		}
		select {
		case st := <-done:
			t.Fatalf("node-b's stage ended before node-b waited for a holder: %v %s", st.err, st.r)
		default:
		}
		if time.Now().After(deadline) {
			log, _ := b.MustSh(ctx, "tail -n 30 /run/agent.log")
			t.Fatalf("node-b's agent did not start waiting for a holder; its log:\n%s", log)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// holderFencesItself: an operator's `fence acquire` does not wait: node-b
// claims the restarted target by hand. node-a then fences itself naming
// node-b's key, does not take the disk back without a grant, and the
// target refuses its writes; once node-b releases, its stage claims the
// disk at once.
func (s *restartStory) holderFencesItself(t *testing.T) {
	ctx, a, b := s.ctx, s.a, s.b
	resume := s.restartWithHolderPaused(t)
	rep, code, out, err := fence(ctx, b, s.nodes, "acquire", s.devB)
	if err != nil {
		t.Fatal(err)
	}
	if code != 0 || !rep.OK {
		t.Fatalf("node-b: fence acquire %s by hand on the restarted target: exit %d: %s", s.devB, code, out)
	}
	// The refusal earlier left node-b's device read-only.
	if _, err := b.MustSh(ctx, "blockdev --setrw "+s.devB); err != nil {
		t.Fatal(err)
	}
	labtest.MustWrite(t, ctx, b, s.devB, 6, "restart-b-by-hand")

	resume()
	ev := waitAgentEvent(t, ctx, a, "EVENT_TYPE_DISK_FENCED", 1, time.Minute)
	s.lost++
	if ev.HolderKey != s.keyB {
		t.Errorf("node-a's DiskFenced names holder key %q, want node-b's %s: %+v", ev.HolderKey, s.keyB, ev)
	}
	t.Logf("node-a: %s", ev.Message)
	if n := metric(t, ctx, a, `vco_agent_reestablishes_total{result="ok"}`); n != 2 {
		t.Errorf("node-a counts %v re-established claims, want still 2", n)
	}
	// node-a does not take the disk back without a grant ...
	r := stageRestartVolume(t, ctx, a, s.lun.Serial)
	if r.Exit == 0 || !strings.Contains(r.Stderr, "grant") {
		t.Fatalf("node-a: stage of its fenced volume without a grant: want a refusal asking for a grant, got %s", r)
	}
	// ... and the target refuses its writes.
	targetRefusesWrite(t, ctx, a, s.devA, 7, "restart-a-fenced")
	if backingHas(t, s.lun.File, "restart-a-fenced") {
		t.Error("node-a's write after the loss reached the LUN")
	}
	if got := backingBlock(t, s.lun.File, 6); got != "restart-b-by-hand" {
		t.Errorf("block 6 holds %q, want node-b's write", got)
	}
	if _, code, out, err := fence(ctx, b, s.nodes, "release", s.devB); err != nil || code != 0 {
		t.Fatalf("node-b: fence release: %v exit %d: %s", err, code, out)
	}
	s.releasedIsClaimedAtOnce(t)
}

// releasedIsClaimedAtOnce: what the reclaim wait rests on, on tgt: a
// release leaves the target empty at a PR generation above 0, so the next
// stage without a grant claims the disk at once, data and all.
func (s *restartStory) releasedIsClaimedAtOnce(t *testing.T) {
	t.Helper()
	ctx, b := s.ctx, s.b
	gen, keys := prState(t, ctx, b, s.devB)
	figure(t, "target_restart_generation_after_release", gen)
	if gen == 0 || keys != 0 {
		t.Fatalf("after node-b's release the target shows %d keys at PR generation %d, want none at a generation above 0", keys, gen)
	}
	if r := stageRestartVolume(t, ctx, b, s.lun.Serial); r.Exit != 0 {
		t.Fatalf("node-b: stage of the released disk: %s", r)
	}
	if n := metric(t, ctx, b, `vco_agent_reclaim_waits_total{result="claimed"}`); n != 0 {
		t.Fatalf("node-b waited %v times before claiming a disk released by its holder", n)
	}
	labtest.MustWrite(t, ctx, b, s.devB, 8, "restart-b-staged-after-release")
}
