package reliability

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// recordingAgent stands in for vco-agent behind the node service and
// records every call that reaches it: a hostile node request must be
// refused by the plugin before any does.
type recordingAgent struct {
	mu    sync.Mutex
	calls []string
}

func (a *recordingAgent) rec(s string) {
	a.mu.Lock()
	a.calls = append(a.calls, s)
	a.mu.Unlock()
}

func (a *recordingAgent) take() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	c := a.calls
	a.calls = nil
	return c
}

var errFake = status.Error(codes.Unimplemented, "the recording agent does no volume work")

func (a *recordingAgent) Identity(context.Context) (driver.NodeIdentity, error) {
	return driver.NodeIdentity{UUID: hostUUID, Location: hostLoc}, nil
}
func (a *recordingAgent) Stage(_ context.Context, r driver.StageRequest) error {
	a.rec("stage " + r.StagingPath)
	return errFake
}
func (a *recordingAgent) Unstage(_ context.Context, v, p string) error {
	a.rec("unstage " + p)
	return errFake
}
func (a *recordingAgent) Publish(_ context.Context, r driver.PublishRequest) error {
	a.rec("publish " + r.TargetPath)
	return errFake
}
func (a *recordingAgent) Unpublish(_ context.Context, v, p string) error {
	a.rec("unpublish " + p)
	return errFake
}
func (a *recordingAgent) Expand(_ context.Context, v, p string, n int64) (int64, error) {
	a.rec("expand " + p)
	return 0, errFake
}
func (a *recordingAgent) Stats(_ context.Context, v, p string) (driver.VolumeStats, error) {
	a.rec("stats " + p)
	return driver.VolumeStats{}, errFake
}

// simState is the simulator's disks and attachments, to compare.
func (e *csiEnv) simState() string {
	st := e.sim.Snapshot()
	var out []string
	for _, d := range st.Disks {
		b, _ := json.Marshal(d)
		out = append(out, string(b))
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// TestHostileCSIRequests sends CSI requests with missing, oversized and
// hostile fields to the plugin (controller against the simulator, node
// service in front of a recording agent) and checks the code, that the
// simulator's disks and attachments did not change, that no mount
// appeared, and that no hostile node request reached the agent.
func TestHostileCSIRequests(t *testing.T) {
	dir := t.TempDir()
	kubelet := filepath.Join(dir, "kubelet")
	outside := filepath.Join(dir, "outside")
	os.MkdirAll(kubelet, 0o750)
	os.MkdirAll(outside, 0o755)
	os.Symlink(outside, filepath.Join(kubelet, "escape"))
	agent := &recordingAgent{}
	e := newCSIEnvWith(t, agent, kubelet)
	ctx := context.Background()
	good, err := e.ctrl.CreateVolume(ctx, createReq("pvc-good", 1))
	if err != nil {
		t.Fatal(err)
	}
	vid := good.GetVolume().GetVolumeId()
	mnt := createReq("x", 1).VolumeCapabilities[0]
	huge := strings.Repeat("n", 1<<20)
	pubCtx := map[string]string{"cloud.whitesky/disk-id": "100", "cloud.whitesky/serial": "100"}
	staging := filepath.Join(kubelet, "plugins", "kubernetes.io", "csi", "stage", "v")
	target := filepath.Join(kubelet, "pods", "p", "volumes", "v", "mount")
	inv := []codes.Code{codes.InvalidArgument}
	invNF := []codes.Code{codes.InvalidArgument, codes.NotFound}
	withCap := func(r *csi.CreateVolumeRequest, f func(*csi.CreateVolumeRequest)) *csi.CreateVolumeRequest {
		f(r)
		return r
	}
	type tc struct {
		name string
		call func(context.Context) error
		want []codes.Code
	}
	create := func(r *csi.CreateVolumeRequest) func(context.Context) error {
		return func(ctx context.Context) error { _, err := e.ctrl.CreateVolume(ctx, r); return err }
	}
	cases := []tc{
		{"create: no name", create(withCap(createReq("", 1), func(*csi.CreateVolumeRequest) {})), inv},
		{"create: 1 MiB name", create(createReq(huge, 1)), inv},
		{"create: NUL in name", create(createReq("pvc\x00x", 1)), inv},
		{"create: no capabilities", create(withCap(createReq("pvc-nocap", 1), func(r *csi.CreateVolumeRequest) { r.VolumeCapabilities = nil })), inv},
		{"create: 4 EiB", create(createReq("pvc-huge", 4<<30)), []codes.Code{codes.OutOfRange, codes.InvalidArgument}},
		{"create: negative size", create(withCap(createReq("pvc-neg", 1), func(r *csi.CreateVolumeRequest) { r.CapacityRange.RequiredBytes = -1 })), []codes.Code{codes.OutOfRange, codes.InvalidArgument}},
		{"create: limit below required", create(withCap(createReq("pvc-lim", 2), func(r *csi.CreateVolumeRequest) { r.CapacityRange.LimitBytes = 1 << 30 })), []codes.Code{codes.OutOfRange, codes.InvalidArgument}},
		{"create: unknown type", create(withCap(createReq("pvc-type", 1), func(r *csi.CreateVolumeRequest) { r.Parameters = map[string]string{"type": "../../x"} })), inv},
		{"create: bad iops", create(withCap(createReq("pvc-iops", 1), func(r *csi.CreateVolumeRequest) { r.Parameters = map[string]string{"iops": "-5"} })), inv},
		{"create: bad encryption", create(withCap(createReq("pvc-enc", 1), func(r *csi.CreateVolumeRequest) { r.Parameters = map[string]string{"encryption": "maybe"} })), inv},
		{"create: unknown parameter", create(withCap(createReq("pvc-param", 1), func(r *csi.CreateVolumeRequest) { r.Parameters = map[string]string{"x\x00y": "z"} })), inv},
		{"create: multi-writer", create(withCap(createReq("pvc-mw", 1), func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities[0].AccessMode.Mode = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
		})), inv},
		{"create: unknown location", create(withCap(createReq("pvc-loc", 1), func(r *csi.CreateVolumeRequest) {
			r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"cloud.whitesky/location": "../mars"}}}}
		})), []codes.Code{codes.InvalidArgument, codes.ResourceExhausted, codes.NotFound}},
		{"create: snapshot source unknown", create(withCap(createReq("pvc-src", 1), func(r *csi.CreateVolumeRequest) {
			r.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "ch-lug-1/999/../../x"}}}
		})), invNF},
		{"delete: no id", func(ctx context.Context) error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{})
			return err
		}, inv},
		{"delete: hostile id", func(ctx context.Context) error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "../../ch-lug-1/100"})
			return err
		}, []codes.Code{codes.OK, codes.InvalidArgument, codes.NotFound}},
		{"delete: huge id", func(ctx context.Context) error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: huge})
			return err
		}, []codes.Code{codes.OK, codes.InvalidArgument, codes.NotFound}},
		{"publish: unknown volume", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "ch-lug-1/999999", NodeId: hostUUID, VolumeCapability: mnt})
			return err
		}, []codes.Code{codes.NotFound}},
		{"publish: unknown node", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: "00000000-0000-4000-8000-000000000000", VolumeCapability: mnt})
			return err
		}, []codes.Code{codes.NotFound}},
		{"publish: hostile node id", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: "../../vms/1", VolumeCapability: mnt})
			return err
		}, invNF},
		{"publish: no capability", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: hostUUID})
			return err
		}, inv},
		{"expand: 4 EiB", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vid, CapacityRange: &csi.CapacityRange{RequiredBytes: 4 << 60}})
			return err
		}, []codes.Code{codes.OutOfRange, codes.InvalidArgument}},
		{"expand: unknown volume", func(ctx context.Context) error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "ch-lug-1/999999", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
			return err
		}, []codes.Code{codes.NotFound}},
		{"snapshot: unknown source", func(ctx context.Context) error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x", SourceVolumeId: "ch-lug-1/999999"})
			return err
		}, []codes.Code{codes.NotFound}},
		{"snapshot: no name", func(ctx context.Context) error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vid})
			return err
		}, inv},
	}
	nodeStage := func(id, path string, cap *csi.VolumeCapability, pc map[string]string) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: path, VolumeCapability: cap, PublishContext: pc})
			return err
		}
	}
	nodePublish := func(path, tgt string) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vid, StagingTargetPath: path, TargetPath: tgt, VolumeCapability: mnt})
			return err
		}
	}
	cases = append(cases,
		tc{"node stage: no volume id", nodeStage("", staging, mnt, pubCtx), inv},
		tc{"node stage: no path", nodeStage(vid, "", mnt, pubCtx), inv},
		tc{"node stage: no capability", nodeStage(vid, staging, nil, pubCtx), inv},
		tc{"node stage: .. out of the root", nodeStage(vid, kubelet+"/../outside/s", mnt, pubCtx), inv},
		// A symlink along a path is the agent's to refuse: the node plugin
		// has no view of the kubelet's directory (docs/security.md, "The
		// node container"); csi/agentnode's TestAgentRefusesSymlinkThePluginCannotSee
		// runs that case against the real agent.
		tc{"node stage: outside the root", nodeStage(vid, "/etc/vco", mnt, pubCtx), inv},
		tc{"node stage: NUL in path", nodeStage(vid, staging+"\x00", mnt, pubCtx), inv},
		tc{"node stage: 1 MiB path", nodeStage(vid, filepath.Join(kubelet, huge), mnt, pubCtx), inv},
		tc{"node stage: hostile volume id", nodeStage("../../"+huge, staging, mnt, pubCtx), inv},
		tc{"node publish: target outside", nodePublish(staging, "/etc/vco-target"), inv},
		tc{"node publish: target via ..", nodePublish(staging, target+"/../../../../../../../../etc"), inv},
		tc{"node publish: staging outside", nodePublish("/", target), inv},
		tc{"node unstage: outside", func(ctx context.Context) error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vid, StagingTargetPath: "/proc"})
			return err
		}, inv},
		tc{"node unpublish: outside", func(ctx context.Context) error {
			_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vid, TargetPath: outside})
			return err
		}, inv},
		tc{"node stats: outside", func(ctx context.Context) error {
			_, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vid, VolumePath: "/"})
			return err
		}, invNF},
		tc{"node expand: outside", func(ctx context.Context) error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vid, VolumePath: "/var", CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 62}})
			return err
		}, invNF},
	)
	mountsBefore := strings.Join(mountPoints(), "\n")
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := e.simState()
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := c.call(cctx)
			cancel()
			got := status.Code(err)
			ok := false
			for _, w := range c.want {
				ok = ok || got == w
			}
			if !ok {
				t.Errorf("%s (%s), want one of %v", shorten(err), got, c.want)
			}
			if after := e.simState(); after != before {
				t.Errorf("changed the simulator's disks:\n%s\n->\n%s", shorten(fmt.Errorf("%s", before)), shorten(fmt.Errorf("%s", after)))
			}
			if strings.HasPrefix(c.name, "node") {
				if calls := agent.take(); len(calls) > 0 {
					t.Errorf("reached the agent: %s", shorten(fmt.Errorf("%v", calls)))
				}
			}
			figures.add("hostile CSI requests", 1)
		})
	}
	if strings.Join(mountPoints(), "\n") != mountsBefore {
		t.Errorf("mounts changed")
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("something was made outside the kubelet root: %v", ents)
	}
}

func (a *recordingAgent) VolumeToken(_ context.Context, v string, _ map[string]string) (driver.VolumeToken, error) {
	a.rec("volume token " + v)
	return driver.VolumeToken{}, errFake
}
