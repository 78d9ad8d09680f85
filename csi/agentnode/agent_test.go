package agentnode_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// TestNodeServiceOverRealAgent serves the agent's own gRPC service on a
// unix socket and drives the CSI node service through it.
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

	a, err := agentnode.Dial(sock)
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
	if info.NodeId != "4c4c4544-0042-3510-8052-b4c04f4a4d32" || info.AccessibleTopology.Segments[driver.TopologyKey] != "ch-gen-1" ||
		info.MaxVolumesPerNode <= 0 {
		t.Fatalf("node info = %v", info)
	}
	if p, err := d.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("probe with the agent up: %v %v", p, err)
	}
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-gen-1/5", StagingTargetPath: filepath.Join(kubelet, "s"),
		VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}})
	if driver.CodeForError(err) != codes.Unimplemented || !strings.Contains(err.Error(), sock) {
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
	_, err := agentnode.Dial(sock)
	if err == nil || !strings.Contains(err.Error(), sock) {
		t.Fatalf("dial of a missing socket: %v", err)
	}
}
