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
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestStackOnThisHost runs the three real binaries together: vco-agent
// (its identity from a fixture sysfs tree), `vco-csi sim` with the host
// backend, and `vco-csi --mode=all` talking to both. The node id comes from
// the agent, the controller finds that node's VM by reference_id, and
// publishing makes a real loop device on this machine.
func TestStackOnThisHost(t *testing.T) {
	if testing.Short() {
		t.Skip("builds binaries")
	}
	if os.Geteuid() != 0 {
		t.Skip("the host backend makes loop devices, which needs root")
	}
	const uuid = "8F2D6A1E-9B3C-4D5E-A6F7-0123456789AB"
	dir := t.TempDir()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = "/usr/local/go/bin/go"
	}
	for _, c := range []string{"vco-csi", "vco-agent"} {
		if out, err := exec.Command(goTool, "build", "-o", filepath.Join(dir, c), "../"+c).CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", c, err, out)
		}
	}
	start := func(bin string, args ...string) {
		cmd := exec.Command(filepath.Join(dir, bin), args...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}

	sysfs := filepath.Join(dir, "sysfs")
	os.MkdirAll(filepath.Join(sysfs, "class/dmi/id"), 0o755)
	os.MkdirAll(filepath.Join(sysfs, "class/block"), 0o755)
	os.WriteFile(filepath.Join(sysfs, "class/dmi/id/product_uuid"), []byte(uuid+"\n"), 0o444)
	cfg := filepath.Join(dir, "agent.yaml")
	os.WriteFile(cfg, nil, 0o644)
	agentSock := filepath.Join(dir, "agent.sock")
	start("vco-agent", "serve", "--config", cfg, "--socket", agentSock, "--sysfs-root", sysfs, "--dbus=false",
		"--location", "ch-gen-1", "--state-dir", filepath.Join(dir, "agent-state"))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	simDir := filepath.Join(dir, "sim")
	start("vco-csi", "sim", "--listen", addr, "--dir", simDir, "--backend", "host", "--customer", "acme",
		"--host-vm-uuid", uuid, "--host-vm-location", "ch-gen-1")
	waitFor(t, func() bool {
		r, err := http.Get("http://" + addr + "/admin/faults")
		if err == nil {
			r.Body.Close()
		}
		return err == nil
	})
	waitFor(t, func() bool { _, err := os.Stat(agentSock); return err == nil })

	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte("h.p.s"), 0o600)
	kubelet := filepath.Join(dir, "kubelet")
	os.MkdirAll(kubelet, 0o750)
	sock := filepath.Join(dir, "csi.sock")
	start("vco-csi", "--mode=all", "--endpoint", "unix://"+sock, "--api-url", "http://"+addr+"/api/1", "--customer", "acme",
		"--token-file", tok, "--agent-socket", agentSock, "--kubelet-root", kubelet, "--attach-timeout", "20s", "--driver-name", "cloud.whitesky.csi")
	waitFor(t, func() bool { _, err := os.Stat(sock); return err == nil })

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ident, ctrl, node := csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)

	if info, err := ident.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil || info.Name != "cloud.whitesky.csi" {
		t.Fatalf("plugin info: %v %v", info, err)
	}
	if p, err := ident.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("probe: %v %v", p, err)
	}
	ni, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if ni.NodeId != strings.ToLower(uuid) || ni.AccessibleTopology.Segments["cloud.whitesky/location"] != "ch-gen-1" {
		t.Fatalf("node info = %v", ni)
	}
	capab := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	v, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "stack", VolumeCapabilities: []*csi.VolumeCapability{capab},
		CapacityRange:             &csi.CapacityRange{RequiredBytes: 1 << 30},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{ni.AccessibleTopology}}})
	if err != nil {
		t.Fatal(err)
	}
	volID := v.Volume.VolumeId
	pub, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: ni.NodeId, VolumeCapability: capab})
	if err != nil {
		t.Fatal(err)
	}
	diskID, _ := strconv.Atoi(pub.PublishContext["cloud.whitesky/disk-id"])
	backing := filepath.Join(simDir, "disks", "disk-"+strconv.Itoa(diskID)+".img")
	loop := loopFor(backing)
	if loop == "" {
		t.Fatalf("no loop device backs %s after publish", backing)
	}
	t.Cleanup(func() { exec.Command("losetup", "-d", "/dev/"+loop).Run() })
	if b, _ := os.ReadFile("/sys/block/" + loop + "/size"); strings.TrimSpace(string(b)) != "2097152" {
		t.Fatalf("%s has %s sectors, want 1 GiB", loop, b)
	}
	// The node service hands staging to the agent, which has no volume
	// methods yet and says so.
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: volID, PublishContext: pub.PublishContext,
		StagingTargetPath: filepath.Join(kubelet, "plugins", "staging"), VolumeCapability: capab})
	if status.Code(err) != codes.Unimplemented || !strings.Contains(err.Error(), agentSock) {
		t.Fatalf("stage: %v", err)
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: ni.NodeId}); err != nil {
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
