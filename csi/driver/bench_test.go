package driver_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"k8s.io/klog/v2"
)

// BenchmarkCreatePublish100 runs 100 concurrent CreateVolume +
// ControllerPublishVolume calls against the simulator, each volume to one
// of ten VMs, and compares them with the reference: the bare API calls
// (create disk, attach, list the VM's disks) made concurrently by the same
// client. The simulator takes 30 ms per request, a portal's round trip, so
// that round trips make most of each batch and the ratio is that of the
// steps one after the other: the driver's six (the name check, create; the
// disk, VM and notes read side by side, the holders note, attach, list)
// against the reference's three.
//
// BenchmarkCreatePublish100FastAPI is the same at 2 ms per request. There
// the machine's CPU (the simulator, JSON and HTTP on both sides, gRPC on
// the driver's) makes most of each batch, not the round trips, and the
// ratio moves with the number of cores (docs/benchmarks.md).
//
// One batch of each side runs untimed first: the driver's first publish
// after a start lists the locations and the VMs, which it then keeps.
// The reference's disks are removed before the driver's batch, so each
// starts from the same state (the simulator rewrites its whole state file
// on every change, which costs more the more disks there are).
//
// Reported: ms per batch for the reference and the driver, their ratio,
// and API requests per volume. Each batch checks that no name produced
// two disks and every disk is attached exactly once.
func BenchmarkCreatePublish100(b *testing.B) { benchCreatePublish(b, 30*time.Millisecond) }

func BenchmarkCreatePublish100FastAPI(b *testing.B) { benchCreatePublish(b, 2*time.Millisecond) }

// createPublish is the benchmark's world: ten VMs and the simulator's
// latency per request.
type createPublish struct {
	e       *testEnv
	vms     []cloud.VM
	latency time.Duration
}

const createPublishN, createPublishVMs = 100, 10

func benchCreatePublish(b *testing.B, latency time.Duration) {
	w := createPublish{e: newTestEnv(b, envOpts{attach: time.Minute}), latency: latency}
	for i := range createPublishVMs {
		ref := fmt.Sprintf("be0c0000-0000-4000-8000-%012d", i)
		id, err := w.e.sim.AddVM("cs-"+hostLoc, fmt.Sprintf("bench-%d", i), ref, false)
		if err != nil {
			b.Fatal(err)
		}
		w.vms = append(w.vms, cloud.VM{ID: id, ReferenceID: ref})
	}
	w.e.sim.SetFaults(sim.Faults{Latency: sim.Duration(latency)})
	w.reference(b, -1)
	w.driver(b, -1)
	var refTotal, drvTotal time.Duration
	var drvCalls int
	b.ResetTimer()
	for iter := 0; iter < b.N; iter++ {
		refTotal += w.reference(b, iter)
		took, calls := w.driver(b, iter)
		drvTotal += took
		drvCalls += calls
	}
	batches := float64(b.N)
	ref := float64(refTotal.Milliseconds()) / batches
	drv := float64(drvTotal.Milliseconds()) / batches
	b.ReportMetric(ref, "ref-ms/batch")
	b.ReportMetric(drv, "drv-ms/batch")
	b.ReportMetric(drv/ref, "drv/ref")
	b.ReportMetric(float64(drvCalls)/batches/createPublishN, "api-req/vol")
}

// reference runs one batch of the bare API calls, the API's own cost for
// the same work, and removes its disks untimed.
func (w createPublish) reference(b *testing.B, iter int) time.Duration {
	ctx := context.Background()
	start := time.Now()
	runN(b, createPublishN, func(i int) error {
		id, err := w.e.api.CreateDisk(ctx, hostLoc, cloud.DiskSpec{Name: fmt.Sprintf("ref-%d-%d", iter, i), Description: "ref", SizeGiB: 1})
		if err != nil {
			return err
		}
		vm := w.vms[i%createPublishVMs]
		if err := w.e.api.AttachDisk(ctx, "cs-"+hostLoc, vm.ID, id); err != nil {
			return err
		}
		_, err = w.e.api.ListVMDisks(ctx, "cs-"+hostLoc, vm.ID)
		return err
	})
	took := time.Since(start)
	b.StopTimer()
	cleanup(b, w.e, w.latency)
	b.StartTimer()
	return took
}

// driver runs one batch through the controller, checks it and removes
// its disks untimed; it returns the time and the API requests it took.
func (w createPublish) driver(b *testing.B, iter int) (time.Duration, int) {
	ctx := context.Background()
	before := sum(w.e.sim.Calls())
	start := time.Now()
	ids := make([]string, createPublishN)
	runN(b, createPublishN, func(i int) error {
		v, err := w.e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("drv-%d-%d", iter, i), VolumeCapabilities: rwo})
		if err != nil {
			return err
		}
		ids[i] = v.Volume.VolumeId
		_, err = w.e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: v.Volume.VolumeId, NodeId: w.vms[i%createPublishVMs].ReferenceID, VolumeCapability: rwo[0]})
		return err
	})
	took := time.Since(start)
	calls := sum(w.e.sim.Calls()) - before
	b.StopTimer()
	checkNoDuplicates(b, w.e, iter, ids)
	cleanup(b, w.e, w.latency)
	b.StartTimer()
	return took, calls
}

func runN(b *testing.B, n int, f func(i int) error) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(i); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}

func sum(m map[string]int) int {
	t := 0
	for _, v := range m {
		t += v
	}
	return t
}

func checkNoDuplicates(b *testing.B, e *testEnv, iter int, ids []string) {
	st := e.sim.Snapshot()
	byName := map[string]int{}
	for _, d := range st.Disks {
		byName[d.Name]++
		if len(d.Attachments) > 1 {
			b.Fatalf("disk %d attached %d times", d.ID, len(d.Attachments))
		}
	}
	seen := map[string]bool{}
	for i, id := range ids {
		name := fmt.Sprintf("drv-%d-%d", iter, i)
		if byName[name] != 1 || seen[id] {
			b.Fatalf("volume %s (%s): %d disks of that name", name, id, byName[name])
		}
		seen[id] = true
	}
}

// cleanup detaches and deletes every disk so the next batch finds free
// PCI slots; it leaves the simulator at latency.
func cleanup(b *testing.B, e *testEnv, latency time.Duration) {
	ctx := context.Background()
	e.sim.SetFaults(sim.Faults{})
	defer e.sim.SetFaults(sim.Faults{Latency: sim.Duration(latency)})
	st := e.sim.Snapshot()
	for _, d := range st.Disks {
		for _, a := range d.Attachments {
			for _, vm := range st.VMs {
				if vm.ID == a.VMID {
					if err := e.api.DetachDisk(ctx, vm.Cloudspace, vm.ID, d.ID); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
		if err := e.api.DeleteDisk(ctx, d.Location, d.ID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkNodeStageUnstage measures a node stage + unstage cycle of an
// ext4 volume on a real loop device, through the plugin's gRPC socket and
// the agent's (find the loop device, claim it, check the filesystem,
// mount; unmount, release), against the reference: `mount` + `umount` of
// the same loop device on the same directory. The filesystem is made once
// before timing, so neither side pays for mkfs.
//
// Reported: ms per cycle for the reference and the plugin, their ratio,
// and the stage's share of the plugin's cycle. Each b.N iteration runs 10
// cycles of each.
func BenchmarkNodeStageUnstage(b *testing.B) {
	b.Run("vs=mount-umount-cmd", benchNodeStageUnstage)
}

func benchNodeStageUnstage(b *testing.B) {
	hosttest.NeedRoot(b, "loop devices and mounts need root")
	const cycles = 10
	// mount-utils logs each mkfs and mount through klog on stderr, which
	// go test interleaves with the benchmark's result line.
	klog.LogToStderr(false)
	klog.SetOutput(io.Discard)
	b.Cleanup(func() { klog.LogToStderr(true) })
	e := newTestEnv(b, envOpts{backend: &sim.HostBackend{Dir: filepath.Join(b.TempDir(), "disks")}, realAgent: true})
	ctx := context.Background()
	v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bench-stage", VolumeCapabilities: rwo})
	if err != nil {
		b.Fatal(err)
	}
	id := v.Volume.VolumeId
	pub, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: rwo[0]})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: hostUUID})
		e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	})
	staging := kubeletpath.Staging(e.kubelet, "try.whitesky.cloud", id)
	stage := &csi.NodeStageVolumeRequest{VolumeId: id, PublishContext: pub.PublishContext, StagingTargetPath: staging,
		VolumeCapability: rwo[0], VolumeContext: v.Volume.VolumeContext}
	unstage := &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}
	var stageTotal time.Duration
	cycle := func() {
		start := time.Now()
		if _, err := e.node.NodeStageVolume(ctx, stage); err != nil {
			b.Fatal(err)
		}
		stageTotal += time.Since(start)
		if _, err := e.node.NodeUnstageVolume(ctx, unstage); err != nil {
			b.Fatal(err)
		}
	}
	cycle() // makes the filesystem
	out, err := exec.Command("losetup", "-j", e.backend.DiskFile(diskNumber(b, pub.PublishContext)), "-O", "NAME", "-n").Output()
	dev := strings.TrimSpace(string(out))
	if err != nil || dev == "" {
		b.Fatalf("no loop device for volume %s: %v", id, err)
	}
	refDir := filepath.Join(e.kubelet, "plugins", "reference")
	if err := os.MkdirAll(refDir, 0o750); err != nil {
		b.Fatal(err)
	}
	run := func(name string, args ...string) {
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			b.Fatalf("%s %v: %v: %s", name, args, err, out)
		}
	}
	var refTotal, drvTotal time.Duration
	stageTotal = 0
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		for range cycles {
			run("mount", "-t", "ext4", dev, refDir)
			run("umount", refDir)
		}
		refTotal += time.Since(start)
		start = time.Now()
		for range cycles {
			cycle()
		}
		drvTotal += time.Since(start)
	}
	n := float64(b.N * cycles)
	ref := float64(refTotal.Microseconds()) / 1000 / n
	drv := float64(drvTotal.Microseconds()) / 1000 / n
	b.ReportMetric(ref, "ref-ms/cycle")
	b.ReportMetric(drv, "drv-ms/cycle")
	b.ReportMetric(drv/ref, "drv/ref")
	b.ReportMetric(float64(stageTotal.Microseconds())/1000/n, "stage-ms")
}

func diskNumber(b *testing.B, pc map[string]string) int64 {
	n, err := strconv.ParseInt(pc[driver.PubDiskID], 10, 64)
	if err != nil {
		b.Fatalf("publish context %v: %v", pc, err)
	}
	return n
}
