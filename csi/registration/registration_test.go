package registration

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"log/slog"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	regv1 "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// syncBuffer is a log sink the server's goroutines may write to while the
// test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// kubeletClient dials a registration socket the way the kubelet's plugin
// watcher does: a plain unix dial of the socket path, no TLS.
func kubeletClient(t *testing.T, sock string) regv1.RegistrationClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return regv1.NewRegistrationClient(conn)
}

func start(t *testing.T, dir string, log *syncBuffer) *Server {
	t.Helper()
	s, err := Start(Config{DriverName: "cloud.whitesky.csi", Endpoint: "/var/lib/kubelet/plugins/cloud.whitesky.csi/csi.sock",
		Dir: dir, Log: slog.New(slog.NewTextHandler(log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestKubeletRegistersThePlugin(t *testing.T) {
	dir := t.TempDir()
	// A socket file left by a killed earlier run is replaced.
	stale := filepath.Join(dir, "cloud.whitesky.csi-reg.sock")
	if err := os.WriteFile(stale, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var log syncBuffer
	s := start(t, dir, &log)
	defer s.Stop()
	if s.SocketPath() != stale {
		t.Fatalf("socket at %s, want %s (where the kubelet's plugin watcher looks)", s.SocketPath(), stale)
	}
	kubelet := kubeletClient(t, s.SocketPath())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	info, err := kubelet.GetInfo(ctx, &regv1.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	checkInfoForTheKubelet(t, info)
	if s.Registered() || s.Check(ctx) != nil {
		t.Errorf("before the kubelet's verdict: registered %v, check %v; want not registered and healthy", s.Registered(), s.Check(ctx))
	}

	refusalIsLoggedAndChecked(ctx, t, s, kubelet, &log)

	// The kubelet retries; its acceptance clears the failure.
	if _, err := kubelet.NotifyRegistrationStatus(ctx, &regv1.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	if !s.Registered() || s.Check(ctx) != nil {
		t.Errorf("after the kubelet accepted: registered %v, check %v", s.Registered(), s.Check(ctx))
	}
}

// checkInfoForTheKubelet: GetInfo names a CSI plugin, the driver and its
// host socket path, and a version the kubelet takes.
func checkInfoForTheKubelet(t *testing.T, info *regv1.PluginInfo) {
	t.Helper()
	if info.GetType() != regv1.CSIPlugin || info.GetName() != "cloud.whitesky.csi" ||
		info.GetEndpoint() != "/var/lib/kubelet/plugins/cloud.whitesky.csi/csi.sock" {
		t.Errorf("GetInfo = %v; want a CSIPlugin named cloud.whitesky.csi at its host socket path", info)
	}
	// The kubelet takes the highest version with major 1 (0.x and >1 are
	// not CSI 1); there must be one.
	ok := false
	for _, v := range info.GetSupportedVersions() {
		major, _, _ := strings.Cut(strings.TrimPrefix(v, "v"), ".")
		if n, err := strconv.Atoi(major); err == nil && n == 1 {
			ok = true
		}
	}
	if !ok {
		t.Errorf("supported versions %q hold no CSI 1.x version; the kubelet would refuse the driver", info.GetSupportedVersions())
	}
}

// refusalIsLoggedAndChecked: a refusal is logged with the kubelet's
// reason, and reported by Check.
func refusalIsLoggedAndChecked(ctx context.Context, t *testing.T, s *Server, kubelet regv1.RegistrationClient, log *syncBuffer) {
	t.Helper()
	const why = "error updating CSINode annotation: timed out"
	if _, err := kubelet.NotifyRegistrationStatus(ctx, &regv1.RegistrationStatus{PluginRegistered: false, Error: why}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	if s.Registered() {
		t.Error("registered after the kubelet refused the plugin")
	}
	if err := s.Check(ctx); err == nil || !strings.Contains(err.Error(), why) {
		t.Errorf("Check after a refusal = %v; want the kubelet's reason %q", err, why)
	}
	if l := log.String(); !strings.Contains(l, "level=ERROR") || !strings.Contains(l, why) {
		t.Errorf("the refusal was not logged as an error with the kubelet's reason:\n%s", l)
	}
}

func TestCheckFailsWhenTheSocketIsGone(t *testing.T) {
	dir := t.TempDir()
	var log syncBuffer
	s := start(t, dir, &log)
	defer s.Stop()
	ctx := context.Background()
	// Someone cleans out plugins_registry: the kubelet will never call
	// again, so health must fail and the restart make a new socket.
	if err := os.Remove(s.SocketPath()); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(ctx); err == nil || !strings.Contains(err.Error(), s.SocketPath()) {
		t.Errorf("Check with the socket removed = %v; want an error naming it", err)
	}
	// Another process's socket at the same path is not ours either.
	ln, err := net.Listen("unix", s.SocketPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if err := s.Check(ctx); err == nil || !strings.Contains(err.Error(), "replaced") {
		t.Errorf("Check with a replaced socket = %v; want it reported", err)
	}
	// Stop leaves that other socket alone.
	s.Stop()
	if _, err := os.Lstat(s.SocketPath()); err != nil {
		t.Errorf("Stop removed a socket that was not its own: %v", err)
	}
}

func TestStopRemovesTheSocket(t *testing.T) {
	var log syncBuffer
	s := start(t, t.TempDir(), &log)
	s.Stop()
	if _, err := os.Lstat(s.SocketPath()); !os.IsNotExist(err) {
		t.Errorf("after Stop the registration socket is still there (%v); the kubelet would keep the plugin registered", err)
	}
}

func TestStartRefuses(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{DriverName: "d", Endpoint: "/var/lib/kubelet/plugins/d/csi.sock", Dir: filepath.Join(dir, "missing")}, "plugins_registry"},
		{Config{DriverName: "d", Endpoint: "csi.sock", Dir: dir}, "--kubelet-registration-path"},
		{Config{Endpoint: "/x/csi.sock", Dir: dir}, "no driver name"},
	} {
		if s, err := Start(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			if s != nil {
				s.Stop()
			}
			t.Errorf("Start(%+v) = %v; want an error saying %q", c.cfg, err, c.want)
		}
	}
}
