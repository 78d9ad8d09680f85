package reliability

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// hostileCall is one request the agent must refuse without changing
// anything on the host.
type hostileCall struct {
	name string
	call func(ctx context.Context, c api.AgentClient) error
	// codes accepted; an unstage or unpublish of something never staged
	// is a success under CSI's idempotency rules, as long as nothing
	// changes.
	want []codes.Code
}

// TestHostileAgentRequests sends requests with missing, oversized and
// hostile fields to the built agent over its socket, before and while a
// real volume is staged, and checks each answer's code and that no mount,
// state file or loop device appeared or went.
func TestHostileAgentRequests(t *testing.T) {
	h := newHost(t)
	h.start()
	outside := filepath.Join(h.dir, "outside")
	os.MkdirAll(outside, 0o755)
	// A symlink inside the kubelet root pointing out of it, and one that
	// is itself the last element.
	os.Symlink(outside, filepath.Join(h.kubelet, "escape"))
	os.Symlink(outside, filepath.Join(h.kubelet, "linkdir"))
	// A pod directory that is a symlink out of the root.
	os.MkdirAll(filepath.Join(h.kubelet, "pods"), 0o755)
	os.Symlink(outside, filepath.Join(h.kubelet, "pods", "escape"))
	// The kubelet's own directories, which no volume may cover.
	own := kubeletOwnDirs(t, h.kubelet)
	dev := &api.DeviceLocator{LoopBackingFile: h.img}
	staging := kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "vol-1")
	huge := strings.Repeat("x", 1<<20)
	stage := func(r *api.StageVolumeRequest) func(context.Context, api.AgentClient) error {
		return func(ctx context.Context, c api.AgentClient) error { _, err := c.StageVolume(ctx, r); return err }
	}
	inv, nf := []codes.Code{codes.InvalidArgument}, []codes.Code{codes.NotFound}
	invOrNF := []codes.Code{codes.InvalidArgument, codes.NotFound}
	before := []hostileCall{
		{"stage: no volume id", stage(&api.StageVolumeRequest{Device: dev, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: no device", stage(&api.StageVolumeRequest{VolumeId: "v", StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: empty device", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{}, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: no staging path", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, AllowUnfenced: true}), inv},
		{"stage: relative path", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: "kubelet/x", AllowUnfenced: true}), inv},
		{"stage: .. out of the root", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: h.kubelet + "/../outside/x", AllowUnfenced: true}), inv},
		{"stage: .. inside the root", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: h.kubelet + "/a/../b", AllowUnfenced: true}), inv},
		{"stage: the root itself", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: h.kubelet, AllowUnfenced: true}), inv},
		{"stage: symlinked parent out of the root", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: filepath.Join(h.kubelet, "escape", "s"), AllowUnfenced: true}), inv},
		{"stage: path is a symlink", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: filepath.Join(h.kubelet, "linkdir"), AllowUnfenced: true}), inv},
		{"stage: outside the root", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: outside, AllowUnfenced: true}), inv},
		{"stage: NUL in path", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging + "\x00/x", AllowUnfenced: true}), inv},
		{"stage: 1 MiB path", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: filepath.Join(h.kubelet, huge), AllowUnfenced: true}), inv},
		{"stage: unknown fs type", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, FsType: "ext4;reboot", AllowUnfenced: true}), inv},
		{"stage: block with fs type", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, Block: true, FsType: "ext4", AllowUnfenced: true}), inv},
		{"stage: mount flag with comma", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, MountFlags: []string{"ro,exec"}, AllowUnfenced: true}), inv},
		{"stage: empty mount flag", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, MountFlags: []string{""}, AllowUnfenced: true}), inv},
		{"stage: encrypted without passphrase", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, Encryption: &api.Encryption{}, AllowUnfenced: true}), inv},
		{"stage: serial with comma", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{Serial: "a,pci=0000:00:01.0"}, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: bad pci", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{PciAddress: "../../"}, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: pci slot out of range", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{HasPci: true, PciBus: 1 << 30, PciSlot: 1 << 30}, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: grant without keys", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, Grant: &api.TakeoverGrant{Disk: "d", Node: nodeUUID}, AllowUnfenced: true}), inv},
		{"stage: grant for zero key", stage(&api.StageVolumeRequest{VolumeId: "v", Device: dev, StagingPath: staging, Grant: &api.TakeoverGrant{Disk: "d", Node: nodeUUID, Supersedes: []string{"0"}}, AllowUnfenced: true}), inv},
		{"stage: unknown serial", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{Serial: "no-such-disk-" + strings.Repeat("z", 4096)}, StagingPath: staging, AllowUnfenced: true}), nf},
		{"stage: unknown backing file", stage(&api.StageVolumeRequest{VolumeId: "v", Device: &api.DeviceLocator{LoopBackingFile: "/nonexistent/../etc/shadow"}, StagingPath: staging, AllowUnfenced: true}), invOrNF},
		{"stage: 1 MiB volume id", stage(&api.StageVolumeRequest{VolumeId: huge, Device: dev, StagingPath: staging, AllowUnfenced: true}), inv},
		{"stage: NUL and slashes in volume id", stage(&api.StageVolumeRequest{VolumeId: "../../\x00etc", Device: &api.DeviceLocator{Serial: "no-such-disk"}, StagingPath: staging, AllowUnfenced: true}), invOrNF},
		{"unstage: unknown volume", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "nope", StagingPath: staging})
			return err
		}, []codes.Code{codes.OK, codes.NotFound}},
		{"unstage: path out of the root", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "nope", StagingPath: "/proc"})
			return err
		}, inv},
		{"publish: unknown volume", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "nope", StagingPath: staging, TargetPath: kubeletpath.Target(h.kubelet, "p0", "pv")})
			return err
		}, []codes.Code{codes.NotFound, codes.FailedPrecondition}},
		{"unpublish: unknown volume", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.UnpublishVolume(ctx, &api.UnpublishVolumeRequest{VolumeId: "nope", TargetPath: kubeletpath.Target(h.kubelet, "p0", "pv")})
			return err
		}, []codes.Code{codes.OK, codes.NotFound}},
		{"expand: unknown volume, huge size", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.ExpandVolume(ctx, &api.ExpandVolumeRequest{VolumeId: "nope", VolumePath: staging, RequiredBytes: 1 << 62})
			return err
		}, nf},
		{"stats: unknown volume", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.GetVolumeStats(ctx, &api.GetVolumeStatsRequest{VolumeId: "nope", VolumePath: staging})
			return err
		}, nf},
		{"stats: no volume id", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.GetVolumeStats(ctx, &api.GetVolumeStatsRequest{VolumePath: staging})
			return err
		}, invOrNF},
	}
	runHostile(t, h, before)

	// Now with a real volume staged: requests aimed at it must not move,
	// widen or destroy it.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	good := &api.StageVolumeRequest{VolumeId: "vol-1", Device: dev, StagingPath: staging, FsType: "ext4", AllowUnfenced: true}
	if err := h.stage(ctx, good); err != nil {
		t.Fatalf("stage: %v", err)
	}
	target := kubeletpath.Target(h.kubelet, "p1", "pv-1")
	during := []hostileCall{
		{"stage again elsewhere", stage(&api.StageVolumeRequest{VolumeId: "vol-1", Device: dev, StagingPath: kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "vol-1-2"), FsType: "ext4", AllowUnfenced: true}), []codes.Code{codes.AlreadyExists}},
		{"stage again as xfs", stage(&api.StageVolumeRequest{VolumeId: "vol-1", Device: dev, StagingPath: staging, FsType: "xfs", AllowUnfenced: true}), []codes.Code{codes.AlreadyExists}},
		{"stage the same disk as another volume", stage(&api.StageVolumeRequest{VolumeId: "vol-2", Device: dev, StagingPath: kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "vol-2"), FsType: "ext4", AllowUnfenced: true}), []codes.Code{codes.FailedPrecondition, codes.AlreadyExists, codes.Aborted}},
		{"publish out of the root", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: staging, TargetPath: filepath.Join(h.dir, "outside", "t")})
			return err
		}, inv},
		{"publish through a symlink", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: staging, TargetPath: kubeletpath.Target(h.kubelet, "escape", "pv-1")})
			return err
		}, inv},
		{"publish with .. target", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: staging, TargetPath: target + "/../../../../../../etc"})
			return err
		}, inv},
		{"publish from the wrong staging path", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: filepath.Join(h.kubelet, "other"), TargetPath: target})
			return err
		}, []codes.Code{codes.InvalidArgument, codes.FailedPrecondition, codes.NotFound}},
		{"publish with a hostile mount flag", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: staging, TargetPath: target, MountFlags: []string{"bind,remount"}})
			return err
		}, inv},
		{"unstage from the wrong path", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-1", StagingPath: kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "vol-1-2")})
			return err
		}, []codes.Code{codes.InvalidArgument, codes.FailedPrecondition, codes.NotFound}},
		{"expand beyond the disk", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.ExpandVolume(ctx, &api.ExpandVolumeRequest{VolumeId: "vol-1", VolumePath: staging, RequiredBytes: 1 << 62})
			return err
		}, []codes.Code{codes.OutOfRange, codes.InvalidArgument, codes.FailedPrecondition}},
		{"expand negative", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.ExpandVolume(ctx, &api.ExpandVolumeRequest{VolumeId: "vol-1", VolumePath: staging, RequiredBytes: -1})
			return err
		}, []codes.Code{codes.InvalidArgument, codes.OutOfRange}},
		{"stats on a path out of the root", func(ctx context.Context, c api.AgentClient) error {
			_, err := c.GetVolumeStats(ctx, &api.GetVolumeStatsRequest{VolumeId: "vol-1", VolumePath: "/"})
			return err
		}, invOrNF},
	}
	for _, d := range own {
		publish := func(ctx context.Context, c api.AgentClient) error {
			_, err := c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: "vol-1", StagingPath: staging, TargetPath: d})
			return err
		}
		stageOver := stage(&api.StageVolumeRequest{VolumeId: "vol-3", Device: dev, StagingPath: d, FsType: "ext4", AllowUnfenced: true})
		rel := strings.TrimPrefix(d, h.kubelet+"/")
		during = append(during, hostileCall{"publish over the kubelet's " + rel, publish, inv}, hostileCall{"stage over the kubelet's " + rel, stageOver, inv})
	}
	runHostile(t, h, during)
	if err := h.unstage(ctx, "vol-1", staging); err != nil {
		t.Fatalf("unstage: %v", err)
	}
	for _, d := range own {
		if b, err := os.ReadFile(filepath.Join(d, "kubelet-file")); err != nil || string(b) != "the kubelet's" {
			t.Errorf("%s: the kubelet's file reads %q, %v", d, b, err)
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("something was made outside the kubelet root: %v", ents)
	}
}

func runHostile(t *testing.T, h *host, calls []hostileCall) {
	t.Helper()
	for _, hc := range calls {
		before := h.snap()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		call := func(ctx context.Context) error { return hc.call(ctx, h.c) }
		var err error
		if slices.Contains(hc.want, codes.Aborted) {
			err = call(ctx)
		} else {
			err = client.AskAgain(ctx, call)
		}
		cancel()
		got := status.Code(err)
		ok := false
		for _, w := range hc.want {
			ok = ok || got == w
		}
		if !ok {
			t.Errorf("%s: %v (%s), want one of %v", hc.name, shorten(err), got, hc.want)
		} else if err != nil && len(status.Convert(err).Message()) < 10 {
			t.Errorf("%s: message %q says too little", hc.name, status.Convert(err).Message())
		}
		if d := before.diff(h.snap()); d != "" {
			t.Errorf("%s: changed the host: %s", hc.name, d)
		}
		figures.add("hostile agent requests", 1)
	}
}

func shorten(err error) string {
	if err == nil {
		return "<nil>"
	}
	s := err.Error()
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}

// kubeletOwnDirs makes the kubelet's own directories under kubelet, each
// holding a file: its client certificate directory, another pod's
// emptyDir and the plugin registry.
func kubeletOwnDirs(t *testing.T, kubelet string) []string {
	t.Helper()
	var dirs []string
	for _, d := range []string{"pki", "pods/22222222-3333-4444-5555-666666666666/volumes/kubernetes.io~empty-dir/x", "plugins_registry"} {
		d = filepath.Join(kubelet, d)
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "kubelet-file"), []byte("the kubelet's"), 0o600); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, d)
	}
	return dirs
}
