package main

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	regv1 "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

// stack is the three real binaries running together on this host:
// vco-agent (its identity from a fixture sysfs tree whose block/ is the
// host's, volumes allowed on unfenced loop devices), the simulator
// (`vco-lab sim`) with the host backend, and `vco-csi --mode=all` talking
// to both.
type stack struct {
	kubelet, simDir, agentSock, csiSock string
	// The plugin's registration directory (the kubelet's plugins_registry)
	// and its health endpoint.
	registry, health string
}

// stackUUID is the SMBIOS UUID the fixture gives this machine.
const stackUUID = "8F2D6A1E-9B3C-4D5E-A6F7-0123456789AB"

// startStack runs the binaries from $VCO_BIN (make's bin/) or, without
// it, builds them. Everything it starts is stopped when the test ends, and
// whatever the test left mounted is unmounted.
func startStack(t *testing.T, lease bool) *stack {
	t.Helper()
	hosttest.NeedRoot(t, "the host backend makes loop devices and the agent mounts them, which needs root")
	dir := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	bins := os.Getenv("VCO_BIN")
	if bins == "" {
		if testing.Short() {
			t.Skip("builds binaries")
		}
		bins = dir
		goTool, err := exec.LookPath("go")
		if err != nil {
			goTool = "/usr/local/go/bin/go"
		}
		for _, c := range []string{"vco-csi", "vco-agent", "vco-lab"} {
			if out, err := exec.Command(goTool, "build", "-o", filepath.Join(dir, c), "../"+c).CombinedOutput(); err != nil {
				t.Fatalf("build %s: %v\n%s", c, err, out)
			}
		}
	}
	start := func(bin string, args ...string) {
		cmd := exec.Command(filepath.Join(bins, bin), args...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		// Stopped with the test even when the test binary dies first.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Errorf("%s did not stop within 10s of SIGTERM; killed", bin)
				cmd.Process.Kill()
				<-done
			}
		})
	}
	s := &stack{kubelet: filepath.Join(dir, "kubelet"), simDir: filepath.Join(dir, "sim"),
		agentSock: filepath.Join(dir, "agent.sock"), csiSock: filepath.Join(dir, "csi.sock"),
		registry: filepath.Join(dir, "plugins_registry"), health: freeAddr(t)}
	os.MkdirAll(s.kubelet, 0o750)
	os.MkdirAll(s.registry, 0o750)

	sysfs := filepath.Join(dir, "sysfs")
	os.MkdirAll(filepath.Join(sysfs, "class/dmi/id"), 0o755)
	os.MkdirAll(filepath.Join(sysfs, "class/block"), 0o755)
	os.WriteFile(filepath.Join(sysfs, "class/dmi/id/product_uuid"), []byte(stackUUID+"\n"), 0o444)
	// The agent finds loop devices under <sysfs>/block.
	if err := os.Symlink("/sys/block", filepath.Join(sysfs, "block")); err != nil {
		t.Fatal(err)
	}
	// Loop devices have no SCSI-3 PR. With lease, the agent fences them
	// with its on-disk lease (volumes.lease_loop_devices), with timings
	// short enough for a test yet with room for a loaded machine; without,
	// it stages them unfenced by both opt-ins: its volumes.allow_unfenced
	// and the plugin's --allow-unfenced. The agent watches no udev events
	// and marks claimed disks under the test's directory: other tests'
	// disks on this machine are none of its business. No host watchdog is
	// armed (watchdog_device: none-unsafe): this host's would reset the
	// machine the tests run on.
	cfg := filepath.Join(dir, "agent.yaml")
	os.WriteFile(cfg, []byte("volumes:\n  kubelet_root: "+s.kubelet+"\n  allow_unfenced: true\n  allow_loop_devices: true\n"+
		"  watch_disks: false\n  claimed_dir: "+filepath.Join(dir, "claimed")+"\n"+
		"  lease_loop_devices: "+strconv.FormatBool(lease)+"\n"+
		"  lease:\n    io_timeout: 1s\n    renew: 2s\n    fail: 10s\n    watchdog: 0s\n    watchdog_device: none-unsafe\n"), 0o644)
	start("vco-agent", "serve", "--config", cfg, "--socket", s.agentSock, "--sysfs-root", sysfs, "--dbus=false",
		"--location", "ch-gen-1", "--state-dir", filepath.Join(dir, "agent-state"))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	start("vco-lab", "sim", "--listen", addr, "--dir", s.simDir, "--backend", "host", "--customer", "acme",
		"--host-vm-uuid", stackUUID, "--host-vm-location", "ch-gen-1")
	waitFor(t, func() bool {
		r, err := http.Get("http://" + addr + "/admin/faults")
		if err == nil {
			r.Body.Close()
		}
		return err == nil
	})
	waitFor(t, func() bool { _, err := os.Stat(s.agentSock); return err == nil })

	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte("h.p.s"), 0o600)
	start("vco-csi", "--mode=all", "--endpoint", "unix://"+s.csiSock, "--api-url", "http://"+addr+"/api/1", "--customer", "acme",
		"--token-file", tok, "--agent-socket", s.agentSock, "--kubelet-root", s.kubelet, "--attach-timeout", "20s", "--default-location", "ch-gen-1",
		"--driver-name", "cloud.whitesky.csi", "--allow-unfenced", "--sim-disk-dir", filepath.Join(s.simDir, "disks"),
		"--registration-dir", s.registry, "--http-endpoint", s.health)
	waitFor(t, func() bool { _, err := os.Stat(s.csiSock); return err == nil })
	return s
}

// TestStackOnThisHost drives a volume's whole life through the binaries,
// the loop device fenced by the agent's lease:
// the node id comes from the agent, the controller finds that node's VM by
// reference_id, publishing makes a real loop device, and the agent
// formats, mounts and binds it into the pod's path.
func TestStackOnThisHost(t *testing.T) {
	s := startStack(t, true)
	conn, err := grpc.NewClient("unix://"+s.csiSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ident, ctrl, node := csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)

	checkPluginReadyAndRegistered(ctx, t, s, ident)
	ni, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if ni.NodeId != strings.ToLower(stackUUID) || ni.AccessibleTopology.Segments["cloud.whitesky/location"] != "ch-gen-1" {
		t.Fatalf("node info = %v", ni)
	}
	capab := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	v, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "stack", VolumeCapabilities: []*csi.VolumeCapability{capab},
		CapacityRange:             &csi.CapacityRange{RequiredBytes: 1 << 30},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{ni.AccessibleTopology}}})
	if err != nil {
		t.Fatal(err)
	}
	volID := v.Volume.VolumeId
	pub, backing := publishMakesALoopDevice(ctx, t, s, ctrl, volID, ni.NodeId, capab)
	staging := kubeletpath.Staging(s.kubelet, "cloud.whitesky.csi", volID)
	target := kubeletpath.Target(s.kubelet, "p", "pv-stack")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: volID, PublishContext: pub.PublishContext,
		StagingTargetPath: staging, VolumeCapability: capab, VolumeContext: v.Volume.VolumeContext}); err != nil {
		t.Fatalf("stage: %v", err)
	}
	if fs := mountFSType(staging); fs != "xfs" {
		t.Fatalf("the staging path has filesystem %q mounted, want xfs", fs)
	}
	checkHeldUnderTheDiskLease(ctx, t, s, volID)
	publishWriteAndStat(ctx, t, node, volID, staging, target, capab)
	unpublishUnstageAndDelete(ctx, t, ctrl, node, volID, ni.NodeId, staging, target, backing)

	// Without a transit engine configured, an encrypted volume is refused,
	// saying why.
	ev, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "stack-enc", VolumeCapabilities: []*csi.VolumeCapability{capab},
		Parameters: map[string]string{"encryption": "true"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{ni.AccessibleTopology}}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: ev.Volume.VolumeId, PublishContext: pub.PublishContext,
		StagingTargetPath: staging, VolumeCapability: capab, VolumeContext: ev.Volume.VolumeContext})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "no key backend") {
		t.Fatalf("stage of an encrypted volume: %v", err)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: ev.Volume.VolumeId}); err != nil {
		t.Fatal(err)
	}
}

// checkPluginReadyAndRegistered: the plugin names itself, is ready, and
// registers itself as the kubelet expects: its socket in plugins_registry
// names the driver and the CSI socket's path on the host, derived from
// --kubelet-root. Its health endpoint answers OK.
func checkPluginReadyAndRegistered(ctx context.Context, t *testing.T, s *stack, ident csi.IdentityClient) {
	t.Helper()
	if info, err := ident.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil || info.Name != "cloud.whitesky.csi" {
		t.Fatalf("plugin info: %v %v", info, err)
	}
	if p, err := ident.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("probe: %v %v", p, err)
	}
	regConn, err := grpc.NewClient("unix://"+filepath.Join(s.registry, "cloud.whitesky.csi-reg.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer regConn.Close()
	reg, err := regv1.NewRegistrationClient(regConn).GetInfo(ctx, &regv1.InfoRequest{})
	if err != nil {
		t.Fatalf("registration GetInfo: %v", err)
	}
	if reg.Type != regv1.CSIPlugin || reg.Name != "cloud.whitesky.csi" || reg.Endpoint != filepath.Join(s.kubelet, "plugins", "cloud.whitesky.csi", "csi.sock") {
		t.Errorf("registration info %v; want the CSI plugin cloud.whitesky.csi at <kubelet-root>/plugins/cloud.whitesky.csi/csi.sock", reg)
	}
	if r, err := http.Get("http://" + s.health + "/healthz"); err != nil || r.StatusCode != http.StatusOK {
		t.Errorf("/healthz of the running stack: %v %v", r, err)
	} else {
		r.Body.Close()
	}
}

// publishMakesALoopDevice publishes volID to the node: a loop device of
// 2 GB (1 GiB asked, the create call's unit) backs the disk's file. It
// returns the publish answer and the file.
func publishMakesALoopDevice(ctx context.Context, t *testing.T, s *stack, ctrl csi.ControllerClient, volID, nodeID string,
	capab *csi.VolumeCapability) (*csi.ControllerPublishVolumeResponse, string) {
	t.Helper()
	pub, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: nodeID, VolumeCapability: capab})
	if err != nil {
		t.Fatal(err)
	}
	diskID, _ := strconv.Atoi(pub.PublishContext["cloud.whitesky/disk-id"])
	backing := filepath.Join(s.simDir, "disks", "disk-"+strconv.Itoa(diskID)+".img")
	loop := loopFor(backing)
	if loop == "" {
		t.Fatalf("no loop device backs %s after publish", backing)
	}
	t.Cleanup(func() { exec.Command("losetup", "-d", "/dev/"+loop).Run() })
	// Asked 1 GiB, the disk is created as 2 GB, the create call's unit.
	if b, _ := os.ReadFile("/sys/block/" + loop + "/size"); strings.TrimSpace(string(b)) != "3906250" {
		t.Fatalf("%s has %s sectors, want 2 GB", loop, b)
	}
	return pub, backing
}

// checkHeldUnderTheDiskLease: the agent lists volID as held under its
// disk lease.
func checkHeldUnderTheDiskLease(ctx context.Context, t *testing.T, s *stack, volID string) {
	t.Helper()
	ac, err := client.Dial(s.agentSock)
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	disks, err := ac.ListDisks(ctx, &api.ListDisksRequest{})
	if err != nil {
		t.Fatal(err)
	}
	fenced := false
	for _, d := range disks.GetDisks() {
		if d.GetVolumeId() == volID {
			fenced = d.GetFencing() == api.FencingMethod_FENCING_METHOD_DISK_LEASE && d.GetState() == api.ClaimState_CLAIM_STATE_HELD
		}
	}
	if !fenced {
		t.Fatalf("volume %s is not held under the agent's disk lease: %v", volID, disks)
	}
}

// publishWriteAndStat publishes the staged volume at target: a file
// written in the pod's path is on the staged volume, and the stats are of
// a disk of at most 2 GB.
func publishWriteAndStat(ctx context.Context, t *testing.T, node csi.NodeClient, volID, staging, target string, capab *csi.VolumeCapability) {
	t.Helper()
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: volID, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: capab}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if err := os.WriteFile(filepath.Join(target, "hello"), []byte("world"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "hello")); err != nil || string(b) != "world" {
		t.Fatalf("a file written in the pod's path is not on the staged volume: %q %v", b, err)
	}
	st, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: volID, VolumePath: target})
	if err != nil || len(st.Usage) != 2 || st.Usage[0].Total <= 0 || st.Usage[0].Total > 2_000_000_000 {
		t.Fatalf("stats: %v %v", st, err)
	}
}

// unpublishUnstageAndDelete unpublishes and unstages volID, unpublishes it
// from the node (its loop device goes) and deletes it (its file goes).
func unpublishUnstageAndDelete(ctx context.Context, t *testing.T, ctrl csi.ControllerClient, node csi.NodeClient,
	volID, nodeID, staging, target, backing string) {
	t.Helper()
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: nodeID}); err != nil {
		t.Fatal(err)
	}
	if l := loopFor(backing); l != "" {
		t.Fatalf("loop device %s still backs %s after unpublish", l, backing)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(backing); !os.IsNotExist(err) {
		t.Fatalf("disk file after delete: %v", err)
	}
}

// mountFSType is the filesystem type mounted at p, or "".
func mountFSType(p string) string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 10 || f[4] != p {
			continue
		}
		for i, x := range f {
			if x == "-" && i+1 < len(f) {
				return f[i+1]
			}
		}
	}
	return ""
}

// loopFor names the loop device backed by file, or "".
func loopFor(file string) string {
	devs, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, p := range devs {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == file {
			return filepath.Base(filepath.Dir(filepath.Dir(p)))
		}
	}
	return ""
}
