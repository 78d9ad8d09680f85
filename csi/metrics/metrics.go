// Package metrics is vco-csi's Prometheus endpoint (--metrics-address):
// the CSI calls the plugin serves, by method and gRPC code, and their
// latency; the whitesky.cloud API requests the controller makes, by
// operation and status, and their latency; and, on the node plugin,
// vco-agent's own series read from the agent's metrics socket, so that one
// scrape of the node plugin's pod carries the node's fencing, and the
// Kubernetes Events the node plugin posts of the agent's events
// (docs/monitoring.md).
package metrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Metrics holds the plugin's series.
type Metrics struct {
	reg       *prometheus.Registry
	calls     *prometheus.CounterVec
	callTime  *prometheus.HistogramVec
	api       *prometheus.CounterVec
	apiTime   *prometheus.HistogramVec
	agentSock string
	agentErrs prometheus.Counter
	kubeEvts  *prometheus.CounterVec
}

// New makes the series on a registry of their own.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "vco_csi", Name: "operations_total",
			Help: "CSI calls served, by method and gRPC code.",
		}, []string{"method", "code"}),
		callTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "vco_csi", Name: "operation_seconds",
			Help:    "Time to serve a CSI call, by method.",
			Buckets: prometheus.ExponentialBuckets(0.005, 4, 9),
		}, []string{"method"}),
		api: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "vco_csi", Name: "api_requests_total",
			Help: "whitesky.cloud API requests, every attempt of a call counted, by operation (method and path, ids left out) and HTTP status (\"error\" when no answer came); 429 and 5xx answers are retried.",
		}, []string{"operation", "status"}),
		apiTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "vco_csi", Name: "api_request_seconds",
			Help:    "Time of one whitesky.cloud API request, by operation.",
			Buckets: prometheus.ExponentialBuckets(0.01, 3, 9),
		}, []string{"operation"}),
		agentErrs: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "vco_csi", Name: "agent_metrics_errors_total",
			Help: "Scrapes in which the agent's metrics socket could not be read; its series are then missing.",
		}),
		kubeEvts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "vco_csi", Name: "kube_events_total",
			Help: "The node plugin's Kubernetes Events of the agent's events (docs/events.md, \"In Kubernetes\"), by result: created, updated, failed (a request the API server did not answer or refused), already_posted (an occurrence a previous plugin process posted), dropped (too many Events waiting), missed (agent events gone from its ring before they were read).",
		}, []string{"result"}),
	}
	m.reg.MustRegister(m.calls, m.callTime, m.api, m.apiTime, m.agentErrs, m.kubeEvts,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// KubeEvent counts n outcomes of the node plugin's Kubernetes Events.
func (m *Metrics) KubeEvent(result string, n uint64) {
	m.kubeEvts.WithLabelValues(result).Add(float64(n))
}

// Registry is where the series live.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Interceptor counts and times every CSI call; it goes first in the
// chain, so that it sees the code the caller gets.
func (m *Metrics) Interceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		method := info.FullMethod[strings.LastIndexByte(info.FullMethod, '/')+1:]
		m.calls.WithLabelValues(method, status.Code(err).String()).Inc()
		m.callTime.WithLabelValues(method).Observe(time.Since(start).Seconds())
		return resp, err
	}
}

// Transport counts and times each request that goes through rt.
func (m *Metrics) Transport(rt http.RoundTripper) http.RoundTripper {
	return roundTripper{m: m, next: rt}
}

type roundTripper struct {
	m    *Metrics
	next http.RoundTripper
}

func (t roundTripper) RoundTrip(r *http.Request) (*http.Response, error) {
	op := r.Method + " " + Operation(r.URL.Path)
	start := time.Now()
	resp, err := t.next.RoundTrip(r)
	code := "error"
	if err == nil {
		code = strconv.Itoa(resp.StatusCode)
	}
	t.m.api.WithLabelValues(op, code).Inc()
	t.m.apiTime.WithLabelValues(op).Observe(time.Since(start).Seconds())
	return resp, err
}

// collections are the API's path segments followed by an id.
var collections = map[string]bool{"customers": true, "locations": true, "disks": true, "cloudspaces": true, "vms": true, "snapshots": true, "notes": true}

// Operation is an API path with its ids left out:
// /api/1/customers/c1/locations/ams1/disks/4711/notes gives
// /api/1/customers/{}/locations/{}/disks/{}/notes, so that the label's
// values stay few.
func Operation(path string) string {
	segs := strings.Split(path, "/")
	for i := 1; i < len(segs); i++ {
		if collections[segs[i-1]] && segs[i] != "" {
			segs[i] = "{}"
		}
	}
	return strings.Join(segs, "/")
}

// WithAgent adds vco-agent's series, read from its metrics socket at each
// scrape (agent/config metrics.socket). A scrape that cannot read them
// still answers with the plugin's own, and counts the failure.
func (m *Metrics) WithAgent(socket string) { m.agentSock = socket }

func (m *Metrics) gatherAgent() ([]*dto.MetricFamily, error) {
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", m.agentSock)
		}}}
	resp, err := hc.Get("http://vco-agent/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("the agent's metrics socket %s answered %s", m.agentSock, resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(b))
	if err != nil {
		return nil, fmt.Errorf("the agent's metrics from %s: %w", m.agentSock, err)
	}
	var out []*dto.MetricFamily
	for name, f := range fams {
		// The agent's Go and process series would collide with the
		// plugin's own; only its vco_agent_* series are re-exported.
		if strings.HasPrefix(name, "vco_agent_") {
			out = append(out, f)
		}
	}
	return out, nil
}

// Gather implements prometheus.Gatherer: the plugin's series and, when
// WithAgent was called, the agent's.
func (m *Metrics) Gather() ([]*dto.MetricFamily, error) {
	if m.agentSock == "" {
		return m.reg.Gather()
	}
	agent, err := m.gatherAgent()
	if err != nil {
		m.agentErrs.Inc()
	}
	own, gerr := m.reg.Gather()
	if gerr != nil {
		return own, gerr
	}
	return prometheus.Gatherers{prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) { return own, nil }),
		prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) { return agent, nil })}.Gather()
}

// Handler serves Gather's series.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// Serve listens on addr (host:port) and serves /metrics until the returned
// function is called. A listener that cannot start is returned as an
// error for the caller to log: metrics never stop the plugin.
func (m *Metrics) Serve(addr string, log *slog.Logger) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return func() {}, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("the metrics listener stopped", "address", addr, "err", err)
		}
	}()
	return func() { srv.Close() }, nil
}
