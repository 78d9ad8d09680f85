package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// A word the plugin's flags do not take is refused before anything
// starts: vco-csi has no sim command (the simulator is `vco-lab sim`),
// and it takes no stray argument after the flags either.
func TestPluginRefusesStrayArguments(t *testing.T) {
	for _, tc := range []struct {
		args []string
		word string
	}{
		{[]string{"sim", "--listen", "127.0.0.1:0", "--dir", t.TempDir()}, "sim"},
		{[]string{"--mode=controller", "--endpoint", "unix://" + filepath.Join(t.TempDir(), "csi.sock"), "extra"}, "extra"},
	} {
		_, err := parsePluginFlags(tc.args)
		if err == nil || !strings.Contains(err.Error(), `unexpected argument "`+tc.word+`"`) || !strings.Contains(err.Error(), "vco-lab sim") {
			t.Errorf("%q: error %v, want a refusal naming %q and `vco-lab sim`", tc.args, err, tc.word)
		}
		if rc := runPlugin(tc.args); rc != 2 {
			t.Errorf("%q: exit %d, want 2 (refused)", tc.args, rc)
		}
	}
}

// TestBinaryControllerAgainstSim builds vco-csi and vco-lab, runs
// `vco-lab sim` and `vco-csi --mode=controller` as processes, and drives
// the controller over its unix socket.
func TestBinaryControllerAgainstSim(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries")
	}
	dir := t.TempDir()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = "/usr/local/go/bin/go"
	}
	for _, c := range []string{"vco-csi", "vco-lab"} {
		if out, err := exec.Command(goTool, "build", "-o", filepath.Join(dir, c), "../"+c).CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", c, err, out)
		}
	}
	addr, healthAddr := freeAddr(t), freeAddr(t)

	start := func(bin string, args ...string) {
		cmd := exec.Command(filepath.Join(dir, bin), args...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	start("vco-lab", "sim", "--listen", addr, "--dir", filepath.Join(dir, "sim"), "--backend", "bookkeeping", "--customer", "acme",
		"--host-vm-uuid", "0a0b0c0d-0000-4000-8000-00000000abcd")
	waitFor(t, func() bool {
		r, err := http.Get("http://" + addr + "/admin/faults")
		if err == nil {
			r.Body.Close()
		}
		return err == nil
	})
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte("a.b.c"), 0o600)
	sock := filepath.Join(dir, "csi.sock")
	start("vco-csi", "--mode=controller", "--endpoint", "unix://"+sock, "--api-url", "http://"+addr+"/api/1",
		"--customer", "acme", "--token-file", tok, "--driver-name", "cloud.whitesky.csi", "--http-endpoint", healthAddr)
	waitFor(t, func() bool { _, err := os.Stat(sock); return err == nil })
	// The liveness endpoint follows the driver's Probe: 200 while the API
	// answers.
	healthz := func() (int, string) {
		t.Helper()
		r, err := http.Get("http://" + healthAddr + "/healthz")
		if err != nil {
			t.Fatalf("GET /healthz: %v", err)
		}
		defer r.Body.Close()
		b, _ := io.ReadAll(r.Body)
		return r.StatusCode, string(b)
	}
	if code, body := healthz(); code != http.StatusOK {
		t.Fatalf("/healthz with the API up = %d %q, want 200", code, body)
	}

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id := csi.NewIdentityClient(conn)
	info, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.Name != "cloud.whitesky.csi" {
		t.Fatalf("plugin info: %v %v", info, err)
	}
	if p, err := id.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("probe: %v %v", p, err)
	}
	v, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bin",
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil || !strings.HasPrefix(v.Volume.VolumeId, "ch-lug-1/") {
		t.Fatalf("create: %v %v", v, err)
	}
	// With the API gone, Probe says not ready.
	req, _ := http.NewRequest(http.MethodPut, "http://"+addr+"/admin/faults", strings.NewReader(`{"error_rate":1}`))
	if r, err := http.DefaultClient.Do(req); err == nil {
		r.Body.Close()
	}
	if _, err := id.Probe(ctx, &csi.ProbeRequest{}); err == nil {
		t.Fatal("probe succeeded while every API call fails")
	}
	if code, body := healthz(); code != http.StatusServiceUnavailable || !strings.Contains(body, "whitesky.cloud API does not answer") {
		t.Fatalf("/healthz with every API call failing = %d %q, want 503 naming the API", code, body)
	}
}

// freeAddr returns a loopback address no one listens on just now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitFor(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if ok() {
			return
		}
	}
	t.Fatal("timed out waiting for a process to come up")
}
