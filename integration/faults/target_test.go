package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	fencekey "github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// restartTarget kills the lab's tgtd with SIGKILL -- the reservations it
// held in memory are gone, as tgt keeps no APTPL state -- and starts a new
// tgtd on the same control port and portal serving the same LUNs under the
// same target ids, names, serials and backing files, so that the guests'
// initiators reconnect to what looks like the same disk after a target
// reboot. The new tgtd is recorded in the lab's pid directory and killed
// when the test ends. Package lab starts tgtd only once, so the restart is
// here, from its exported pieces.
func restartTarget(t *testing.T, ctx context.Context, l *lab.Lab, luns ...*lab.LUN) time.Duration {
	t.Helper()
	tg := l.Target
	start := time.Now()
	if err := tg.Proc.Kill(); err != nil {
		t.Fatalf("killing tgtd (pid %d): %v", tg.Proc.PID, err)
	}
	logf, err := os.OpenFile(filepath.Join(l.Dir(), "tgtd.log"), os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command("tgtd", "-f", "-C", strconv.Itoa(tg.CtlPort), "--iscsi", fmt.Sprintf("portal=127.0.0.1:%d", tg.Port))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("restarting tgtd: %v", err)
	}
	pid := cmd.Process.Pid
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	pidFile := filepath.Join(lab.PIDDir(l.Dir()), fmt.Sprintf("tgtd-restart-%d.pid", pid))
	if st, err := procStartTime(pid); err == nil {
		_ = os.WriteFile(pidFile, fmt.Appendf(nil, "%d %d %s\n", pid, st, cmd.Path), 0o644)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		<-exited
		_ = os.Remove(pidFile)
	})
	tgtadm := func(args ...string) error {
		full := append([]string{"-C", strconv.Itoa(tg.CtlPort), "--lld", "iscsi"}, args...)
		out, err := exec.CommandContext(ctx, "tgtadm", full...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("tgtadm %v: %w: %s", full, err, out)
		}
		return nil
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := tgtadm("--mode", "sys", "--op", "show")
		if err == nil {
			var c net.Conn
			if c, err = net.DialTimeout("tcp", tg.Portal(), time.Second); err == nil {
				c.Close()
				break
			}
		}
		select {
		case <-exited:
			t.Fatalf("restarted tgtd exited (log %s)", filepath.Join(l.Dir(), "tgtd.log"))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("restarted tgtd not ready: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, lun := range luns {
		tid := strconv.Itoa(lun.TID)
		for _, s := range [][]string{
			{"--mode", "target", "--op", "new", "--tid", tid, "-T", lun.IQN},
			{"--mode", "logicalunit", "--op", "new", "--tid", tid, "--lun", "1", "-b", lun.File},
			{"--mode", "logicalunit", "--op", "update", "--tid", tid, "--lun", "1", "--params", "scsi_sn=" + lun.Serial + ",scsi_id=" + lun.SCSIID},
			{"--mode", "target", "--op", "bind", "--tid", tid, "-I", "ALL"},
		} {
			if err := tgtadm(s...); err != nil {
				t.Fatalf("serving %s again: %v", lun.IQN, err)
			}
		}
	}
	return time.Since(start)
}

// procStartTime is field 22 of /proc/PID/stat, recorded with the pid so a
// later cleanup never kills a recycled pid.
func procStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
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
	restartStaging = "/var/lib/kubelet/plugins/kubernetes.io/csi/cloud.whitesky.csi/vol-restart/globalmount"
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

// targetRefusesWrite clears the block layer's read-only flag the agent
// set on a refused or fenced disk, so that the write reaches the target,
// and asserts that the target refuses it (the fence is the target's, not
// only the host's flag).
func targetRefusesWrite(t *testing.T, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	if _, err := g.MustSh(ctx, "blockdev --setrw "+dev); err != nil {
		t.Fatal(err)
	}
	mustNotWrite(t, ctx, g, dev, n, marker)
}

// TestTargetRestart restarts the iSCSI target while node-a's agent holds
// a disk that node-b also sees. The restart wipes every registration and
// reservation. The contract (issue 9): the holder re-establishes its claim
// only if no other key appeared, otherwise it fences itself; the other
// node never gains access without a grant.
//
// Both nodes run the agent, and every claim goes through it, as the CSI
// node plugin's would. What the test proves about node-b: while node-a
// holds the disk (before the restart, and once its agent re-established
// the claim) node-b's agent refuses to stage it without a grant, naming
// node-a's key, and the target refuses node-b's writes; so does the
// low-level `vco-agent fence acquire`, which an operator runs by hand.
// What it cannot prove, because it is not so: in the window between the
// restart and node-a's next check the target holds no reservation, so
// there is no holder to refuse and no grant to ask for, and a node-b asked
// to stage the disk then gets it (the second sub-test makes node-b move
// first by pausing node-a's agent). The contract then holds on node-a's
// side: it fences itself at once, never takes the disk back without a
// grant, and the target refuses its writes.
func TestTargetRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	l := newLab(t, ctx)
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 256}, lab.GuestConfig{Name: "node-b", MemMB: 256})
	if err != nil {
		t.Fatal(err)
	}
	a, b := gs[0], gs[1]
	nodes := []*lab.Guest{a, b}
	lun, err := l.AddLUN(ctx, "restart", 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	devA, devB := attach(t, ctx, a, lun), attach(t, ctx, b, lun)
	startLoadAgent(t, ctx, a)
	startLoadAgent(t, ctx, b)
	keyA, keyB := hexKey(t, a), hexKey(t, b)
	restarts, lost := 0, 0

	// refused asserts that node-b gets no access without a grant while
	// node-a holds the disk: its agent refuses the stage naming node-a's
	// key, the operator's acquire is refused naming node-a, and the
	// target refuses its write.
	refused := func(block int, marker string) {
		t.Helper()
		r := stageRestartVolume(t, ctx, b, lun.Serial)
		if r.Exit == 0 || !strings.Contains(r.Stderr, "held by another node") || !strings.Contains(r.Stderr, keyA) {
			t.Fatalf("node-b: stage without a grant while node-a holds the disk: want a refusal naming key %s, got %s", keyA, r)
		}
		rep, code, out, err := fence(ctx, b, nodes, "acquire", devB)
		if err != nil {
			t.Fatal(err)
		}
		if code == 0 || !rep.Refused || rep.HolderNode != a.Name {
			t.Fatalf("node-b: fence acquire %s without a grant: want a refusal naming node-a, got exit %d: %s", devB, code, out)
		}
		targetRefusesWrite(t, ctx, b, devB, block, marker)
	}

	if r := stageRestartVolume(t, ctx, a, lun.Serial); r.Exit != 0 {
		t.Fatalf("node-a: stage: %s", r)
	}
	mustWrite(t, ctx, a, devA, 0, "restart-a-before")
	refused(1, "restart-b-before")

	t.Run("no other key: the agent re-establishes by itself", func(t *testing.T) {
		d := restartTarget(t, ctx, l, lun)
		restarts++
		figure(t, "target_restart_ms", d.Milliseconds())
		restarted := time.Now()
		figure(t, "target_reconnect_a_ms", untilDeviceAnswers(t, ctx, a, devA).Milliseconds())
		answered := time.Now()
		// The agent checks every second (loadAgentConfig); polling the
		// events through the guest adds its own delay, so allow a few.
		ev := waitAgentEvent(t, ctx, a, "EVENT_TYPE_DISK_CLAIMED", 2, 15*time.Second)
		figure(t, "target_restart_reestablished_ms", time.Since(restarted).Milliseconds())
		figure(t, "target_restart_reestablished_after_reconnect_ms", time.Since(answered).Milliseconds())
		if ev.Reason != "reservation-reestablished" || ev.HolderKey != keyA {
			t.Fatalf("node-a's second DiskClaimed: %+v, want the re-established claim with key %s", ev, keyA)
		}
		t.Logf("node-a: %s", ev.Message)
		if evs := agentEvents(t, ctx, a, "EVENT_TYPE_DISK_FENCED"); len(evs) != 0 {
			t.Fatalf("node-a fenced itself although no other key appeared: %+v", evs)
		}
		if n := metric(t, ctx, a, `vco_agent_reestablishes_total{result="ok"}`); n != 1 {
			t.Fatalf("node-a counts %v re-established claims, want 1", n)
		}
		// node-a keeps writing; node-b still gets nothing without a grant.
		mustWrite(t, ctx, a, devA, 2, "restart-a-after-reestablish")
		untilDeviceAnswers(t, ctx, b, devB)
		refused(3, "restart-b-after-reestablish")
		if got := backingBlock(t, lun.File, 2); got != "restart-a-after-reestablish" {
			t.Errorf("block 2 holds %q, want node-a's write after the re-establish", got)
		}
	})

	t.Run("another key appeared: the holder fences itself", func(t *testing.T) {
		// Pause node-a's agent so that node-b moves first, inside the
		// window a check interval would otherwise close.
		if _, err := a.MustSh(ctx, "kill -STOP $(cat /run/agent.pid)"); err != nil {
			t.Fatal(err)
		}
		paused := true
		defer func() {
			if paused {
				_, _ = a.MustSh(ctx, "kill -CONT $(cat /run/agent.pid)")
			}
		}()
		d := restartTarget(t, ctx, l, lun)
		restarts++
		figure(t, "target_restart_ms", d.Milliseconds())
		untilDeviceAnswers(t, ctx, b, devB)
		r := stageRestartVolume(t, ctx, b, lun.Serial)
		bWon := r.Exit == 0
		figure(t, "target_restart_window_other_node_claimed", map[bool]int{true: 1, false: 0}[bWon])
		if !bWon {
			t.Fatalf("node-b's stage after the restart, with node-a's agent paused, failed: %s", r)
		}
		t.Logf("FINDING: with the restarted target holding no reservation, node-b's agent staged the disk without a grant before node-a's next check; the window is node-a's check interval")
		mustWrite(t, ctx, b, devB, 4, "restart-b-claimed")

		if _, err := a.MustSh(ctx, "kill -CONT $(cat /run/agent.pid)"); err != nil {
			t.Fatal(err)
		}
		paused = false
		ev := waitAgentEvent(t, ctx, a, "EVENT_TYPE_DISK_FENCED", 1, 30*time.Second)
		lost++
		if ev.HolderKey != keyB {
			t.Errorf("node-a's DiskFenced names holder key %q, want node-b's %s: %+v", ev.HolderKey, keyB, ev)
		}
		t.Logf("node-a: %s", ev.Message)
		if n := metric(t, ctx, a, `vco_agent_reestablishes_total{result="ok"}`); n != 1 {
			t.Errorf("node-a counts %v re-established claims, want still 1", n)
		}
		// node-a does not take the disk back without a grant ...
		r = stageRestartVolume(t, ctx, a, lun.Serial)
		if r.Exit == 0 || !strings.Contains(r.Stderr, "grant") {
			t.Fatalf("node-a: stage of its fenced volume without a grant: want a refusal asking for a grant, got %s", r)
		}
		// ... and the target refuses its writes.
		targetRefusesWrite(t, ctx, a, devA, 5, "restart-a-fenced")
		if backingHas(t, lun.File, "restart-a-fenced") {
			t.Error("node-a's write after the loss reached the LUN")
		}
		if got := backingBlock(t, lun.File, 4); got != "restart-b-claimed" {
			t.Errorf("block 4 holds %q, want node-b's write", got)
		}
	})
	figure(t, "target_restart_faults", restarts)
	figure(t, "target_restart_losses_noticed", lost)
	dataLost := 0
	if backingBlock(t, lun.File, 0) != "restart-a-before" {
		dataLost++
	}
	figure(t, "target_restart_blocks_lost", dataLost)
	if dataLost > 0 {
		t.Error("node-a's data written before the restarts is gone")
	}
}
