package metrics

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

func TestInterceptorCountsCallsByCode(t *testing.T) {
	m := New()
	info := &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodeStageVolume"}
	fail := func(context.Context, any) (any, error) { return nil, status.Error(codes.FailedPrecondition, "refused") }
	ok := func(context.Context, any) (any, error) { return "ok", nil }
	m.Interceptor()(context.Background(), nil, info, fail)
	m.Interceptor()(context.Background(), nil, info, fail)
	m.Interceptor()(context.Background(), nil, info, ok)
	if got := testutil.ToFloat64(m.calls.WithLabelValues("NodeStageVolume", "FailedPrecondition")); got != 2 {
		t.Errorf("FailedPrecondition count %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.calls.WithLabelValues("NodeStageVolume", "OK")); got != 1 {
		t.Errorf("OK count %v, want 1", got)
	}
	if n := testutil.CollectAndCount(m.callTime); n != 1 {
		t.Errorf("latency series: %d, want 1", n)
	}
}

func TestOperationLeavesOutIDs(t *testing.T) {
	for in, want := range map[string]string{
		"/api/1/customers/c1/locations/ams1/disks/4711/notes":    "/api/1/customers/{}/locations/{}/disks/{}/notes",
		"/api/1/customers/c1/cloudspaces/cs/vms/12/disks":        "/api/1/customers/{}/cloudspaces/{}/vms/{}/disks",
		"/api/1/customers/c1/locations/ams1/disks/9/snapshots/s": "/api/1/customers/{}/locations/{}/disks/{}/snapshots/{}",
		"/api/1/customers/c1/locations":                          "/api/1/customers/{}/locations",
	} {
		if got := Operation(in); got != want {
			t.Errorf("Operation(%s) = %s, want %s", in, got, want)
		}
	}
}

// Every attempt of an API call passes through the wrapped transport of a
// real cloud client: a 429 and its retry are both counted.
func TestAPIRequestsCountedWithRetries(t *testing.T) {
	var n atomic.Int32
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		io.WriteString(w, `{"disk_id": 4711, "disk_name": "pvc-1", "location": "ams1", "disk_size": 1}`)
	}))
	defer api.Close()
	m := New()
	token := filepath.Join(t.TempDir(), "token")
	os.WriteFile(token, []byte("jwt"), 0o600)
	c, err := cloud.New(cloud.Config{BaseURL: api.URL + "/api/1", Customer: "c1", TokenFile: token, BackoffBase: time.Millisecond, WrapTransport: m.Transport})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetDisk(context.Background(), "ams1", 4711); err != nil {
		t.Fatal(err)
	}
	op := "GET /api/1/customers/{}/locations/{}/disks/{}"
	if got := testutil.ToFloat64(m.api.WithLabelValues(op, "429")); got != 1 {
		t.Errorf("429 count %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.api.WithLabelValues(op, "200")); got != 1 {
		t.Errorf("200 count %v, want 1", got)
	}
}

// The node plugin's /metrics carries the agent's vco_agent_* series, read
// from its metrics socket, besides its own; with the agent down it still
// answers and counts the failure.
func TestAgentSeriesReExported(t *testing.T) {
	dir, err := os.MkdirTemp("", "vco-metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "metrics.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	agent := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "# TYPE vco_agent_claims gauge\nvco_agent_claims{state=\"held\"} 2\n# TYPE vco_agent_fences_total counter\nvco_agent_fences_total 1\n# TYPE go_goroutines gauge\ngo_goroutines 99\n")
	})}
	go agent.Serve(l)
	m := New()
	m.WithAgent(sock)
	stop, err := m.Serve("127.0.0.1:0", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	get := func() string {
		rec := httptest.NewRecorder()
		m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		if rec.Code != 200 {
			t.Fatalf("/metrics: %d %s", rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	body := get()
	for _, want := range []string{`vco_agent_claims{state="held"} 2`, "vco_agent_fences_total 1", "vco_csi_agent_metrics_errors_total 0"} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, body)
		}
	}
	if strings.Contains(body, "go_goroutines 99") || strings.Count(body, "# TYPE go_goroutines") != 1 {
		t.Errorf("the agent's go_goroutines leaked into the plugin's series:\n%s", body)
	}
	agent.Close()
	os.Remove(sock)
	body = get()
	if strings.Contains(body, "vco_agent_claims") || !strings.Contains(body, "vco_csi_agent_metrics_errors_total 1") {
		t.Errorf("with the agent gone: %s", body)
	}
}

func TestKubeEventsCountedByResult(t *testing.T) {
	m := New()
	m.KubeEvent("failed", 1)
	m.KubeEvent("failed", 1)
	m.KubeEvent("missed", 6)
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{`vco_csi_kube_events_total{result="failed"} 2`, `vco_csi_kube_events_total{result="missed"} 6`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("no %s in:\n%s", want, rec.Body)
		}
	}
}
