package daemon

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/dbussignal"
	"github.com/whitesky-cloud/vco-storage/agent/internal/testbus"
	"github.com/whitesky-cloud/vco-storage/agent/internal/testjournal"
)

// The test binary is also the agent under test, in two helper modes:
//
//	VCO_AGENT_MODE=serve       runs `vco-agent serve` with the arguments after "--"
//	VCO_AGENT_MODE=listen-pid  sets LISTEN_PID to its own pid, then execs
//	                           itself in serve mode (what systemd does for a
//	                           socket-activated service)
func TestMain(m *testing.M) {
	switch os.Getenv("VCO_AGENT_MODE") {
	case "serve":
		os.Exit(Main(argsAfterDashes(), "test-version", os.Stderr))
	case "listen-pid":
		os.Setenv("LISTEN_PID", strconv.Itoa(os.Getpid()))
		os.Setenv("VCO_AGENT_MODE", "serve")
		err := syscall.Exec(os.Args[0], os.Args, os.Environ())
		panic(err)
	}
	os.Exit(m.Run())
}

func argsAfterDashes() []string {
	for i, a := range os.Args {
		if a == "--" {
			return os.Args[i+1:]
		}
	}
	return nil
}

const fixtureUUID = "8a1c6e2f-3b4d-4e5f-9a0b-1c2d3e4f5a6b"

// sysfsFixture is a sysfs tree with the decoded DMI attributes.
func sysfsFixture(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	id := filepath.Join(root, "class/dmi/id")
	if err := os.MkdirAll(id, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]string{"product_uuid": fixtureUUID, "sys_vendor": "whitesky.cloud", "product_name": "VM", "product_serial": "S-1"} {
		if err := os.WriteFile(filepath.Join(id, name), []byte(v+"\n"), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "class/block"), 0o755); err != nil {
		t.Fatal(err)
	}
	return root
}

// notifyListener is a real NOTIFY_SOCKET: a unix datagram socket.
type notifyListener struct {
	path string
	mu   sync.Mutex
	msgs []string
	c    *net.UnixConn
}

func listenNotify(t *testing.T) *notifyListener {
	t.Helper()
	n := &notifyListener{path: filepath.Join(t.TempDir(), "notify")}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	n.c = c
	t.Cleanup(func() { c.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := c.Read(buf)
			if err != nil {
				return
			}
			n.mu.Lock()
			n.msgs = append(n.msgs, string(buf[:k]))
			n.mu.Unlock()
		}
	}()
	return n
}

// wait returns the first message containing want, waiting up to 20s.
func (n *notifyListener) wait(t *testing.T, want string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		n.mu.Lock()
		for _, m := range n.msgs {
			if strings.Contains(m, want) {
				n.mu.Unlock()
				return m
			}
		}
		n.mu.Unlock()
		time.Sleep(10 * time.Millisecond)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	t.Fatalf("no %q notification within 20s; got %q", want, n.msgs)
	return ""
}

func (n *notifyListener) count(want string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := 0
	for _, m := range n.msgs {
		if strings.Contains(m, want) {
			c++
		}
	}
	return c
}

type agentProc struct {
	cmd    *exec.Cmd
	stderr *bytes.Buffer
	done   chan error
}

// startAgent runs the test binary as the agent with the given mode, extra
// environment, extra files (fd 3 onward) and serve flags.
func startAgent(t *testing.T, mode string, env []string, files []*os.File, args ...string) *agentProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"-test.run=^$", "--"}, args...)...)
	cmd.Env = append(os.Environ(), "VCO_AGENT_MODE="+mode)
	cmd.Env = append(cmd.Env, env...)
	cmd.ExtraFiles = files
	p := &agentProc{cmd: cmd, stderr: &bytes.Buffer{}, done: make(chan error, 1)}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

func (p *agentProc) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Fatalf("agent exited with %v after SIGTERM; stderr:\n%s", err, p.stderr)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("agent did not stop within 20s of SIGTERM; stderr:\n%s", p.stderr)
	}
}

// emptyConfig is a configuration with every default but the state
// directory, which is the test's own so that no test touches the host's.
func emptyConfig(t *testing.T) string {
	dir := t.TempDir()
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte("state_dir: "+filepath.Join(dir, "state")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestNotifyReadyWatchdogStoppingAndSocketLifecycle(t *testing.T) {
	n := listenNotify(t)
	run := filepath.Join(t.TempDir(), "run", "vco-agent")
	sock := filepath.Join(run, "agent.sock")
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path, "WATCHDOG_USEC=200000"}, nil,
		"--config", emptyConfig(t), "--socket", sock, "--sysfs-root", sysfsFixture(t), "--dbus=false", "--node-name", "node-t", "--location", "loc-1")

	ready := n.wait(t, "READY=1")
	if !strings.Contains(ready, "STATUS=serving on "+sock) || !strings.Contains(ready, fixtureUUID) {
		t.Errorf("READY message lacks a useful STATUS: %q", ready)
	}
	if n.count("STATUS=reading the node identity") != 1 {
		t.Errorf("no start-up STATUS line before READY")
	}
	checkSocketMadeByTheAgent(t, sock, run)
	checkIdentityAndStatusOverTheSocket(t, sock)

	// WATCHDOG_USEC=200ms: pings every 100ms.
	deadline := time.Now().Add(10 * time.Second)
	for n.count("WATCHDOG=1") < 3 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n.count("WATCHDOG=1") < 3 {
		t.Errorf("fewer than 3 watchdog pings: %d", n.count("WATCHDOG=1"))
	}

	a.stop(t)
	n.wait(t, "STOPPING=1")
	if _, err := os.Lstat(sock); err == nil {
		t.Errorf("socket %s left behind", sock)
	}
	if _, err := os.Lstat(run); err == nil {
		t.Errorf("socket directory %s left behind", run)
	}
	if !strings.Contains(a.stderr.String(), "VCO_EVENT=AgentStopping") {
		t.Errorf("AgentStopping event not logged:\n%s", a.stderr)
	}
}

// checkSocketMadeByTheAgent: the socket the agent made is 0660 in a 0750
// directory.
func checkSocketMadeByTheAgent(t *testing.T, sock, run string) {
	t.Helper()
	if st, err := os.Stat(sock); err != nil || st.Mode().Type() != os.ModeSocket || st.Mode().Perm() != 0o660 {
		t.Errorf("socket %s: %v %v", sock, st.Mode(), err)
	}
	if st, err := os.Stat(run); err != nil || st.Mode().Perm() != 0o750 {
		t.Errorf("socket dir %s: %v %v", run, st.Mode(), err)
	}
}

// checkIdentityAndStatusOverTheSocket: the agent on sock answers with the
// fixture's identity and the names and location it was given, and a status
// of its own socket, without D-Bus, one event published.
func checkIdentityAndStatusOverTheSocket(t *testing.T, sock string) {
	t.Helper()
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	id, err := c.GetIdentity(context.Background(), &api.GetIdentityRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if id.SystemUuid != fixtureUUID || id.IdentitySource != "sysfs" || id.NodeName != "node-t" || id.Location != "loc-1" ||
		id.AgentVersion != "test-version" || id.Manufacturer != "whitesky.cloud" || len(id.Fencing) != 2 {
		t.Errorf("identity %+v", id)
	}
	st, err := c.GetStatus(context.Background(), &api.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.SocketActivated || st.SocketPath != sock || st.DbusConnected || st.EventsPublished != 1 {
		t.Errorf("status %+v", st)
	}
}

func TestSocketActivation(t *testing.T) {
	n := listenNotify(t)
	dir := t.TempDir()
	actPath := filepath.Join(dir, "activated.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: actPath, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false) // as with systemd, the socket outlives the service
	defer os.Remove(actPath)
	f, err := l.File()
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	defer f.Close()
	ownPath := filepath.Join(dir, "own", "agent.sock")
	a := startAgent(t, "listen-pid", []string{"NOTIFY_SOCKET=" + n.path, "LISTEN_FDS=1", "LISTEN_FDNAMES=api"}, []*os.File{f},
		"--config", emptyConfig(t), "--socket", ownPath, "--sysfs-root", sysfsFixture(t), "--dbus=false")
	f.Close() // the agent holds its copy; the test keeps none
	n.wait(t, "READY=1")

	c, err := client.Dial(actPath)
	if err != nil {
		t.Fatalf("%v\nagent stderr:\n%s", err, a.stderr)
	}
	st, err := c.GetStatus(context.Background(), &api.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !st.SocketActivated || st.SocketPath != actPath {
		t.Errorf("status %+v, want activated on %s", st, actPath)
	}
	c.Close()
	if _, err := os.Lstat(ownPath); err == nil {
		t.Errorf("agent created %s although systemd passed a socket", ownPath)
	}
	a.stop(t)
	if _, err := os.Lstat(actPath); err != nil {
		t.Errorf("agent removed the socket systemd owns: %v", err)
	}
}

func TestSocketActivationWithoutAPIName(t *testing.T) {
	dir := t.TempDir()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "x.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	f, _ := l.File()
	defer f.Close()
	a := startAgent(t, "listen-pid", []string{"LISTEN_FDS=1", "LISTEN_FDNAMES=metrics"}, []*os.File{f},
		"--config", emptyConfig(t), "--socket", filepath.Join(dir, "own.sock"), "--sysfs-root", sysfsFixture(t), "--dbus=false")
	select {
	case err := <-a.done:
		if err == nil || !strings.Contains(a.stderr.String(), `not exactly one named "api"`) || !strings.Contains(a.stderr.String(), "FileDescriptorName=api") {
			t.Fatalf("exit %v, stderr:\n%s", err, a.stderr)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("agent kept running with a socket not named api")
	}
}

func TestEventsAsDBusSignals(t *testing.T) {
	addr := testbus.Start(t, "../dbus/cloud.whitesky.VcoAgent1.conf")
	watcher, err := dbus.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer watcher.Close()
	if err := watcher.AddMatchSignal(dbus.WithMatchInterface(dbussignal.Interface)); err != nil {
		t.Fatal(err)
	}
	sigs := make(chan *dbus.Signal, 8)
	watcher.Signal(sigs)

	n := listenNotify(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path}, nil,
		"--config", emptyConfig(t), "--socket", sock, "--sysfs-root", sysfsFixture(t), "--dbus-address", addr, "--node-name", "node-d")
	n.wait(t, "READY=1")
	select {
	case s := <-sigs:
		e, err := dbussignal.Decode(s)
		if err != nil {
			t.Fatal(err)
		}
		if s.Name != dbussignal.Interface+".AgentStarted" || e.Seq != 1 || !strings.Contains(e.Message, "node node-d") {
			t.Fatalf("signal %s %+v", s.Name, e)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("no AgentStarted signal; agent stderr:\n%s", a.stderr)
	}
	node, err := introspect.Call(watcher.Object(dbussignal.BusName, dbussignal.ObjectPath))
	if err != nil {
		t.Fatalf("introspecting the agent: %v", err)
	}
	found := 0
	for _, i := range node.Interfaces {
		if i.Name == dbussignal.Interface {
			found = len(i.Signals)
		}
	}
	if found != 7 {
		t.Errorf("introspection shows %d event signals, want 7", found)
	}
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.GetStatus(context.Background(), &api.GetStatusRequest{})
	c.Close()
	if err != nil || !st.DbusConnected || strings.Contains(st.DbusDetail, "without the name") {
		t.Errorf("status %+v %v", st, err)
	}
	a.stop(t)
	select {
	case s := <-sigs:
		if s.Name != dbussignal.Interface+".AgentStopping" {
			t.Errorf("last signal %s", s.Name)
		}
	case <-time.After(5 * time.Second):
		t.Error("no AgentStopping signal")
	}
}

func TestNoBusOneLogLineAndStillServes(t *testing.T) {
	n := listenNotify(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path}, nil,
		"--config", emptyConfig(t), "--socket", sock, "--sysfs-root", sysfsFixture(t), "--dbus-address", "unix:path="+filepath.Join(t.TempDir(), "no-bus"))
	n.wait(t, "READY=1")
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.GetStatus(context.Background(), &api.GetStatusRequest{})
	c.Close()
	if err != nil || st.DbusConnected || !strings.Contains(st.DbusDetail, "no-bus") {
		t.Errorf("status %+v %v", st, err)
	}
	a.stop(t)
	if got := strings.Count(a.stderr.String(), "D-Bus event signals are off"); got != 1 {
		t.Errorf("%d log lines about the missing bus, want 1:\n%s", got, a.stderr)
	}
	if !strings.Contains(a.stderr.String(), "VCO_EVENT=AgentStarted") {
		t.Errorf("events did not reach the log sink without the bus:\n%s", a.stderr)
	}
}

// In-process: each start-up failure is one clear sentence and exit 1.
func TestStartupErrorsAreClear(t *testing.T) {
	sysfs := sysfsFixture(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	badCfg := filepath.Join(t.TempDir(), "config.yaml")
	os.WriteFile(badCfg, []byte("socket:\n  path: /tmp/a.sock\nnode:\n  nmae: x\n"), 0o644)

	noUUID := t.TempDir()
	tables := filepath.Join(noUUID, "firmware/dmi/tables")
	os.MkdirAll(filepath.Join(tables, "DMI"), 0o755) // a directory where the table should be
	os.WriteFile(filepath.Join(tables, "smbios_entry_point"), []byte("_SM3_"), 0o444)

	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"unknown field", []string{"--config", badCfg}, []string{badCfg, "line 4", `"nmae"`}},
		{"missing explicit config", []string{"--config", filepath.Join(t.TempDir(), "none.yaml")}, []string{"none.yaml does not exist"}},
		{"missing sysfs", []string{"--config", emptyConfig(t), "--socket", sock, "--dbus=false", "--sysfs-root", "/nonexistent/sys"},
			[]string{"sysfs root /nonexistent/sys is not usable", "no such file or directory", "--sysfs-root"}},
		{"unreadable DMI table", []string{"--config", emptyConfig(t), "--socket", sock, "--dbus=false", "--sysfs-root", noUUID},
			[]string{"SMBIOS identity under " + noUUID, filepath.Join(tables, "DMI")}},
		{"missing group", []string{"--config", emptyConfig(t), "--socket", sock, "--dbus=false", "--sysfs-root", sysfs, "--socket-group", "no-such-group-vco"},
			[]string{`socket.group "no-such-group-vco" does not exist`}},
	}
	for _, c := range cases {
		var stderr bytes.Buffer
		code := Main(c.args, "v", &stderr)
		if code != 1 {
			t.Errorf("%s: exit %d, want 1 (%s)", c.name, code, stderr.String())
		}
		for _, w := range c.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("%s: error %q lacks %q", c.name, stderr.String(), w)
			}
		}
		if strings.Count(strings.TrimSpace(stderr.String()), "\n") > 0 {
			t.Errorf("%s: more than one line: %q", c.name, stderr.String())
		}
		if _, err := os.Lstat(sock); err == nil {
			t.Errorf("%s: socket left behind", c.name)
		}
	}
}

func TestRefusesWhenAnotherAgentServes(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var stderr bytes.Buffer
	code := Main([]string{"--config", emptyConfig(t), "--socket", sock, "--dbus=false", "--sysfs-root", sysfsFixture(t)}, "v", &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "another process already serves "+sock) {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if _, err := os.Lstat(sock); err != nil {
		t.Fatal("the other process's socket was removed")
	}
}

// Under systemd stderr is the journal's stream: the agent then logs and
// records events natively, with fields.
func TestLogsAndEventsGoToJournalWhenStderrIsItsStream(t *testing.T) {
	j := testjournal.Listen(t)
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	stream := os.NewFile(uintptr(fds[0]), "journal-stream")
	peer := os.NewFile(uintptr(fds[1]), "journal-stream-peer")
	defer stream.Close()
	defer peer.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(fds[0], &st); err != nil {
		t.Fatal(err)
	}
	n := listenNotify(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$", "--", "--config", emptyConfig(t), "--socket", sock,
		"--sysfs-root", sysfsFixture(t), "--dbus=false", "--node-name", "node-j")
	cmd.Env = append(os.Environ(), "VCO_AGENT_MODE=serve", "NOTIFY_SOCKET="+n.path, fmt.Sprintf("JOURNAL_STREAM=%d:%d", st.Dev, st.Ino))
	cmd.Stderr = stream
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-done
		}
	}()
	n.wait(t, "READY=1")
	serving := j.Wait("MESSAGE", "vco-agent serving", 10*time.Second)
	if serving == nil {
		t.Fatalf("start-up line not in the journal: %v", j.Entries())
	}
	if serving["SOCKET"] != sock || serving["NODE"] != "node-j" || serving["SYSTEM_UUID"] != fixtureUUID || serving["LOG"] != "journal" || serving["PRIORITY"] != "6" {
		t.Errorf("start-up entry fields %v", serving)
	}
	started := j.Wait("VCO_EVENT", "AgentStarted", 10*time.Second)
	if started == nil || started["MESSAGE_ID"] != "629e5f31feb4e51d950ea18f50c43f0d" || started["VCO_SEQ"] != "1" {
		t.Errorf("AgentStarted entry %v", started)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := <-done; err != nil {
		t.Fatalf("agent exit %v", err)
	}
	if j.Wait("VCO_EVENT", "AgentStopping", 5*time.Second) == nil {
		t.Error("AgentStopping not in the journal")
	}
	// Nothing went to the stream as text.
	stream.Close()
	peer.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 4096)
	if k, _ := peer.Read(buf); k > 0 {
		t.Errorf("text on stderr although it is the journal stream: %q", buf[:k])
	}
}

func TestSocketBelongsToConfiguredGroup(t *testing.T) {
	g, err := user.LookupGroup("users")
	if err != nil {
		t.Skip("no group 'users' on this host")
	}
	gid, _ := strconv.Atoi(g.Gid)
	run := filepath.Join(t.TempDir(), "run")
	cfg := config.Default()
	cfg.Socket.Path = filepath.Join(run, "agent.sock")
	cfg.Socket.Group = "users"
	cfg.SysfsRoot = sysfsFixture(t)
	cfg.DBus.Enabled = false
	cfg.StateDir = t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var logs bytes.Buffer
	go func() { done <- Run(ctx, Options{Config: cfg, Version: "v", Stderr: &logs}) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := client.Dial(cfg.Socket.Path); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("agent not serving: %s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for path, mode := range map[string]os.FileMode{run: 0o750, cfg.Socket.Path: 0o660} {
		var st syscall.Stat_t
		if err := syscall.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		if int(st.Gid) != gid || os.FileMode(st.Mode).Perm() != mode {
			t.Errorf("%s: gid %d mode %o, want gid %d mode %o", path, st.Gid, os.FileMode(st.Mode).Perm(), gid, mode)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(run); err == nil {
		t.Error("socket directory left behind")
	}
}

// A metrics listener that cannot start must not stop the agent: the
// address is taken here (under the packaged unit without loopback IP
// sockets the listen fails the same way), and the agent must still come
// up, answer its API, and say on its systemd status line and in its log
// why /metrics is off.
func TestMetricsListenFailureIsNotFatal(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	n := listenNotify(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path}, nil,
		"--config", emptyConfig(t), "--socket", sock, "--sysfs-root", sysfsFixture(t), "--dbus=false",
		"--metrics-listen", taken.Addr().String())
	// Before the fix the agent exits here with "metrics.listen ...: bind:
	// address already in use" and never sends READY=1.
	ready := n.wait(t, "READY=1")
	if !strings.Contains(ready, "metrics off") || !strings.Contains(ready, taken.Addr().String()) {
		t.Errorf("the READY status does not say why metrics are off: %q", ready)
	}
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatalf("%v\nagent stderr:\n%s", err, a.stderr)
	}
	if _, err := c.GetStatus(context.Background(), &api.GetStatusRequest{}); err != nil {
		t.Fatalf("the agent does not answer with metrics off: %v", err)
	}
	c.Close()
	a.stop(t)
	if !strings.Contains(a.stderr.String(), "metrics listener did not start") || !strings.Contains(a.stderr.String(), "metrics.listen") {
		t.Errorf("the log does not report the metrics listener's failure:\n%s", a.stderr)
	}
}

// The agent serves /metrics on a unix socket beside its API socket, 0660,
// for the node plugin to re-export in the cluster without any IP socket on
// the host (docs/monitoring.md); the file goes when the agent stops.
func TestMetricsSocket(t *testing.T) {
	n := listenNotify(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path}, nil,
		"--config", emptyConfig(t), "--socket", sock, "--sysfs-root", sysfsFixture(t), "--dbus=false")
	n.wait(t, "READY=1")
	msock := filepath.Join(dir, "metrics.sock")
	st, err := os.Stat(msock)
	if err != nil || st.Mode().Type() != os.ModeSocket || st.Mode().Perm() != 0o660 {
		t.Fatalf("metrics socket %s: %v %v\n%s", msock, st, err, a.stderr)
	}
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", msock)
	}}}
	resp, err := hc.Get("http://agent/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"vco_agent_claims{", "vco_agent_lease_oldest_renewal_seconds 0", "vco_agent_host_watchdog_armed 0"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics over the socket lacks %q:\n%s", want, body)
		}
	}
	a.stop(t)
	if _, err := os.Lstat(msock); err == nil {
		t.Errorf("the agent left %s behind", msock)
	}
}
