package driver_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http/httptest"
	"os"
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

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/drivername"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

const (
	testJWT  = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ2Y28tY3NpIn0.dGhpcy1zaWduYXR1cmUtaXMtc2VjcmV0"
	hostUUID = "4c4c4544-0042-3510-8052-b4c04f4a4d32"
	hostLoc  = "ch-lug-1"
)

// identityAgent answers the agent's identity for the machine the simulator
// calls "this-host", for the controller tests, which run unprivileged and
// touch no device: its volume methods answer UNIMPLEMENTED. Tests of the
// node side run the real agent (realAgent).
type identityAgent struct{ uuid, location string }

func (a identityAgent) Identity(context.Context) (driver.NodeIdentity, error) {
	return driver.NodeIdentity{UUID: a.uuid, Location: a.location}, nil
}

var errNoVolumeMethods = status.Error(codes.Unimplemented, "this test's agent stands in for identity only")

func (identityAgent) Stage(context.Context, driver.StageRequest) error     { return errNoVolumeMethods }
func (identityAgent) Publish(context.Context, driver.PublishRequest) error { return errNoVolumeMethods }

// Unstage and Unpublish of a path where nothing is mounted succeed, as the
// agent's will: that is what cleaning up a never-staged volume looks like.
func (identityAgent) Unstage(_ context.Context, _, path string) error {
	if mounted(path) {
		return errNoVolumeMethods
	}
	return nil
}

func (identityAgent) Unpublish(_ context.Context, _, path string) error {
	if mounted(path) {
		return errNoVolumeMethods
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return status.Errorf(codes.Internal, "removing %s: %v", path, err)
	}
	return nil
}

func mounted(path string) bool {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}
func (identityAgent) Expand(context.Context, string, string, int64) (int64, error) {
	return 0, errNoVolumeMethods
}
func (identityAgent) Stats(context.Context, string, string) (driver.VolumeStats, error) {
	return driver.VolumeStats{}, errNoVolumeMethods
}
func (identityAgent) VolumeToken(context.Context, string, map[string]string) (driver.VolumeToken, error) {
	return driver.VolumeToken{}, errNoVolumeMethods
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

type testEnv struct {
	sim      *sim.Server
	api      *cloud.Client
	drv      *driver.Driver
	conn     *grpc.ClientConn
	ctrl     csi.ControllerClient
	node     csi.NodeClient
	ident    csi.IdentityClient
	endpoint string
	kubelet  string
	logs     *syncBuffer
	backend  *sim.HostBackend
}

type envOpts struct {
	backend sim.Backend // default: bookkeeping
	faults  sim.Faults
	attach  time.Duration
	// realAgent serves vco-agent's own API and volume manager in-process
	// on a unix socket, doing real mounts of the host backend's loop
	// devices; it needs a *sim.HostBackend and root.
	realAgent bool
}

func newTestEnv(t testing.TB, o envOpts) *testEnv {
	t.Helper()
	dir := t.TempDir()
	seed := sim.DefaultSeed()
	seed.HostVM.ReferenceID, seed.HostVM.Location = hostUUID, hostLoc
	if o.backend == nil {
		o.backend = sim.BookkeepingBackend{}
	}
	s, err := sim.New(sim.Options{Customer: "acme", Token: testJWT, StateFile: filepath.Join(dir, "sim.json"),
		Seed: seed, Backend: o.backend, Faults: o.faults})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	tok := filepath.Join(dir, "token")
	if err := os.WriteFile(tok, []byte(testJWT), 0o600); err != nil {
		t.Fatal(err)
	}
	api, err := cloud.New(cloud.Config{BaseURL: hs.URL + "/api/1", Customer: "acme", TokenFile: tok,
		BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond, MaxAttempts: 12})
	if err != nil {
		t.Fatal(err)
	}
	kubelet := filepath.Join(dir, "kubelet")
	os.MkdirAll(kubelet, 0o750)
	cfg := driver.Config{Agent: identityAgent{hostUUID, hostLoc}}
	if o.realAgent {
		cfg.Agent = startAgent(t, dir, kubelet, o.backend.(*sim.HostBackend).Dir)
		tc, _ := agentnodetest.Transit(t)
		cfg.Transit, cfg.TransitKey = tc, crypt.TransitKey{Mount: "transit", Name: "vco-volumes"}
	}
	d, err := driver.New(driver.Config{Name: drivername.FromPortal("try.whitesky.cloud"), Version: "test", Mode: driver.ModeAll,
		Cloud: api, DefaultLocation: hostLoc, Agent: cfg.Agent, Transit: cfg.Transit, TransitKey: cfg.TransitKey, KubeletRoot: kubelet,
		AttachPoll: 5 * time.Millisecond, AttachTimeout: o.attach})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "csi.sock")
	ln, err := driver.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	srv := d.NewGRPCServer(slog.New(slog.NewTextHandler(logs, nil)))
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e := &testEnv{sim: s, api: api, drv: d, conn: conn, ctrl: csi.NewControllerClient(conn), node: csi.NewNodeClient(conn),
		ident: csi.NewIdentityClient(conn), endpoint: "unix://" + sock, kubelet: kubelet, logs: logs}
	if hb, ok := o.backend.(*sim.HostBackend); ok {
		e.backend = hb
	}
	return e
}

// startAgent serves vco-agent's API with its real volume manager on a unix
// socket under dir and returns the node plugin's connection to it. Loop
// devices offer no fencing, so both opt-ins are on: the agent's
// volumes.allow_unfenced and allow_loop_devices, and the plugin's
// AllowUnfenced with the simulator's disk directory. LUKS2 is the agent's
// own with a FAKE dm-crypt mapping (agentnodetest.LoopLUKS): this host has
// no device-mapper.
func startAgent(t testing.TB, dir, kubelet, diskDir string) *agentnode.Agent {
	t.Helper()
	// Registered first so it runs last: whatever a failed test left
	// mounted under dir goes before the temporary directory does.
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	key, err := fence.KeyFromUUID(hostUUID)
	if err != nil {
		t.Fatal(err)
	}
	m, err := volume.New(volume.Options{
		Config:   config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Second, AllowUnfenced: true, AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "agent-state"), SysfsRoot: "/sys",
		Fencers: &volume.Fencing{Key: key, Node: hostUUID}, Crypt: agentnodetest.NewLoopLUKS(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return agentnodetest.ServeAgent(t, filepath.Join(dir, "agent.sock"), m,
		server.NodeIdentity{SystemUUID: hostUUID, Location: hostLoc}, nil,
		agentnode.Options{AllowUnfenced: true, LoopDiskDir: diskDir})
}
