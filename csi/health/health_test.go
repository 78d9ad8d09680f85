package health

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// identity stands in for the plugin's Identity service, so each of
// Probe's answers can be set; the driver's real Probe against the API
// simulator is exercised by cmd/vco-csi's TestBinaryControllerAgainstSim.
type identity struct {
	csi.UnimplementedIdentityServer
	mu    sync.Mutex
	err   error
	ready *wrapperspb.BoolValue
	calls int
}

func (i *identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.calls++
	if i.err != nil {
		return nil, i.err
	}
	return &csi.ProbeResponse{Ready: i.ready}, nil
}

func (i *identity) set(err error, ready *wrapperspb.BoolValue) {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.err, i.ready = err, ready
}

func serveIdentity(t *testing.T, id *identity) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "csi.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, id)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return sock
}

func get(t *testing.T, h http.Handler) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, Path, nil))
	b, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(b)
}

func TestHealthFollowsProbe(t *testing.T) {
	id := &identity{ready: wrapperspb.Bool(true)}
	sock := serveIdentity(t, id)
	var log bytes.Buffer
	var extra error
	h, err := New("unix://"+sock, slog.New(slog.NewTextHandler(&log, nil)), func(context.Context) error { return extra })
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	steps := []struct {
		name     string
		err      error
		ready    *wrapperspb.BoolValue
		extra    error
		code     int
		body     string
		logEntry string
	}{
		{"ready", nil, wrapperspb.Bool(true), nil, 200, "ok", ""},
		{"probe fails", status.Error(codes.FailedPrecondition, "probe: the node agent does not answer: dial unix /run/vco-agent/agent.sock"), nil, nil,
			503, "the node agent does not answer", "health check failing"},
		{"not ready", nil, wrapperspb.Bool(false), nil, 503, "not ready", "health check failing"},
		// The CSI spec: a Probe without the ready field means ready.
		{"ready absent", nil, nil, nil, 200, "ok", "health check passing again"},
		{"extra check fails", nil, wrapperspb.Bool(true), errors.New("the kubelet refused to register driver d"), 503, "refused to register", "health check failing"},
		{"recovered", nil, wrapperspb.Bool(true), nil, 200, "ok", "health check passing again"},
	}
	for _, s := range steps {
		id.set(s.err, s.ready)
		extra = s.extra
		log.Reset()
		code, body := get(t, h)
		if code != s.code || !strings.Contains(body, s.body) {
			t.Errorf("%s: /healthz = %d %q, want %d with %q", s.name, code, body, s.code, s.body)
		}
		if s.logEntry != "" && !strings.Contains(log.String(), s.logEntry) {
			t.Errorf("%s: log %q lacks %q", s.name, log.String(), s.logEntry)
		}
	}
	// The same failure twice is logged once.
	id.set(errors.New("down"), nil)
	get(t, h)
	log.Reset()
	get(t, h)
	if strings.Contains(log.String(), "failing") {
		t.Errorf("an unchanged failure was logged again: %s", log.String())
	}
	if id.calls != len(steps)+2 {
		t.Errorf("Probe was called %d times for %d probes; the handler must ask the plugin each time", id.calls, len(steps)+2)
	}
}

func TestHealthFailsWithoutThePluginSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "csi.sock")
	h, err := New("unix://"+sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if code, body := get(t, h); code != 503 || !strings.Contains(body, "CSI Probe failed") {
		t.Errorf("/healthz with no plugin socket = %d %q, want 503 saying the probe failed", code, body)
	}
}

func TestHealthEndpointOverHTTP(t *testing.T) {
	id := &identity{ready: wrapperspb.Bool(true)}
	sock := serveIdentity(t, id)
	h, err := New("unix://"+sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	ln, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(Path, h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, ln, mux) }()
	r, err := http.Get("http://" + ln.Addr().String() + Path)
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != 200 {
		t.Errorf("GET %s = %d", Path, r.StatusCode)
	}
	// A taken port fails at Listen, naming the flag.
	if _, err := Listen(ln.Addr().String()); err == nil || !strings.Contains(err.Error(), "--http-endpoint") {
		t.Errorf("second Listen on %s = %v; want an error naming --http-endpoint", ln.Addr(), err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve after cancel: %v", err)
	}
}

func TestNewRefusesOtherSchemes(t *testing.T) {
	if _, err := New("http://x", nil); err == nil {
		t.Error("New accepted an http endpoint")
	}
}
