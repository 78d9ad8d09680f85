package volume

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

func init() {
	// mount-utils logs every format and mount through klog; the package's
	// tests and benchmarks keep their output to their own results.
	klog.SetSlogLogger(slog.New(slog.DiscardHandler))
}

func benchRoot(b *testing.B) {
	hosttest.NeedRoot(b, "needs root for loop devices and mounts")
}

func benchLoop(b *testing.B, mib int64) (string, string) {
	img := filepath.Join(b.TempDir(), "disk.img")
	f, err := os.Create(img)
	if err != nil {
		b.Fatal(err)
	}
	f.Truncate(mib << 20)
	f.Close()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		b.Fatalf("losetup: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	b.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return img, dev
}

func benchManager(b *testing.B, f FencerFactory) (*Manager, string) {
	dir := b.TempDir()
	kubelet := filepath.Join(dir, "kubelet")
	os.MkdirAll(kubelet, 0o755)
	b.Cleanup(func() {
		unix.Unmount(kubeletpath.Staging(kubelet, testDriver, "bench"), unix.MNT_DETACH)
		unix.Unmount(filepath.Join(kubelet, "ref"), unix.MNT_DETACH)
	})
	m, err := New(Options{Config: config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Second, AllowUnfenced: true, AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Fencers: f})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.Close)
	return m, kubelet
}

// BenchmarkStageUnstage: one stage and unstage of an ext4 volume on a loop
// device (find, verify, fence probe, blkid, fsck, mount; then unmount and
// forget), against mount(2) and umount(2) of the same filesystem.
func BenchmarkStageUnstage(b *testing.B) {
	b.Run("vs=mount-umount", func(b *testing.B) {
		benchRoot(b)
		key, _ := fence.KeyFromUUID(nodeA)
		m, kubelet := benchManager(b, &Fencing{Key: key, Node: nodeA})
		img, dev := benchLoop(b, 64)
		ctx := context.Background()
		req := StageRequest{Volume: "bench", Locator: Locator{BackingFile: img}, StagingPath: kubeletpath.Staging(kubelet, testDriver, "bench"), FsType: "ext4", AllowUnfenced: true}
		if _, err := m.Stage(ctx, req); err != nil { // formats once
			b.Fatal(err)
		}
		if err := m.Unstage(ctx, "bench", req.StagingPath); err != nil {
			b.Fatal(err)
		}
		ref := filepath.Join(kubelet, "ref")
		os.MkdirAll(ref, 0o755)
		var agent, base time.Duration
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			if _, err := m.Stage(ctx, req); err != nil {
				b.Fatal(err)
			}
			if err := m.Unstage(ctx, "bench", req.StagingPath); err != nil {
				b.Fatal(err)
			}
			agent += time.Since(t0)
			t0 = time.Now()
			if err := unix.Mount(dev, ref, "ext4", 0, ""); err != nil {
				b.Fatal(err)
			}
			if err := unix.Unmount(ref, 0); err != nil {
				b.Fatal(err)
			}
			base += time.Since(t0)
		}
		ms := float64(agent.Microseconds()) / 1000 / float64(b.N)
		refms := float64(base.Microseconds()) / 1000 / float64(b.N)
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(ms, "ms")
		b.ReportMetric(refms, "ref-ms")
		b.ReportMetric(ms/refms, "x-ref")
	})
}

// perDiskTargets gives every disk its own model target (the host has no
// SCSI), so that many claims can be held at once.
type perDiskTargets struct {
	mu   sync.Mutex
	tgts map[string]*scsitest.Target
}

func (p *perDiskTargets) target(dev string) *scsitest.Target {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tgts == nil {
		p.tgts = map[string]*scsitest.Target{}
	}
	if p.tgts[dev] == nil {
		p.tgts[dev] = scsitest.New(scsitest.Options{})
	}
	return p.tgts[dev]
}

func (p *perDiskTargets) Choose(_ context.Context, dev *Device, volume string, _ func(*fence.LostError) bool) (Choice, error) {
	e, err := pr.New(dev.Path, p.target(dev.Path).Initiator(nodeA), pr.Config{Key: keyA, Node: nodeA, Disk: volume, Verify: dev.Verify})
	return Choice{Fencer: e, Method: fence.MethodPR}, err
}

// BenchmarkCheck64Claims: one periodic check of 64 claimed raw block
// volumes on loop devices, each fenced through the reservation engine
// (answered by the model target), against the engines' own Check of the
// same 64 disks: the difference is the manager's own cost (claim records,
// locks, device identity).
func BenchmarkCheck64Claims(b *testing.B) {
	b.Run("vs=engine-checks", func(b *testing.B) {
		benchRoot(b)
		f := &perDiskTargets{}
		m, kubelet := benchManager(b, f)
		ctx := context.Background()
		var engines []fence.Fencer
		for i := 0; i < 64; i++ {
			img, _ := benchLoop(b, 1)
			vol := fmt.Sprintf("bench-%02d", i)
			if _, err := m.Stage(ctx, StageRequest{Volume: vol, Locator: Locator{BackingFile: img}, Block: true, NeverPublished: true,
				StagingPath: kubeletpath.BlockStaging(kubelet, vol)}); err != nil {
				b.Fatal(err)
			}
			engines = append(engines, m.getLive(vol).fencer)
		}
		var agent, base time.Duration
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			m.CheckAll(ctx)
			agent += time.Since(t0)
			t0 = time.Now()
			for _, e := range engines {
				if err := e.Check(ctx); err != nil {
					b.Fatal(err)
				}
			}
			base += time.Since(t0)
		}
		if n := metricValue(m, "vco_agent_claim_checks_total", "ok"); n != float64(64*b.N) {
			b.Fatalf("%v claims checked ok, want %d", n, 64*b.N)
		}
		ms := float64(agent.Microseconds()) / 1000 / float64(b.N)
		refms := float64(base.Microseconds()) / 1000 / float64(b.N)
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(ms, "ms")
		b.ReportMetric(refms, "ref-ms")
		b.ReportMetric(ms/refms, "x-ref")
		for i := 0; i < 64; i++ {
			vol := fmt.Sprintf("bench-%02d", i)
			m.Unstage(ctx, vol, kubeletpath.BlockStaging(kubelet, vol))
		}
	})
}

// BenchmarkReconcile64Claims: the start-up check of 64 claimed raw block
// volumes whose disks are found by serial (loop devices shown as
// virtio-blk disks in a sysfs tree; fenced through the reservation engine,
// answered by the model target), against one discovery scan of the same
// 64 disks. Notes: finding and opening the 64 disks through one shared
// scan (pass-ms) and through a scan of their own each (each-ms).
//
// The disks are new volumes, staged as a first stage is (the controller's
// never-published flag): a stage that took one of them for a disk holding
// data on a target that forgot its holder would wait the reclaim period
// for each of the 64 (volumes.reclaim_wait), which is not what this
// measures (docs/fencing.md).
func BenchmarkReconcile64Claims(b *testing.B) {
	b.Run("vs=one-scan", func(b *testing.B) {
		benchRoot(b)
		const n = 64
		f := &perDiskTargets{}
		sys := newFakeSysfs(b)
		dir := b.TempDir()
		kubelet := filepath.Join(dir, "kubelet")
		if err := os.MkdirAll(kubelet, 0o755); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { mounttest.UnmountUnder(kubelet) })
		opts := Options{Config: config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Second, AllowLoopDevices: true},
			StateDir: filepath.Join(dir, "state"), SysfsRoot: sys.root, Fencers: f}
		m, err := New(opts)
		if err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		var locs []Locator
		for i := range n {
			_, dev := benchLoop(b, 1)
			sys.add(fmt.Sprintf("vd%02d", i), fmt.Sprintf("bench-%02d", i), dev)
			locs = append(locs, bySerial(fmt.Sprintf("bench-%02d", i)))
			vol := fmt.Sprintf("bench-%02d", i)
			if _, err := m.Stage(ctx, StageRequest{Volume: vol, Locator: locs[i], Block: true, NeverPublished: true,
				StagingPath: kubeletpath.BlockStaging(kubelet, vol)}); err != nil {
				b.Fatal(err)
			}
		}
		m.Close()
		var agent, scan, pass, each time.Duration
		for i := 0; i < b.N; i++ {
			opts.Metrics = nil
			r, err := New(opts)
			if err != nil {
				b.Fatal(err)
			}
			t0 := time.Now()
			r.Reconcile(ctx)
			agent += time.Since(t0)
			if ok := metricValue(r, "vco_agent_claim_checks_total", "ok"); ok != n {
				b.Fatalf("%v claims re-verified, want %d", ok, n)
			}
			r.Close()

			t0 = time.Now()
			if _, err := sys.finder().Scan(); err != nil {
				b.Fatal(err)
			}
			scan += time.Since(t0)

			ds := &diskScan{f: sys.finder()}
			t0 = time.Now()
			for _, l := range locs {
				d, err := ds.locate(ctx, l, false)
				if err != nil {
					b.Fatal(err)
				}
				d.Close()
			}
			pass += time.Since(t0)
			t0 = time.Now()
			for _, l := range locs {
				d, err := locate(ctx, sys.finder(), l, false)
				if err != nil {
					b.Fatal(err)
				}
				d.Close()
			}
			each += time.Since(t0)
		}
		per := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(per(agent), "ms")
		b.ReportMetric(per(scan), "ref-ms")
		b.ReportMetric(per(agent)/per(scan), "x-ref")
		b.ReportMetric(per(pass), "pass-ms")
		b.ReportMetric(per(each), "each-ms")
		m, err = New(opts)
		if err != nil {
			b.Fatal(err)
		}
		m.Reconcile(ctx)
		for i := range n {
			vol := fmt.Sprintf("bench-%02d", i)
			m.Unstage(ctx, vol, kubeletpath.BlockStaging(kubelet, vol))
		}
		m.Close()
	})
}

func metricValue(m *Manager, name, result string) float64 {
	mfs, _ := m.Metrics().Registry().Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mm := range mf.GetMetric() {
			if hasLabel(mm, "result", result) {
				return mm.GetCounter().GetValue()
			}
		}
	}
	return 0
}
