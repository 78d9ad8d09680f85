package events

import (
	"sync"
	"testing"
	"time"
)

// BenchmarkEventsTo10Subscribers measures events per second delivered
// through the bus to each of 10 subscribers that drain as fast as they can, against the same
// fan-out over bare buffered Go channels (blocking sends, no ring, no
// sequence numbers, no sinks). Figures for `make bench`; nothing asserted.
func BenchmarkEventsTo10Subscribers(b *testing.B) {
	b.Run("vs=channel-fanout", func(b *testing.B) {
		const subs = 10
		bus := NewBus(256, 1024, nil)
		var wg sync.WaitGroup
		for i := 0; i < subs; i++ {
			s := bus.Subscribe(false)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range s.C() {
				}
			}()
		}
		e := Event{Type: DiskClaimed, Volume: "ch-lug-1/disk-1", Device: "/dev/sdb", Reason: "bench"}
		b.ResetTimer()
		start := time.Now()
		for i := 0; i < b.N; i++ {
			bus.Publish(e)
		}
		bus.Close()
		wg.Wait()
		busDur := time.Since(start)
		b.StopTimer()
		dropped := bus.Stats().Dropped

		chans := make([]chan Event, subs)
		for i := range chans {
			chans[i] = make(chan Event, 1024)
			wg.Add(1)
			go func(c chan Event) {
				defer wg.Done()
				for range c {
				}
			}(chans[i])
		}
		start = time.Now()
		for i := 0; i < b.N; i++ {
			for _, c := range chans {
				c <- e
			}
		}
		for _, c := range chans {
			close(c)
		}
		wg.Wait()
		refDur := time.Since(start)

		// Delivered per subscriber: what a reader actually sees. The bus drops
		// for readers that fall behind instead of slowing the publisher.
		rate := (float64(b.N)*subs - float64(dropped)) / subs / busDur.Seconds()
		ref := float64(b.N) / refDur.Seconds()
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(rate, "events/s")
		b.ReportMetric(ref, "ref-events/s")
		b.ReportMetric(rate/ref, "x-ref")
		b.ReportMetric(float64(dropped)/float64(b.N*subs)*100, "%dropped")
	})
}
