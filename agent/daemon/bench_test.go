package daemon

import (
	"bufio"
	"go/build"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The agent under benchmark is the binary in VCO_AGENT_BIN (make bench
// passes bin/vco-agent) or else this test binary in serve mode.
func agentCmd(b *testing.B, notify, sock, sysfs string) *exec.Cmd {
	b.Helper()
	cfg := filepath.Join(b.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, nil, 0o644); err != nil {
		b.Fatal(err)
	}
	args := []string{"--config", cfg, "--socket", sock, "--sysfs-root", sysfs, "--dbus=false", "--state-dir", b.TempDir()}
	var cmd *exec.Cmd
	if bin := os.Getenv("VCO_AGENT_BIN"); bin != "" {
		cmd = exec.Command(bin, append([]string{"serve"}, args...)...)
		cmd.Env = os.Environ()
	} else {
		cmd = exec.Command(os.Args[0], append([]string{"-test.run=^$", "--"}, args...)...)
		cmd.Env = append(os.Environ(), "VCO_AGENT_MODE=serve")
	}
	cmd.Env = append(cmd.Env, "NOTIFY_SOCKET="+notify)
	return cmd
}

func benchFixture(b *testing.B) string {
	root := b.TempDir()
	id := filepath.Join(root, "class/dmi/id")
	os.MkdirAll(id, 0o755)
	os.MkdirAll(filepath.Join(root, "class/block"), 0o755)
	os.WriteFile(filepath.Join(id, "product_uuid"), []byte(fixtureUUID+"\n"), 0o444)
	return root
}

func benchNotify(b *testing.B) (string, *net.UnixConn) {
	p := filepath.Join(b.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return p, c
}

func waitReady(b *testing.B, c *net.UnixConn) {
	buf := make([]byte, 4096)
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		n, err := c.Read(buf)
		if err != nil {
			b.Fatalf("no READY=1: %v", err)
		}
		if strings.Contains(string(buf[:n]), "READY=1") {
			return
		}
	}
}

func stopAgent(b *testing.B, cmd *exec.Cmd) {
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		b.Fatalf("agent exit: %v", err)
	}
}

// BenchmarkExecToReady: from exec of the agent to its READY=1, against
// exec to exit of /bin/true spawned the same way.
func BenchmarkExecToReady(b *testing.B) {
	b.Run("vs=bin-true", func(b *testing.B) {
		sysfs := benchFixture(b)
		notify, nc := benchNotify(b)
		sock := filepath.Join(b.TempDir(), "agent.sock")
		var agent, ref time.Duration
		for i := 0; i < b.N; i++ {
			cmd := agentCmd(b, notify, sock, sysfs)
			t0 := time.Now()
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			waitReady(b, nc)
			agent += time.Since(t0)
			stopAgent(b, cmd)

			t0 = time.Now()
			if err := exec.Command("/bin/true").Run(); err != nil {
				b.Fatal(err)
			}
			ref += time.Since(t0)
		}
		ms := float64(agent.Microseconds()) / 1000 / float64(b.N)
		refms := float64(ref.Microseconds()) / 1000 / float64(b.N)
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(ms, "ms")
		b.ReportMetric(refms, "ref-ms")
		b.ReportMetric(ms/refms, "x-ref")
	})
}

func vmRSSkB(b *testing.B, pid int) float64 {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb
		}
	}
	b.Fatal("no VmRSS")
	return 0
}

// buildIdle builds the RSS reference: a static Go program that only
// sleeps, built the way the Makefile builds the agent.
func buildIdle(b *testing.B) string {
	dir := b.TempDir()
	src := filepath.Join(dir, "main.go")
	os.WriteFile(src, []byte("package main\n\nimport \"time\"\n\nfunc main() { time.Sleep(time.Hour) }\n"), 0o644)
	bin := filepath.Join(dir, "idle")
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(build.Default.GOROOT, "bin", "go")
	}
	cmd := exec.Command(gobin, "build", "-trimpath", "-ldflags=-s -w", "-o", bin, src)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GO111MODULE=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("building the idle reference: %v\n%s", err, out)
	}
	return bin
}

// BenchmarkIdleRSS: the agent's resident memory one second after READY=1,
// against a static Go program that only sleeps.
func BenchmarkIdleRSS(b *testing.B) {
	b.Run("vs=idle-go-process", func(b *testing.B) {
		idleBin := buildIdle(b)
		sysfs := benchFixture(b)
		notify, nc := benchNotify(b)
		sock := filepath.Join(b.TempDir(), "agent.sock")
		var agent, ref float64
		for i := 0; i < b.N; i++ {
			cmd := agentCmd(b, notify, sock, sysfs)
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			waitReady(b, nc)
			idle := exec.Command(idleBin)
			if err := idle.Start(); err != nil {
				b.Fatal(err)
			}
			time.Sleep(time.Second)
			agent += vmRSSkB(b, cmd.Process.Pid)
			ref += vmRSSkB(b, idle.Process.Pid)
			idle.Process.Kill()
			idle.Wait()
			stopAgent(b, cmd)
		}
		mib := agent / float64(b.N) / 1024
		refmib := ref / float64(b.N) / 1024
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(mib, "MiB")
		b.ReportMetric(refmib, "ref-MiB")
		b.ReportMetric(mib/refmib, "x-ref")
	})
}
