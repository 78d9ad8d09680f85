package volume

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics are the volume manager's Prometheus series.
type Metrics struct {
	reg      *prometheus.Registry
	claims   *prometheus.GaugeVec
	checks   *prometheus.CounterVec
	refusals prometheus.Counter
	fences   prometheus.Counter
	// fenceKept counts releases the release guard refused (guard.go).
	fenceKept prometheus.Counter
	// reestablishes counts claims found lost because the storage forgot
	// them, by what re-establishing did.
	reestablishes *prometheus.CounterVec
	// reclaimWaits counts stages that waited for a holder to re-establish
	// before claiming a disk its target may have forgotten.
	reclaimWaits *prometheus.CounterVec
	stages       *prometheus.CounterVec
	checkTime    prometheus.Histogram
}

// NewMetrics registers the series on a registry of their own.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		claims: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "claims",
			Help: "Volumes this agent has claimed, by state (held, unfenced, lost, missing).",
		}, []string{"state"}),
		checks: counterVec("claim_checks_total",
			"Checks of claims, by result (ok, lost, error, missing).", "result"),
		refusals: prometheus.NewCounter(counterOpts("refusals_total",
			"Disks refused because another node holds them.")),
		fences: prometheus.NewCounter(counterOpts("fences_total",
			"Claims found lost; I/O to the disk was stopped.")),
		fenceKept: prometheus.NewCounter(counterOpts("fence_kept_total",
			"Fence releases the release guard refused because something of the volume was still in use on this node; the fence was kept.")),
		reestablishes: counterVec("reestablishes_total",
			"Claims whose reservation the storage target forgot (a restart), by result: ok (re-established), refused (another key appeared, or registrations changed: fenced), error (fenced).", "result"),
		reclaimWaits: counterVec("reclaim_waits_total",
			"Stages without a grant that found a disk holding data whose target showed no registration since it started (a restart may have forgotten its holder's claim) and waited volumes.reclaim_wait, by result: claimed (no holder came back), refused (a holder re-established), ended (the caller gave up; its retry waits what is left), error.", "result"),
		stages: counterVec("volume_operations_total",
			"Volume API operations, by operation and gRPC-facing result kind.", "op", "result"),
		checkTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricNamespace, Name: "claim_check_seconds",
			Help:    "Time to check every claim once.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 8),
		}),
	}
	m.reg.MustRegister(m.claims, m.checks, m.refusals, m.fences, m.fenceKept, m.reestablishes, m.reclaimWaits, m.stages, m.checkTime,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// metricNamespace prefixes every series of the agent.
const metricNamespace = "vco_agent"

// counterOpts are the options of one of the agent's counters.
func counterOpts(name, help string) prometheus.CounterOpts {
	return prometheus.CounterOpts{Namespace: metricNamespace, Name: name, Help: help}
}

// counterVec is one of the agent's counters, by labels.
func counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(counterOpts(name, help), labels)
}

// Handler serves the series in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Registry is the registry the series live in (for tests and for adding
// the daemon's own series).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }
