package lease

import (
	"context"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// BenchmarkTakeoverExpired measures a takeover from a frozen holder
// against its documented bound, Expiry + Settle (plus a renewal interval
// of polling granularity at most).
func BenchmarkLeaseTakeoverExpired(b *testing.B) {
	b.Run("vs=expiry+settle-bound", benchTakeoverExpired)
}

func benchTakeoverExpired(b *testing.B) {
	ctx := context.Background()
	dev := formattedLoop(b, 4096)
	var total time.Duration
	for range b.N {
		b.StopTimer()
		a, n := newNode(b, dev, uuidA, "node-a"), newNode(b, dev, uuidB, "node-b")
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			b.Fatal(err)
		}
		a.pause(true)
		b.StartTimer()
		t0 := time.Now()
		if _, err := n.e.Acquire(ctx, nil); err != nil {
			b.Fatal(err)
		}
		total += time.Since(t0)
		b.StopTimer()
		if err := n.e.Release(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	mean := total / time.Duration(b.N)
	bound := testTiming.Expiry() + testTiming.Settle()
	b.ReportMetric(float64(mean.Milliseconds()), "ms")
	b.ReportMetric(float64(bound.Milliseconds()), "ref-ms")
	b.ReportMetric(float64(mean)/float64(bound), "x-ref")
}

// BenchmarkTakeoverGrantedLive measures a granted takeover from a live
// holder, which lets go at its next renewal; reference: one renewal
// interval plus Settle.
func BenchmarkLeaseTakeoverGrantedLive(b *testing.B) {
	b.Run("vs=renew+settle", benchTakeoverGrantedLive)
}

func benchTakeoverGrantedLive(b *testing.B) {
	ctx := context.Background()
	dev := formattedLoop(b, 4096)
	grant := &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{keyA}}
	var total time.Duration
	for range b.N {
		b.StopTimer()
		a, n := newNode(b, dev, uuidA, "node-a"), newNode(b, dev, uuidB, "node-b")
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		t0 := time.Now()
		if _, err := n.e.Acquire(ctx, grant); err != nil {
			b.Fatal(err)
		}
		total += time.Since(t0)
		b.StopTimer()
		<-a.lost
		if err := n.e.Release(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	mean := total / time.Duration(b.N)
	ref := testTiming.Renew + testTiming.Settle()
	b.ReportMetric(float64(mean.Milliseconds()), "ms")
	b.ReportMetric(float64(ref.Milliseconds()), "ref-ms")
	b.ReportMetric(float64(mean)/float64(ref), "x-ref")
}

// BenchmarkCheck64 measures one periodic check of 64 claims (64 loop
// devices, each renewing in the background as in the agent), against the
// floor: one raw O_DIRECT read of the same lease area per device.
func BenchmarkLeaseCheck64Claims(b *testing.B) {
	b.Run("vs=raw-odirect-reads", benchCheck64)
}

func benchCheck64(b *testing.B) {
	ctx := context.Background()
	const claims = 64
	engines := make([]*Engine, claims)
	for i := range claims {
		dev := formattedLoop(b, 4096)
		// The check's cost does not depend on the timing; a slow one keeps
		// 64 renewers from starving a loaded test machine.
		n := newNodeTiming(b, dev, uuidA, "node-a", Timing{IOTimeout: time.Second, Renew: 2 * time.Second, Fail: 8 * time.Second})
		engines[i] = n.e
	}
	errs := make(chan error, claims)
	for _, e := range engines {
		go func() { _, err := e.Acquire(ctx, nil); errs <- err }()
	}
	for range claims {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
	// Reference: the same reads with no decoding or verification.
	t0 := time.Now()
	const refRounds = 20
	for range refRounds {
		for _, e := range engines {
			if _, err := e.dev.ReadArea(ctx, time.Second); err != nil {
				b.Fatal(err)
			}
		}
	}
	ref := time.Since(t0) / refRounds
	b.ResetTimer()
	for range b.N {
		for _, e := range engines {
			if err := e.Check(ctx); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	per := b.Elapsed() / time.Duration(b.N)
	b.ReportMetric(float64(per.Microseconds()), "us")
	b.ReportMetric(float64(ref.Microseconds()), "ref-us")
	b.ReportMetric(float64(per)/float64(ref), "x-ref")
}
