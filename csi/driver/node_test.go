package driver_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

func TestNodeGetInfo(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	r, err := e.node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if r.NodeId != hostUUID || r.MaxVolumesPerNode != driver.DefaultMaxVolumesPerNode ||
		r.AccessibleTopology.Segments[driver.TopologyKey] != hostLoc {
		t.Fatalf("node info = %v", r)
	}
}

func TestNodePathsMustStayUnderKubeletRoot(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	outside := t.TempDir()
	// A symlink inside the kubelet root that points out of it.
	link := filepath.Join(e.kubelet, "pods", "evil")
	os.MkdirAll(filepath.Dir(link), 0o750)
	if err := os.Symlink(outside, link); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{
		filepath.Join(e.kubelet, "..", "elsewhere"),
		filepath.Join(link, "mount"),
		outside,
		"relative/path",
	} {
		raw := p
		if p == filepath.Join(e.kubelet, "..", "elsewhere") {
			raw = e.kubelet + "/../elsewhere" // keep the ".." that Join would clean away
		}
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-lug-1/1", StagingTargetPath: raw, VolumeCapability: rwo[0]})
		wantCode(t, err, codes.InvalidArgument)
		_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "ch-lug-1/1",
			StagingTargetPath: filepath.Join(e.kubelet, "plugins", "s"), TargetPath: raw, VolumeCapability: rwo[0]})
		wantCode(t, err, codes.InvalidArgument)
	}
	// A path under the root gets through to the agent (which, here, has no
	// volume methods yet and says so).
	_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-lug-1/1",
		StagingTargetPath: filepath.Join(e.kubelet, "plugins", "staging", "new"), VolumeCapability: rwo[0]})
	wantCode(t, err, codes.Unimplemented, "ch-lug-1/1")
}

// fencedAgent reports one volume as having lost its fence, as the agent
// does after a reservation preempt; the test checks how the driver passes
// that on, not how the agent detects it.
type fencedAgent struct{ identityAgent }

func (fencedAgent) Stats(_ context.Context, id, _ string) (driver.VolumeStats, error) {
	return driver.VolumeStats{TotalBytes: 1 << 30, Abnormal: id == "ch-lug-1/7",
		Message: "DiskFenced: reservation key 0x5643000000000001 preempted by node 11111111-2222-4333-8444-555555555555"}, nil
}

func TestNodeGetVolumeHealthReportsLostFence(t *testing.T) {
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode,
		Agent: fencedAgent{identityAgent{hostUUID, hostLoc}}, KubeletRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "ch-lug-1/7"})
	if err != nil {
		t.Fatal(err)
	}
	hs := r.GetVolumeHealth().GetHealthStatuses()
	if len(hs) != 1 || hs[0].Status != csi.VolumeHealthErrorType_INACCESSIBLE || hs[0].Reason != "FenceLost" ||
		!strings.Contains(hs[0].Message, "DiskFenced") {
		t.Fatalf("health = %v", r)
	}
	r, err = d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "ch-lug-1/8"})
	if err != nil || len(r.GetVolumeHealth().GetHealthStatuses()) != 0 || r.GetVolumeHealth().GetVolumeId() != "ch-lug-1/8" {
		t.Fatalf("healthy volume: %v %v", r, err)
	}
}
