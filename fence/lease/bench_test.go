package lease

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
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
	bound := testTiming.Bounds().DeadTakeover
	b.ReportMetric(float64(mean.Milliseconds()), "ms")
	b.ReportMetric(float64(bound.Milliseconds()), "ref-ms")
	b.ReportMetric(float64(mean)/float64(bound), "x-ref")
}

// BenchmarkTakeoverGrantedLive measures a granted takeover from a live
// holder, which lets go at its next renewal; reference: its bound,
// max(2d, R) + d/2 (Timing.Bounds), the holder's drain being nothing here.
func BenchmarkLeaseTakeoverGrantedLive(b *testing.B) {
	b.Run("vs=grant-live-bound", benchTakeoverGrantedLive)
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
	ref := testTiming.Bounds().GrantLive
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

// BenchmarkLeaseIOBusyLoop measures what d must cover: the latency of one
// lease read (the whole area) and one slot write, O_DIRECT|O_DSYNC, on a
// loop device whose backing file is on the machine's own disk while a
// writer keeps the volume's data area busy with 1 MiB O_DIRECT|O_DSYNC
// writes (the volume in use). It reports the median, the 99th percentile
// and the largest of 400 operations (each a read and a write), against
// the default I/O timeout d (400 operations per iteration).
func BenchmarkLeaseIOBusyLoop(b *testing.B) {
	b.Run("vs=default-io-timeout", benchIOBusyLoop)
}

func benchIOBusyLoop(b *testing.B) {
	hosttest.NeedRoot(b, "needs root to attach a loop device")
	ctx := context.Background()
	dir, err := os.MkdirTemp("/var/tmp", "lease-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		b.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		b.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		b.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	b.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	d := openDev(b, dev)
	if _, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second}); err != nil {
		b.Fatal(err)
	}
	// The busy volume: 1 MiB direct, synchronous writes over its data.
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC, 0)
		if err != nil {
			return
		}
		defer f.Close()
		buf := alignedBuf(1 << 20)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			f.WriteAt(buf, DataOffset+int64(i%60)<<20)
		}
	}()
	defer func() { close(stop); <-done }()
	slot := EncodeSlot(Slot{Key: keyA, Epoch: 1, Counter: 1, State: StateHeld, Timing: DefaultTiming()})
	blk := alignedBuf(BlockSize)
	copy(blk, slot)
	const ops = 400
	var lat []time.Duration
	b.ResetTimer()
	for range b.N {
		for range ops {
			t0 := time.Now()
			if _, err := d.ReadArea(ctx, time.Minute); err != nil {
				b.Fatal(err)
			}
			if err := d.writeSlot(ctx, 3, blk, time.Minute); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
	}
	b.StopTimer()
	slices.Sort(lat)
	ms := func(x time.Duration) float64 { return float64(x.Microseconds()) / 1000 }
	ref := DefaultTiming().IOTimeout
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
	b.ReportMetric(ms(lat[len(lat)*99/100]), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "ms")
	b.ReportMetric(ms(ref), "ref-ms")
	b.ReportMetric(float64(lat[len(lat)-1])/float64(ref), "x-ref")
}
