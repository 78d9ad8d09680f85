package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// The test binary runs as vco-agent itself when VCO_AGENT_MAIN=1, with the
// arguments after "--".
func TestMain(m *testing.M) {
	if os.Getenv("VCO_AGENT_MAIN") == "1" {
		if os.Getenv("VCO_AGENT_AS_NOBODY") == "1" {
			if err := syscall.Setgroups(nil); err != nil {
				panic(err)
			}
			if err := syscall.Setgid(65534); err != nil {
				panic(err)
			}
			if err := syscall.Setuid(65534); err != nil {
				panic(err)
			}
		}
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{"vco-agent"}, os.Args[i+1:]...)
				break
			}
		}
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func vcoAgent(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], append([]string{"-test.run=^$", "--"}, args...)...)
	cmd.Env = append(os.Environ(), "VCO_AGENT_MAIN=1")
	return cmd
}

// run runs a CLI command to its end.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := vcoAgent(args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

const uuid = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"

func sysfs(t *testing.T) string {
	root := t.TempDir()
	id := filepath.Join(root, "class/dmi/id")
	os.MkdirAll(id, 0o755)
	os.MkdirAll(filepath.Join(root, "class/block"), 0o755)
	os.WriteFile(filepath.Join(id, "product_uuid"), []byte(strings.ToUpper(uuid)+"\n"), 0o400)
	os.WriteFile(filepath.Join(id, "sys_vendor"), []byte("whitesky.cloud\n"), 0o444)
	return root
}

func emptyConfig(t *testing.T) string {
	dir := t.TempDir()
	p := filepath.Join(dir, "config.yaml")
	os.WriteFile(p, []byte("node:\n  name: cli-node\n  location: loc-cli\nstate_dir: "+filepath.Join(dir, "state")+"\n"), 0o644)
	return p
}

func TestAgentNotRunning(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	for _, args := range [][]string{{"status"}, {"events"}, {"events", "--follow"}, {"status", "--json"}} {
		out, errs, code := run(t, append(args, "--socket", sock)...)
		if code != 1 || out != "" {
			t.Errorf("%v: exit %d, stdout %q", args, code, out)
		}
		want := "vco-agent is not running: there is no socket at " + sock + "; check `systemctl status vco-agent.socket"
		if !strings.Contains(errs, want) || strings.Count(errs, "\n") != 1 {
			t.Errorf("%v: stderr %q, want one line with %q", args, errs, want)
		}
	}
}

func TestIdentityReadsLocallyWithoutAgent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	root := sysfs(t)
	out, errs, code := run(t, "identity", "--socket", sock, "--sysfs-root", root, "--config", emptyConfig(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, w := range []string{"Read locally from SMBIOS", "no socket at " + sock, uuid, "cli-node", "loc-cli", "whitesky.cloud", "scsi-pr: not available"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
	out, _, code = run(t, "identity", "--json", "--socket", sock, "--sysfs-root", root, "--config", emptyConfig(t))
	var j struct {
		AnsweredBy string `json:"answered_by"`
		Identity   struct {
			SystemUUID string `json:"system_uuid"`
			NodeName   string `json:"node_name"`
		} `json:"identity"`
	}
	if err := json.Unmarshal([]byte(out), &j); err != nil || code != 0 {
		t.Fatalf("json %q: %v (exit %d)", out, err, code)
	}
	if j.AnsweredBy != "local" || j.Identity.SystemUUID != uuid || j.Identity.NodeName != "cli-node" {
		t.Errorf("json %+v", j)
	}
	// Neither the agent nor SMBIOS: both reasons in one line, exit 1.
	_, errs, code = run(t, "identity", "--socket", sock, "--sysfs-root", filepath.Join(root, "nothing"), "--config", emptyConfig(t))
	if code != 1 || !strings.Contains(errs, "not running") || !strings.Contains(errs, "reading it locally failed too") {
		t.Errorf("exit %d: %s", code, errs)
	}
}

// startAgent runs `vco-agent serve` on sock until the test ends and
// waits for it to answer.
func startAgent(t *testing.T, sock string) (*exec.Cmd, chan error, *agentLog) {
	t.Helper()
	return startAgentWith(t, sock, emptyConfig(t))
}

func startAgentWith(t *testing.T, sock, cfg string) (*exec.Cmd, chan error, *agentLog) {
	t.Helper()
	agent := vcoAgent("serve", "--config", cfg, "--socket", sock, "--sysfs-root", sysfs(t), "--dbus=false")
	agentErr := &agentLog{}
	agent.Stderr = agentErr
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	agentDone := make(chan error, 1)
	go func() { agentDone <- agent.Wait() }()
	t.Cleanup(func() {
		if agent.ProcessState == nil {
			agent.Process.Kill()
			<-agentDone
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := client.Dial(sock)
		if err == nil {
			c.Close()
			return agent, agentDone, agentErr
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not up: %v\n%s", err, agentErr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// agentLog is an agent process's stderr, written by exec's copying
// goroutine while a test reads it.
type agentLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *agentLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *agentLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitFor waits up to 20 s for the log to hold s: the agent logs what it
// found at start once it serves, maybe after a caller's first answer.
func (l *agentLog) waitFor(s string) bool {
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if strings.Contains(l.String(), s) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

func TestPermissionSentences(t *testing.T) {
	hosttest.NeedRoot(t, "needs root to run the CLI as another user")
	dir, err := os.MkdirTemp("", "vco-cli-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "run", "agent.sock")
	startAgent(t, sock)
	asNobody := func(args ...string) (string, int) {
		cmd := vcoAgent(args...)
		cmd.Env = append(cmd.Env, "VCO_AGENT_AS_NOBODY=1")
		var errb bytes.Buffer
		cmd.Stderr = &errb
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return errb.String(), ee.ExitCode()
		}
		return errb.String(), 0
	}
	// The socket's own mode (0660 in a 0750 directory) keeps nobody out.
	errs, code := asNobody("status", "--socket", sock)
	if code != 1 || !strings.Contains(errs, "cannot open the vco-agent socket "+sock+": permission denied; run as root or as a member of the agent's socket group") {
		t.Errorf("exit %d: %q", code, errs)
	}
	// With the file modes opened up, the peer check still refuses.
	os.Chmod(filepath.Dir(sock), 0o755)
	os.Chmod(sock, 0o666)
	errs, code = asNobody("status", "--socket", sock)
	if code != 1 || !strings.Contains(errs, "the agent at "+sock+" answered PermissionDenied: permission denied: uid 65534 is not root, and no socket group is configured") {
		t.Errorf("exit %d: %q", code, errs)
	}
}

func TestCommandsAgainstRunningAgent(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	agent, agentDone, agentErr := startAgent(t, sock)

	identityStatusAndEventsFromTheAgent(t, sock)

	follow, followErr, next := followEvents(t, sock)
	if e := next(); e["type"] != "EVENT_TYPE_AGENT_STARTED" || e["replayed"] != true {
		t.Fatalf("first followed event %v", e)
	}
	agent.Process.Signal(syscall.SIGTERM)
	if e := next(); e["type"] != "EVENT_TYPE_AGENT_STOPPING" || e["replayed"] != false {
		t.Fatalf("event on stop %v", e)
	}
	if err := follow.Wait(); err != nil {
		t.Errorf("follow exit: %v (%s)", err, followErr.String())
	}
	if !strings.Contains(followErr.String(), "the agent ended the stream") {
		t.Errorf("follow stderr %q", followErr.String())
	}
	if err := <-agentDone; err != nil {
		t.Errorf("agent exit: %v\n%s", err, agentErr.String())
	}
	if _, err := os.Lstat(sock); err == nil {
		t.Error("socket left behind")
	}
}

// identityStatusAndEventsFromTheAgent: identity, status (as text and
// JSON) and events are answered by the running agent on sock.
func identityStatusAndEventsFromTheAgent(t *testing.T, sock string) {
	t.Helper()
	out, errs, code := run(t, "identity", "--socket", sock)
	if code != 0 || !strings.Contains(out, "Answered by the running agent at "+sock) || !strings.Contains(out, uuid) || !strings.Contains(out, "cli-node") {
		t.Errorf("identity exit %d:\n%s%s", code, out, errs)
	}
	out, _, _ = run(t, "identity", "--json", "--socket", sock)
	if !strings.Contains(out, `"answered_by":"agent"`) || !strings.Contains(out, `"system_uuid":"`+uuid+`"`) {
		t.Errorf("identity --json: %s", out)
	}

	out, errs, code = run(t, "status", "--socket", sock)
	if code != 0 || !strings.Contains(out, "created by the agent") || !strings.Contains(out, "Events published:    1") || !strings.Contains(out, "disabled in the configuration") {
		t.Errorf("status exit %d:\n%s%s", code, out, errs)
	}
	out, _, _ = run(t, "status", "--json", "--socket", sock)
	var st struct {
		NodeName        string `json:"node_name"`
		EventsPublished string `json:"events_published"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.NodeName != "cli-node" || st.EventsPublished != "1" {
		t.Errorf("status --json %q: %v %+v", out, err, st)
	}

	out, _, code = run(t, "events", "--socket", sock)
	if code != 0 || !strings.Contains(out, "#1 AgentStarted: vco-agent") {
		t.Errorf("events exit %d: %q", code, out)
	}
}

// followEvents starts vco-agent events --follow --json against sock. next
// returns the next event it prints, failing the test if it ends or prints
// nothing for 20s.
func followEvents(t *testing.T, sock string) (follow *exec.Cmd, stderr *bytes.Buffer, next func() map[string]any) {
	t.Helper()
	follow = vcoAgent("events", "--follow", "--json", "--socket", sock)
	pipe, _ := follow.StdoutPipe()
	var followErr bytes.Buffer
	follow.Stderr = &followErr
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 8)
	go func() {
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	next = func() map[string]any {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("follow ended early: %s", followErr.String())
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(l), &m); err != nil {
				t.Fatalf("follow line %q: %v", l, err)
			}
			return m
		case <-time.After(20 * time.Second):
			t.Fatal("no event from --follow")
		}
		return nil
	}
	return follow, &followErr, next
}
