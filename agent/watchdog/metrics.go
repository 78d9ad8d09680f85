package watchdog

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector returns the watchdog's Prometheus series, read from Status
// at each scrape.
func (w *Watchdog) Collector() prometheus.Collector { return collector{w} }

type collector struct{ w *Watchdog }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("vco_agent_host_watchdog_"+name, help, labels, nil)
}

var (
	descArmed    = desc("armed", "1 while the host watchdog is armed (a lease is held, or being taken).")
	descUnsafe   = desc("unsafe", "1 when leases are held without a host watchdog (volumes.lease.watchdog_device: none-unsafe).")
	descInfo     = desc("info", "The armed host watchdog device, always 1.", "device", "identity", "nowayout")
	descTimeout  = desc("timeout_seconds", "The armed device's timeout: the host resets this long after the last feed.")
	descLastFeed = desc("last_feed_timestamp_seconds", "When the host watchdog was last fed (Unix time).")
	descLeases   = desc("leases", "Leases the host watchdog guards.")
	descWithheld = desc("withheld_leases", "Leases not renewed in time whose I/O is not stopped: while above 0 the watchdog is not fed.")
	descFeeds    = desc("feeds_total", "Feeds of the host watchdog.")
	descMisses   = desc("missed_feeds_total", "Ticks at which the host watchdog was not fed: a lease withheld it, or the feed failed.")
)

func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descArmed, descUnsafe, descInfo, descTimeout, descLastFeed, descLeases, descWithheld, descFeeds, descMisses} {
		ch <- d
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	st := c.w.Status()
	ch <- prometheus.MustNewConstMetric(descArmed, prometheus.GaugeValue, b2f(st.Armed))
	ch <- prometheus.MustNewConstMetric(descUnsafe, prometheus.GaugeValue, b2f(st.Unsafe))
	if st.Armed {
		now := "0"
		if st.Nowayout {
			now = "1"
		}
		ch <- prometheus.MustNewConstMetric(descInfo, prometheus.GaugeValue, 1, st.Device, st.Identity, now)
		ch <- prometheus.MustNewConstMetric(descTimeout, prometheus.GaugeValue, st.Timeout.Seconds())
	}
	if !st.LastFeed.IsZero() {
		ch <- prometheus.MustNewConstMetric(descLastFeed, prometheus.GaugeValue, float64(st.LastFeed.UnixNano())/1e9)
	}
	ch <- prometheus.MustNewConstMetric(descLeases, prometheus.GaugeValue, float64(st.Leases))
	ch <- prometheus.MustNewConstMetric(descWithheld, prometheus.GaugeValue, float64(len(st.Withheld)))
	ch <- prometheus.MustNewConstMetric(descFeeds, prometheus.CounterValue, float64(st.Feeds))
	ch <- prometheus.MustNewConstMetric(descMisses, prometheus.CounterValue, float64(st.Misses))
}
