package driver_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
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
	for _, p := range []string{
		e.kubelet + "/../elsewhere", // the ".." that Join would clean away
		e.kubelet + "/pods/../../elsewhere",
		e.kubelet,
		e.kubelet + "-other/pods/x",
		outside,
		"relative/path",
	} {
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-lug-1/1", StagingTargetPath: p, VolumeCapability: rwo[0]})
		wantCode(t, err, codes.InvalidArgument)
		_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "ch-lug-1/1",
			StagingTargetPath: filepath.Join(e.kubelet, "plugins", "s"), TargetPath: p, VolumeCapability: rwo[0]})
		wantCode(t, err, codes.InvalidArgument)
	}
	// A path under the root gets through to the agent (in this test one
	// that stands in for identity only, and says so). A symlink along a
	// path is the agent's to refuse: the plugin has no view of the
	// kubelet's directory (csi/agentnode's TestAgentRefusesSymlinkThePluginCannotSee).
	_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-lug-1/1",
		StagingTargetPath: filepath.Join(e.kubelet, "plugins", "staging", "new"), VolumeCapability: rwo[0]})
	wantCode(t, err, codes.Unimplemented, "ch-lug-1/1")
}

// pathAgent records the paths the node service hands the agent. It stands
// in for the agent because the test is about what the plugin does before
// the call: the real agent's own checks are csi/agentnode's tests.
type pathAgent struct {
	identityAgent
	paths []string
}

func (a *pathAgent) Stage(_ context.Context, r driver.StageRequest) error {
	a.paths = append(a.paths, "stage "+r.StagingPath)
	return nil
}

func (a *pathAgent) Publish(_ context.Context, r driver.PublishRequest) error {
	a.paths = append(a.paths, "publish "+r.StagingPath+" "+r.TargetPath)
	return nil
}

func (a *pathAgent) Unpublish(_ context.Context, _, p string) error {
	a.paths = append(a.paths, "unpublish "+p)
	return nil
}

func (a *pathAgent) Unstage(_ context.Context, _, p string) error {
	a.paths = append(a.paths, "unstage "+p)
	return nil
}

func (a *pathAgent) Stats(_ context.Context, _, p string) (driver.VolumeStats, error) {
	a.paths = append(a.paths, "stats "+p)
	return driver.VolumeStats{TotalBytes: 1 << 30}, nil
}

func (a *pathAgent) Expand(_ context.Context, _, p string, n int64) (int64, error) {
	a.paths = append(a.paths, "expand "+p)
	return n, nil
}

// The node plugin's container mounts nothing of the kubelet's directory
// but its own sockets' (docs/security.md, "The node container"): the
// kubelet root it is given does not exist in its view. Every node call
// still reaches the agent, with the kubelet's paths as the kubelet gave
// them, cleaned; the agent resolves them on the host.
func TestNodePluginNeedsNoViewOfTheKubeletDirectory(t *testing.T) {
	kubelet := filepath.Join(t.TempDir(), "var", "lib", "kubelet") // never made
	a := &pathAgent{identityAgent: identityAgent{hostUUID, hostLoc}}
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: a, KubeletRoot: kubelet})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	staging := kubelet + "/plugins/kubernetes.io/csi/cloud.whitesky.csi/0a1b/globalmount"
	target := kubelet + "/pods/5f0e/volumes/kubernetes.io~csi/pv-1/mount"
	pc := map[string]string{driver.PubSerial: "7"}
	calls := []func() error{
		func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "ch-lug-1/7", StagingTargetPath: staging + "/",
				VolumeCapability: rwo[0], PublishContext: pc})
			return err
		},
		func() error {
			_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "ch-lug-1/7", StagingTargetPath: staging,
				TargetPath: target, VolumeCapability: rwo[0], PublishContext: pc})
			return err
		},
		func() error {
			_, err := d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "ch-lug-1/7", VolumePath: target})
			return err
		},
		func() error {
			_, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "ch-lug-1/7", VolumePublishPath: target})
			return err
		},
		func() error {
			_, err := d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "ch-lug-1/7", VolumePath: target,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
			return err
		},
		func() error {
			_, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "ch-lug-1/7", TargetPath: target})
			return err
		},
		func() error {
			_, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "ch-lug-1/7", StagingTargetPath: staging})
			return err
		},
	}
	for i, call := range calls {
		if err := call(); err != nil {
			t.Fatalf("call %d with no kubelet directory in view: %v", i, err)
		}
	}
	want := []string{"stage " + staging, "publish " + staging + " " + target, "stats " + target, "stats " + target,
		"expand " + target, "unpublish " + target, "unstage " + staging}
	if !slices.Equal(a.paths, want) {
		t.Errorf("the agent was given\n  %s\nwant\n  %s", strings.Join(a.paths, "\n  "), strings.Join(want, "\n  "))
	}
}

// fencedAgent reports one volume as having lost its fence, as the agent
// does after a reservation preempt; the test checks how the driver passes
// that on, not how the agent detects it.
type fencedAgent struct{ identityAgent }

func (fencedAgent) Stats(_ context.Context, id, _ string) (driver.VolumeStats, error) {
	switch id {
	case "ch-lug-1/7":
		return driver.VolumeStats{TotalBytes: 1 << 30, Abnormal: true, Reason: driver.ReasonFenceLost,
			Message: "DiskFenced: reservation key 0x5643000000000001 preempted by node 11111111-2222-4333-8444-555555555555"}, nil
	case "ch-lug-1/9":
		return driver.VolumeStats{Abnormal: true, Message: "the disk is not attached to this node any more"}, nil
	}
	return driver.VolumeStats{TotalBytes: 1 << 30}, nil
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
	// Abnormal without a named cause: INACCESSIBLE, the agent's words kept.
	r, err = d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "ch-lug-1/9"})
	hs = r.GetVolumeHealth().GetHealthStatuses()
	if err != nil || len(hs) != 1 || hs[0].Status != csi.VolumeHealthErrorType_INACCESSIBLE || hs[0].Reason != driver.ReasonAbnormal ||
		!strings.Contains(hs[0].Message, "not attached") {
		t.Fatalf("health of a volume abnormal for no named reason: %v %v", r, err)
	}
	r, err = d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "ch-lug-1/8"})
	if err != nil || len(r.GetVolumeHealth().GetHealthStatuses()) != 0 || r.GetVolumeHealth().GetVolumeId() != "ch-lug-1/8" {
		t.Fatalf("healthy volume: %v %v", r, err)
	}
}

// mountOptions returns the per-mount options of the mount at p, or "".
func mountOptions(p string) string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	opts := ""
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 5 && f[4] == p {
			opts = f[5] // the last mount at p is the one seen
		}
	}
	return opts
}

// TestNodeBlockMountFlagsAndReadOnlyOverRealAgent stages and publishes
// through the real agent on the simulator's loop devices what csi-sanity's
// default mount volumes do not exercise: a raw block volume, mount flags,
// and a read-only publish.
func TestNodeBlockMountFlagsAndReadOnlyOverRealAgent(t *testing.T) {
	hosttest.NeedRoot(t, "loop devices and mounts need root")
	e := newTestEnv(t, envOpts{backend: &sim.HostBackend{Dir: filepath.Join(t.TempDir(), "disks")}, realAgent: true})
	ctx := context.Background()
	block := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	flagged := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4", MountFlags: []string{"noatime"}}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}

	prepare := func(name string, c *csi.VolumeCapability) (string, map[string]string) {
		v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{c}})
		if err != nil {
			t.Fatal(err)
		}
		id := v.Volume.VolumeId
		pub, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: c})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: hostUUID})
			e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		})
		return id, pub.PublishContext
	}

	// Raw block: the pod's target is the device itself.
	id, pc := prepare("raw", block)
	staging := kubeletpath.BlockStaging(e.kubelet, "pv-raw")
	target := kubeletpath.BlockTarget(e.kubelet, "pv-raw", "p")
	if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, PublishContext: pc, StagingTargetPath: staging, VolumeCapability: block}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: block}); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(target); err != nil || fi.Mode()&os.ModeDevice == 0 {
		t.Fatalf("block target %s: %v %v, want a device", target, fi, err)
	}
	st, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
	// A disk asked as 1 GiB is created as 2 GB (the create call's unit).
	if err != nil || len(st.Usage) != 1 || st.Usage[0].Total != 2_000_000_000 {
		t.Fatalf("block stats: %v %v", st, err)
	}
	if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}

	// A filesystem with a mount flag, published read-only to one pod.
	id, pc = prepare("flagged", flagged)
	flaggedReadOnly(ctx, t, e, id, pc, flagged)
}

// flaggedReadOnly stages volume id, published at pc, with capability
// flagged (mount flag noatime) and publishes it read-only: both mounts
// carry noatime, nosuid and nodev, the publication is read-only and the
// staging mount stays writable.
func flaggedReadOnly(ctx context.Context, t *testing.T, e *testEnv, id string, pc map[string]string, flagged *csi.VolumeCapability) {
	t.Helper()
	staging := kubeletpath.Staging(e.kubelet, "try.whitesky.cloud", id)
	target := kubeletpath.Target(e.kubelet, "p", "pv-flagged")
	if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, PublishContext: pc, StagingTargetPath: staging, VolumeCapability: flagged}); err != nil {
		t.Fatal(err)
	}
	if o := mountOptions(staging); !strings.Contains(o, "noatime") || !strings.Contains(o, "nosuid") || !strings.Contains(o, "nodev") {
		t.Fatalf("staging mount options %q lack noatime, nosuid or nodev", o)
	}
	if _, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: flagged, Readonly: true}); err != nil {
		t.Fatal(err)
	}
	if o := mountOptions(target); !strings.HasPrefix(o, "ro") || !strings.Contains(o, "nosuid") || !strings.Contains(o, "nodev") {
		t.Fatalf("read-only publish has mount options %q", o)
	}
	if err := os.WriteFile(filepath.Join(target, "x"), nil, 0o644); err == nil {
		t.Fatal("wrote through a read-only publish")
	}
	if err := os.WriteFile(filepath.Join(staging, "x"), nil, 0o644); err != nil {
		t.Fatalf("the staging mount should stay writable: %v", err)
	}
	if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}

}
