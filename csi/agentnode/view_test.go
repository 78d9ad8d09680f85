package agentnode_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// noFencing fails the test if the agent gets as far as choosing a disk's
// fencing: every request here is to be refused for its path first.
type noFencing struct{ t *testing.T }

func (f noFencing) Choose(_ context.Context, dev *volume.Device, vol string, _ func(*fence.LostError) bool) (volume.Choice, error) {
	f.t.Errorf("the agent went on to fence %s for volume %s", dev.Path, vol)
	return volume.Choice{}, context.Canceled
}

// TestAgentRefusesSymlinkThePluginCannotSee: the node plugin checks a
// path by its text only, having no view of the kubelet's directory
// (docs/security.md, "The node container"). A symlink planted along a
// staging or target path, pointing out of the kubelet root, is refused by
// the real agent, which resolves the path on the host, with
// INVALID_ARGUMENT, and nothing is made where it points.
func TestAgentRefusesSymlinkThePluginCannotSee(t *testing.T) {
	dir := t.TempDir()
	kubelet := filepath.Join(dir, "kubelet")
	outside := filepath.Join(dir, "outside")
	for _, d := range []string{filepath.Join(kubelet, "pods"), filepath.Join(kubelet, "plugins", "kubernetes.io", "csi"), outside} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	// pods/<uid> and the driver's staging directory lead out of the root.
	if err := os.Symlink(outside, filepath.Join(kubelet, "pods", "5f0e")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(kubelet, "plugins", "kubernetes.io", "csi", "cloud.whitesky.csi")); err != nil {
		t.Fatal(err)
	}
	m, err := volume.New(volume.Options{
		Config:   config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Hour, AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Fencers: noFencing{t},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	a := agentnodetest.ServeAgent(t, filepath.Join(dir, "agent.sock"), m, server.NodeIdentity{SystemUUID: nodeA, Location: "ch-gen-1"}, nil,
		agentnode.Options{})
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: a, KubeletRoot: kubelet})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	staging := filepath.Join(kubelet, "plugins", "kubernetes.io", "csi", "cloud.whitesky.csi", "0a1b", "globalmount")
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-gen-1/7", StagingTargetPath: staging,
		VolumeCapability: mountCap, PublishContext: map[string]string{driver.PubSerial: "7"}})
	if c := driver.CodeForError(err); c != codes.InvalidArgument {
		t.Errorf("stage through a symlink out of the kubelet root: %v (%s), want INVALID_ARGUMENT", err, c)
	}
	goodStaging := filepath.Join(kubelet, "plugins", "kubernetes.io", "csi", "pv", "pv-1", "globalmount")
	target := filepath.Join(kubelet, "pods", "5f0e", "volumes", "kubernetes.io~csi", "pv-1", "mount")
	_, err = d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "ch-gen-1/7", StagingTargetPath: goodStaging,
		TargetPath: target, VolumeCapability: mountCap})
	if c := driver.CodeForError(err); c != codes.InvalidArgument {
		t.Errorf("publish through a symlink out of the kubelet root: %v (%s), want INVALID_ARGUMENT", err, c)
	}
	if left, _ := os.ReadDir(outside); len(left) > 0 {
		t.Errorf("the agent made %v where the symlinks point", left)
	}
}
