package agentnode_test

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

const (
	nodeA = "4c4c4544-0042-3510-8052-b4c04f4a4d32"
	nodeB = "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab"
)

var (
	keyA, _ = fence.KeyFromUUID(nodeA)
	keyB, _ = fence.KeyFromUUID(nodeB)
	names   = fence.Directory{keyA: "node-a", keyB: "node-b"}
)

var blockCap = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}

var mountCap = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}

// TestNodeServiceOverRealAgent serves the agent's own gRPC service, here
// without a volume manager, on a unix socket and drives the CSI node
// service through it.
func TestNodeServiceOverRealAgent(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := server.New(server.Options{Version: "test", Policy: peercred.Policy{GID: -1},
		Identity: server.NodeIdentity{SystemUUID: "4C4C4544-0042-3510-8052-B4C04F4A4D32", Location: "ch-gen-1"}}).NewGRPC()
	go srv.Serve(ln)
	defer srv.Stop()

	a, err := agentnode.Dial(sock, agentnode.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	kubelet := filepath.Join(dir, "kubelet")
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: a, KubeletRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	info, err := d.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.NodeId != nodeA || info.AccessibleTopology.Segments[driver.TopologyKey] != "ch-gen-1" ||
		info.MaxVolumesPerNode <= 0 {
		t.Fatalf("node info = %v", info)
	}
	if p, err := d.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("probe with the agent up: %v %v", p, err)
	}
	// A publish context that names no device is refused before the agent.
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-gen-1/5", StagingTargetPath: filepath.Join(kubelet, "s"),
		VolumeCapability: blockCap})
	if driver.CodeForError(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "names no device") {
		t.Fatalf("stage without a device: %v", err)
	}
	// An agent without volume support says so, and the error names it.
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-gen-1/5", StagingTargetPath: filepath.Join(kubelet, "s"),
		VolumeCapability: blockCap, PublishContext: map[string]string{driver.PubPCIBus: "0", driver.PubPCISlot: "7", driver.PubSerial: "5"}})
	if driver.CodeForError(err) != codes.Unavailable || !strings.Contains(err.Error(), sock) || !strings.Contains(err.Error(), "no volume methods") {
		t.Fatalf("stage: %v", err)
	}

	srv.Stop()
	_, err = d.Probe(ctx, &csi.ProbeRequest{})
	if err == nil {
		t.Fatal("probe succeeded with the agent gone")
	}
	if c := status.Code(driverStatus(err)); c != codes.Unavailable {
		t.Fatalf("probe with the agent gone: %v (%s), want UNAVAILABLE", err, c)
	}
}

func driverStatus(err error) error { return status.Error(driver.CodeForError(err), err.Error()) }

func TestDialNamesTheSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, err := agentnode.Dial(sock, agentnode.Options{})
	if err == nil || !strings.Contains(err.Error(), sock) {
		t.Fatalf("dial of a missing socket: %v", err)
	}
}

// modelFencing fences every disk with the real reservation engine, its
// SCSI commands answered by scsitest's model target: this host has no
// SCSI, so the model stands in for the disk's reservation logic while the
// loop device, mounts and every agent and plugin decision are real. The
// engine reports a lost claim when checked, so the loss callback is unused.
type modelFencing struct {
	tgt  *scsitest.Target
	node string
}

func (f *modelFencing) Choose(_ context.Context, dev *volume.Device, vol string, _ func(*fence.LostError) bool) (volume.Choice, error) {
	key, _ := fence.KeyFromUUID(f.node)
	e, err := pr.New(dev.Path, f.tgt.Initiator(f.node), pr.Config{Key: key, Node: f.node, Disk: vol, Resolver: names, Verify: dev.Verify})
	if err != nil {
		return volume.Choice{}, err
	}
	return volume.Choice{Fencer: e, Method: fence.MethodPR}, nil
}

// fencedNode is a node's CSI service, served over gRPC, in front of the
// agent's API and volume manager, which fences disks with the reservation
// engine on a model target. Its disk is the simulator host backend's disk
// 7, a 64 MiB loop device.
type fencedNode struct {
	node     csi.NodeClient
	m        *volume.Manager
	kubelet  string
	img, dev string
}

func newFencedNode(t *testing.T, tgt *scsitest.Target, reclaimWait time.Duration) *fencedNode {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	dir := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	kubelet := filepath.Join(dir, "kubelet")
	diskDir := filepath.Join(dir, "disks")
	os.MkdirAll(kubelet, 0o750)
	os.MkdirAll(diskDir, 0o700)
	img, dev := agentnodetest.LoopDisk(t, diskDir, 7)
	t.Cleanup(func() { clearRO(dev) })

	m, err := volume.New(volume.Options{
		Config: config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Hour, ReclaimWait: reclaimWait,
			AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Fencers: &modelFencing{tgt: tgt, node: nodeA},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	a := agentnodetest.ServeAgent(t, filepath.Join(dir, "agent.sock"), m,
		server.NodeIdentity{SystemUUID: nodeA, Location: "ch-gen-1"}, nil,
		agentnode.Options{LoopDiskDir: diskDir})
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: a, KubeletRoot: kubelet})
	if err != nil {
		t.Fatal(err)
	}
	csiSock := filepath.Join(dir, "csi.sock")
	cln, err := driver.Listen("unix://" + csiSock)
	if err != nil {
		t.Fatal(err)
	}
	csrv := d.NewGRPCServer(nil)
	go csrv.Serve(cln)
	t.Cleanup(csrv.Stop)
	conn, err := grpc.NewClient("unix://"+csiSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &fencedNode{node: csi.NewNodeClient(conn), m: m, kubelet: kubelet, img: img, dev: dev}
}

// TestFencingThroughTheNodeService drives the CSI node service over gRPC,
// through the agent's API, onto a loop device fenced by the reservation
// engine: a disk held by another node is refused with FAILED_PRECONDITION
// naming the holder; the controller's grant in the publish context takes
// it over; a later preempt by the other node shows as INACCESSIBLE health.
func TestFencingThroughTheNodeService(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: true})
	f := newFencedNode(t, tgt, 0)
	node, m, kubelet := f.node, f.m, f.kubelet
	ctx := context.Background()

	const vol = "ch-gen-1/7"
	// Node B's engine, as a fresh process on node B would start it.
	nodeBEngine := func() *pr.Engine {
		e, err := pr.New("/dev/sdb", tgt.Initiator(nodeB), pr.Config{Key: keyB, Node: nodeB, Disk: vol, Resolver: names})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	if _, err := nodeBEngine().Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	staging := kubeletpath.Staging(kubelet, "cloud.whitesky.csi", vol)
	stage := &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: staging, VolumeCapability: mountCap,
		PublishContext: map[string]string{driver.PubDiskID: "7"}}
	_, err := node.NodeStageVolume(ctx, stage)
	checkRefusedNamingNodeB(t, err, vol)

	grant, _ := json.Marshal(fence.Grant{Disk: vol, Node: nodeA, Supersedes: []fence.Key{keyB}})
	stage.PublishContext[driver.PubFenceGrant] = string(grant)
	if _, err := node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("stage with the controller's grant: %v", err)
	}
	if holder, key, _, ok := tgt.Reservation(); !ok || holder != nodeA || key != uint64(keyA) {
		t.Fatalf("reservation after the granted stage: %s %x %v", holder, key, ok)
	}
	target := kubeletpath.Target(kubelet, "p", "pv-7")
	publishWriteAndFindHealthy(ctx, t, node, vol, staging, target)

	// Node B takes the disk over with its own grant; the agent's check
	// finds the claim lost.
	if _, err := nodeBEngine().Acquire(ctx, &fence.Grant{Disk: vol, Node: nodeB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	m.CheckAll(ctx)
	checkFenceLostToNodeB(ctx, t, node, vol, target)
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
}

// checkRefusedNamingNodeB: the stage of a disk node B holds is refused
// with FAILED_PRECONDITION naming node B and the volume, as a message the
// CO shows without a nested "rpc error".
func checkRefusedNamingNodeB(t *testing.T, err error, vol string) {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "node-b") || !strings.Contains(st.Message(), vol) ||
		strings.Contains(st.Message(), "rpc error") {
		t.Fatalf("stage of a disk node B holds: %v", err)
	}
	t.Logf("refusal as the CO sees it: %s: %s", st.Code(), st.Message())
}

// publishWriteAndFindHealthy publishes the staged volume at target, writes
// through it, and finds its health without a fault.
func publishWriteAndFindHealthy(ctx context.Context, t *testing.T, node csi.NodeClient, vol, staging, target string) {
	t.Helper()
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: mountCap}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "data"), []byte("x"), 0o644); err != nil {
		t.Fatalf("writing through the published volume: %v", err)
	}
	h, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: vol, VolumePublishPath: target})
	if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) != 0 {
		t.Fatalf("health of a held volume: %v %v", h, err)
	}
}

// checkFenceLostToNodeB: the volume's health is INACCESSIBLE, FenceLost,
// naming node B's key.
func checkFenceLostToNodeB(ctx context.Context, t *testing.T, node csi.NodeClient, vol, target string) {
	t.Helper()
	h, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: vol, VolumePublishPath: target})
	if err != nil {
		t.Fatal(err)
	}
	hs := h.GetVolumeHealth().GetHealthStatuses()
	if len(hs) != 1 || hs[0].Status != csi.VolumeHealthErrorType_INACCESSIBLE || hs[0].Reason != "FenceLost" ||
		!strings.Contains(hs[0].Message, keyB.String()) {
		t.Fatalf("health after node B's takeover: %v", h)
	}
}

// TestNeverPublishedSkipsTheReclaimWait: the controller's never-published
// flag in the publish context reaches the agent's stage. The disk holds a
// filesystem and its target shows no registration since it started, as a
// volume restored from a snapshot does at its first stage. Without the
// flag the stage waits for a holder to re-establish (here until the
// caller's deadline); with it the disk is claimed at once.
func TestNeverPublishedSkipsTheReclaimWait(t *testing.T) {
	tgt := scsitest.New(scsitest.Options{NoPreemptAndAbort: true})
	f := newFencedNode(t, tgt, time.Hour)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", f.img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	const vol = "ch-gen-1/7"
	staging := kubeletpath.Staging(f.kubelet, "cloud.whitesky.csi", vol)
	stage := &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: staging, VolumeCapability: mountCap,
		PublishContext: map[string]string{driver.PubDiskID: "7"}}

	short, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	_, err := f.node.NodeStageVolume(short, stage)
	cancel()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("stage without the flag: %v, want it to wait past its deadline", err)
	}
	// A stage that waited would outlast this.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for reclaimWaits(t, f.m, "ended") != 1 {
		if ctx.Err() != nil {
			t.Fatal("the agent counted no reclaim wait for the stage without the flag")
		}
		time.Sleep(20 * time.Millisecond)
	}

	stage.PublishContext[driver.PubNeverPublished] = "true"
	start := time.Now()
	for {
		_, err = f.node.NodeStageVolume(ctx, stage)
		// The agent may still be unwinding the first stage.
		if status.Code(err) != codes.Aborted {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("stage with the flag: %v", err)
	}
	t.Logf("stage with the flag took %s", time.Since(start))
	if holder, key, _, ok := tgt.Reservation(); !ok || holder != nodeA || key != uint64(keyA) {
		t.Fatalf("reservation after the stage with the flag: %s %x %v", holder, key, ok)
	}
	if n := reclaimWaits(t, f.m, "claimed"); n != 0 {
		t.Fatalf("the stage with the flag counted %v reclaim waits", n)
	}
	if _, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
}

// reclaimWaits reads the agent's vco_agent_reclaim_waits_total{result}.
func reclaimWaits(t *testing.T, m *volume.Manager, result string) float64 {
	t.Helper()
	mfs, err := m.Metrics().Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "vco_agent_reclaim_waits_total" {
			continue
		}
		for _, c := range mf.GetMetric() {
			for _, l := range c.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					return c.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func clearRO(dev string) {
	if f, err := os.Open(dev); err == nil {
		unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0)
		f.Close()
	}
}
