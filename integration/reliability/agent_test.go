package reliability

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// agentBin is vco-agent built once for the package's tests.
var agentBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vco-reliability-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	agentBin = filepath.Join(dir, "vco-agent")
	if b := os.Getenv("VCO_AGENT_BIN"); b != "" {
		agentBin = b
	} else if out, err := exec.Command("go", "build", "-o", agentBin, "github.com/whitesky-cloud/vco-storage/cmd/vco-agent").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building vco-agent: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	if code == 0 {
		if p := os.Getenv("VCO_RELIABILITY_REPORT"); p != "" {
			if err := writeReport(p); err != nil {
				fmt.Fprintln(os.Stderr, "writing the report:", err)
				code = 1
			}
		}
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func needRoot(t *testing.T) {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices and mounts", "losetup", "blkid", "mkfs.ext4")
}

const nodeUUID = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"

// host is one agent's world: its directories, its disk and, while it
// runs, the `vco-agent serve` process.
type host struct {
	t       *testing.T
	dir     string
	kubelet string
	state   string
	sysfs   string
	cfg     string
	sock    string
	metrics string
	img     string
	loop    string

	// env is added to the agent's environment when it starts.
	env       []string
	closeOnce sync.Once

	mu   sync.Mutex
	logs bytes.Buffer // every agent run's stderr, appended
	cmd  *exec.Cmd
	done chan struct{}
	c    *client.Client
}

// newHost makes the directories, a 64 MiB image on a loop device, a
// fixture sysfs (identity from a file, disks from the real /sys) and the
// configuration; it does not start the agent.
func newHost(t *testing.T) *host {
	t.Helper()
	needRoot(t)
	dir, err := os.MkdirTemp("", "vco-rel-")
	if err != nil {
		t.Fatal(err)
	}
	h := &host{t: t, dir: dir, kubelet: filepath.Join(dir, "kubelet"), state: filepath.Join(dir, "state"),
		sysfs: filepath.Join(dir, "sysfs"), cfg: filepath.Join(dir, "config.yaml"), sock: filepath.Join(dir, "agent.sock"),
		img: filepath.Join(dir, "disk.img")}
	t.Cleanup(h.close)
	os.MkdirAll(h.kubelet, 0o755)
	os.MkdirAll(filepath.Join(h.sysfs, "class/dmi/id"), 0o755)
	os.WriteFile(filepath.Join(h.sysfs, "class/dmi/id/product_uuid"), []byte(strings.ToUpper(nodeUUID)+"\n"), 0o444)
	for _, d := range []string{"block", "dev"} {
		if err := os.Symlink("/sys/"+d, filepath.Join(h.sysfs, d)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(h.img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(h.img, 64<<20)
	out, err := exec.Command("losetup", "--find", "--show", h.img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	h.loop = strings.TrimSpace(string(out))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.metrics = l.Addr().String()
	l.Close()
	cfg := fmt.Sprintf("state_dir: %s\nlog:\n  level: debug\nvolumes:\n  kubelet_root: %s\n  allow_unfenced: true\n  allow_loop_devices: true\n  check_interval: 200ms\nmetrics:\n  listen: %s\n",
		h.state, h.kubelet, h.metrics)
	if err := os.WriteFile(h.cfg, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

// close stops the agent and removes the host: its mounts, its loop device
// and its directories (the agent's log is shown first if the test failed).
// It runs when the test ends, or earlier for a test that makes many hosts.
func (h *host) close() {
	h.closeOnce.Do(func() {
		h.stop()
		unmountUnder(h.dir)
		if h.loop != "" {
			exec.Command("losetup", "-d", h.loop).Run()
		}
		if h.t.Failed() {
			h.t.Logf("agent log:\n%s", h.log())
		}
		os.RemoveAll(h.dir)
	})
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (h *host) log() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.logs.String()
}

// start runs `vco-agent serve` and waits until it answers on the socket.
func (h *host) start() {
	h.t.Helper()
	cmd := exec.Command(agentBin, "serve", "--config", h.cfg, "--socket", h.sock, "--sysfs-root", h.sysfs, "--dbus=false")
	// Its own process group, so that a kill takes the helpers it runs
	// (mount, mkfs, fsck) with it, as systemd's stop of the unit's cgroup
	// does when the daemon dies.
	cmd.SysProcAttr = &unix.SysProcAttr{Setpgid: true}
	if h.env != nil {
		cmd.Env = append(os.Environ(), h.env...)
	}
	cmd.Stdout = lockedWriter{&h.mu, &h.logs}
	cmd.Stderr = lockedWriter{&h.mu, &h.logs}
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	h.cmd, h.done = cmd, done
	for deadline := time.Now().Add(20 * time.Second); ; {
		c, err := client.Dial(h.sock)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_, err = c.GetStatus(ctx, &api.GetStatusRequest{})
			cancel()
			if err == nil {
				h.c = c
				return
			}
			c.Close()
		}
		select {
		case <-done:
			h.t.Fatalf("agent exited at start: %v\n%s", cmd.ProcessState, h.log())
		default:
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("agent not up: %v\n%s", err, h.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill SIGKILLs the agent, as a crash or the OOM killer would.
func (h *host) kill() {
	if h.cmd == nil {
		return
	}
	killGroup(h.cmd)
	<-h.done
	h.closeClient()
}

// killGroup SIGKILLs the agent and every helper it started.
func killGroup(cmd *exec.Cmd) {
	unix.Kill(-cmd.Process.Pid, unix.SIGKILL)
	cmd.Process.Signal(unix.SIGKILL)
}

// stop ends the agent the way systemd does.
func (h *host) stop() {
	if h.cmd == nil {
		return
	}
	h.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-h.done:
	case <-time.After(15 * time.Second):
		killGroup(h.cmd)
		<-h.done
	}
	h.closeClient()
}

func (h *host) closeClient() {
	if h.c != nil {
		h.c.Close()
		h.c = nil
	}
	h.cmd = nil
}

func (h *host) scrapeMetrics() string {
	h.t.Helper()
	resp, err := http.Get("http://" + h.metrics + "/metrics")
	if err != nil {
		h.t.Fatalf("metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// snapshot is what a refused request must leave unchanged.
type snapshot struct {
	mounts []string // mounts under the test directory or of its loop devices
	states []string // files under the state directory
	loops  []string // the host's loop devices with their backing files
}

func (h *host) snap() snapshot {
	h.t.Helper()
	var s snapshot
	s.loops = h.loopDevices()
	ours := map[string]bool{}
	for _, l := range s.loops {
		ours[strings.Fields(l)[0]] = true
	}
	for _, m := range mounts() {
		if strings.HasPrefix(m[0], h.dir+"/") || ours[m[1]] {
			s.mounts = append(s.mounts, m[0]+" from "+m[1])
		}
	}
	filepath.Walk(h.state, func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			s.states = append(s.states, fmt.Sprintf("%s %v %d", p, fi.Mode(), fi.Size()))
		}
		return nil
	})
	return s
}

// loopDevices lists the loop devices that belong to this host. Other
// tests on the machine make loop devices of their own at the same time.
func (h *host) loopDevices() []string { return loopsUnder(h.t, h.dir) }

// loopsUnder lists the loop devices backed by a file under dir, or
// stacked on one that is, as "NAME BACK-FILE".
func loopsUnder(t *testing.T, dir string) []string {
	all := loopDevices(t)
	ours := map[string]bool{}
	for changed := true; changed; {
		changed = false
		for _, l := range all {
			f := strings.SplitN(l, " ", 2)
			if len(f) == 2 && !ours[f[0]] && (strings.HasPrefix(f[1], dir+"/") || ours[f[1]]) {
				ours[f[0]], changed = true, true
			}
		}
	}
	var out []string
	for _, l := range all {
		if ours[strings.Fields(l)[0]] {
			out = append(out, l)
		}
	}
	return out
}

func (a snapshot) diff(b snapshot) string {
	var d []string
	if strings.Join(a.mounts, "\n") != strings.Join(b.mounts, "\n") {
		d = append(d, fmt.Sprintf("mounts %v -> %v", a.mounts, b.mounts))
	}
	if strings.Join(a.states, "\n") != strings.Join(b.states, "\n") {
		d = append(d, fmt.Sprintf("state files %v -> %v", a.states, b.states))
	}
	if strings.Join(a.loops, "\n") != strings.Join(b.loops, "\n") {
		d = append(d, fmt.Sprintf("loop devices %v -> %v", a.loops, b.loops))
	}
	return strings.Join(d, "; ")
}

// mounts lists every mount as mount point and source.
func mounts() [][2]string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out [][2]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		for i := 6; i < len(fs)-2; i++ {
			if fs[i] == "-" {
				out = append(out, [2]string{fs[4], fs[i+2]})
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

func mountPoints() []string {
	var out []string
	for _, m := range mounts() {
		out = append(out, m[0])
	}
	return out
}

func loopDevices(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").Output()
	if err != nil {
		t.Fatalf("losetup --list: %v", err)
	}
	var l []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line = strings.Join(strings.Fields(line), " "); line != "" {
			l = append(l, line)
		}
	}
	sort.Strings(l)
	return l
}

func unmountUnder(dir string) {
	mps := mountPoints()
	for i := len(mps) - 1; i >= 0; i-- {
		if strings.HasPrefix(mps[i], dir+"/") {
			unix.Unmount(mps[i], unix.MNT_DETACH)
		}
	}
}

// askTimeout bounds how long stage and unstage ask again on ABORTED.
const askTimeout = time.Minute

// stage and unstage ask the agent as the kubelet does: again on ABORTED
// (client.AskAgain).
func (h *host) stage(ctx context.Context, req *api.StageVolumeRequest) error {
	ctx, cancel := context.WithTimeout(ctx, askTimeout)
	defer cancel()
	return client.AskAgain(ctx, func(ctx context.Context) error { _, err := h.c.StageVolume(ctx, req); return err })
}

func (h *host) unstage(ctx context.Context, vol, staging string) error {
	ctx, cancel := context.WithTimeout(ctx, askTimeout)
	defer cancel()
	return client.AskAgain(ctx, func(ctx context.Context) error {
		_, err := h.c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: vol, StagingPath: staging})
		return err
	})
}
