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
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
)

// stageAgent stands in for vco-agent on its socket: it answers who the
// node is and accepts every stage, recording the volumes it was asked to
// stage or read a LUKS2 token of. A real agent needs the host's disks;
// this test is about what the node plugin sends it.
type stageAgent struct {
	api.UnimplementedAgentServer
	mu     sync.Mutex
	staged []string
	tokens []string
}

func (a *stageAgent) GetIdentity(context.Context, *api.GetIdentityRequest) (*api.Identity, error) {
	return &api.Identity{SystemUuid: "0a0b0c0d-0000-4000-8000-00000000abcd", Location: "ch-lug-1"}, nil
}

func (a *stageAgent) StageVolume(_ context.Context, r *api.StageVolumeRequest) (*api.StageVolumeResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.staged = append(a.staged, r.GetVolumeId())
	return &api.StageVolumeResponse{}, nil
}

func (a *stageAgent) GetVolumeToken(_ context.Context, r *api.GetVolumeTokenRequest) (*api.VolumeToken, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.tokens = append(a.tokens, r.GetVolumeId())
	return nil, status.Error(codes.Unimplemented, "this test's agent reads no device")
}

func serveStageAgent(t *testing.T, sock string) *stageAgent {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	a := &stageAgent{}
	s := grpc.NewServer()
	api.RegisterAgentServer(s, a)
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	return a
}

func buildVcoCSI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "vco-csi")
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = "/usr/local/go/bin/go"
	}
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	return bin
}

// TestPartialKeyBackendKeepsPlainVolumes starts the node plugin as the
// DaemonSet does, with a key-backend ConfigMap that is bad or partial. The
// plugin must start and stage plain volumes; it must say what is wrong in
// its log and on its readiness endpoint, and refuse an encrypted stage
// with FAILED_PRECONDITION naming the setting, before asking the agent
// anything about that volume.
func TestPartialKeyBackendKeepsPlainVolumes(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := buildVcoCSI(t)
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  string // in the log, the readiness answer and the refusal
	}{
		{"no role", map[string]string{"address": "https://openbao.example.net:8200", "transit_key": "k"}, "has no key role"},
		{"address misspelt", map[string]string{"addr": "https://openbao.example.net:8200", "role": "vco-csi-node"},
			"has key addr, which the node plugin does not know"},
		{"no address", map[string]string{"transitMount": "transit-prod-1", "role": "vco-csi-node"}, "has key role but no key address"},
		{"address not a URL", map[string]string{"address": "openbao.example.net", "role": "vco-csi-node", "transit_key": "k"},
			"is not an http(s) URL with a host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			kb := filepath.Join(dir, "key-backend")
			if err := os.Mkdir(kb, 0o700); err != nil {
				t.Fatal(err)
			}
			tc.files["token"] = "eyJhbGciOiJSUzI1NiJ9.e30.c2ln"
			writeFiles(t, kb, tc.files)
			agentSock := filepath.Join(dir, "agent.sock")
			agent := serveStageAgent(t, agentSock)
			sock := filepath.Join(dir, "csi.sock")
			health := freeAddr(t)
			kubelet := filepath.Join(dir, "kubelet")
			if err := os.MkdirAll(filepath.Join(kubelet, "plugins", "s"), 0o750); err != nil {
				t.Fatal(err)
			}
			log := startNodePluginServing(t, bin, sock, "--mode=node", "--endpoint=unix://"+sock, "--driver-name=cloud.whitesky.csi",
				"--agent-socket="+agentSock, "--kubelet-root="+kubelet, "--key-backend-dir="+kb, "--health-addr="+health)

			// Health: not ready, with the reason.
			checkNotReadySaying(t, health, tc.want)

			conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			node := csi.NewNodeClient(conn)
			if err := stageOnLug1(ctx, node, kubelet, "ch-lug-1/1", false); err != nil {
				t.Errorf("plain stage: %v", err)
			}
			err = stageOnLug1(ctx, node, kubelet, "ch-lug-1/2", true)
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), tc.want) ||
				!strings.Contains(err.Error(), "ch-lug-1/2") {
				t.Errorf("encrypted stage: %v; want FailedPrecondition naming the volume and saying %q", err, tc.want)
			}
			agent.mu.Lock()
			if len(agent.staged) != 1 || agent.staged[0] != "ch-lug-1/1" || len(agent.tokens) != 0 {
				t.Errorf("the agent was asked to stage %v and read the header of %v; want only the plain ch-lug-1/1", agent.staged, agent.tokens)
			}
			agent.mu.Unlock()
			checkLogReportsTheProblem(t, log.String(), tc.want)
		})
	}
}

// startNodePluginServing starts bin with args and waits until it serves
// its CSI socket sock: it must not exit instead. The plugin is killed when
// the test ends; its log is returned.
func startNodePluginServing(t *testing.T, bin, sock string, args ...string) *syncBuffer {
	t.Helper()
	cmd := exec.Command(bin, args...)
	log := &syncBuffer{}
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			return log
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("the node plugin exited (%v) instead of serving plain volumes:\n%s", err, log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the node plugin made no CSI socket")
		}
	}
}

// checkNotReadySaying: the readiness endpoint at health answers 503,
// saying want.
func checkNotReadySaying(t *testing.T, health, want string) {
	t.Helper()
	r, err := http.Get("http://" + health + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), want) {
		t.Errorf("/readyz: %d %q; want 503 saying %q", r.StatusCode, body, want)
	}
}

// stageOnLug1 stages volume id (ch-lug-1/N, disk N) as ext4, encrypted or
// not, through the node service.
func stageOnLug1(ctx context.Context, node csi.NodeClient, kubelet, id string, encrypted bool) error {
	mount := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	vc := map[string]string{}
	if encrypted {
		vc["cloud.whitesky/encrypted"] = "true"
	}
	_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id,
		StagingTargetPath: filepath.Join(kubelet, "plugins", "s", id[len("ch-lug-1/"):]),
		PublishContext:    map[string]string{"cloud.whitesky/serial": "vco-" + id[len("ch-lug-1/"):]}, VolumeContext: vc, VolumeCapability: mount})
	return err
}

// checkLogReportsTheProblem: the plugin's log reports the key backend
// problem want and never carries the ServiceAccount token.
func checkLogReportsTheProblem(t *testing.T, log, want string) {
	t.Helper()
	if !strings.Contains(log, "key backend configuration problem") || !strings.Contains(log, want) {
		t.Errorf("the log does not report the problem %q:\n%s", want, log)
	}
	if strings.Contains(log, "eyJhbGciOiJSUzI1NiJ9") {
		t.Error("the log carries the ServiceAccount token")
	}
}
