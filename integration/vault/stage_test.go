package vault

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	agentconfig "github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

const stageNode = "4c4c4544-0042-3510-8052-b4c04f4a4d33"

// stageRig is a node plugin and the real agent on this host, on loop
// devices of the simulator's host backend, unwrapping with the real
// server's transit engine. The agent's LUKS2 is its own; the dm-crypt
// mapping is a FAKE (agentnodetest.LoopLUKS): this host has no
// device-mapper.
type stageRig struct {
	d                *driver.Driver
	kubelet, diskDir string
}

func newStageRig(t *testing.T, c *transit.Client, mount, key string) *stageRig {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	r := &stageRig{kubelet: filepath.Join(dir, "kubelet"), diskDir: filepath.Join(dir, "disks")}
	for _, p := range []string{r.kubelet, r.diskDir} {
		if err := os.MkdirAll(p, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	fk, err := fence.KeyFromUUID(stageNode)
	if err != nil {
		t.Fatal(err)
	}
	m, err := volume.New(volume.Options{
		Config:   agentconfig.Volumes{KubeletRoot: r.kubelet, DevRoot: "/dev", CheckInterval: time.Hour, AllowUnfenced: true, AllowLoopDevices: true},
		Crypt:    agentnodetest.NewLoopLUKS(t),
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Fencers: &volume.Fencing{Key: fk, Node: stageNode},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	a := agentnodetest.ServeAgent(t, filepath.Join(dir, "agent.sock"), m,
		server.NodeIdentity{SystemUUID: stageNode, Location: "ch-gen-1"}, nil,
		agentnode.Options{AllowUnfenced: true, LoopDiskDir: r.diskDir})
	r.d, err = driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: a, KubeletRoot: r.kubelet,
		Transit: c, TransitKey: crypt.TransitKey{Mount: mount, Name: key}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// disk makes disk id: a file of the host backend with a loop device on it.
func (r *stageRig) disk(t *testing.T, id int64) {
	t.Helper()
	img := (&sim.HostBackend{Dir: r.diskDir}).DiskFile(id)
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
}

var fsCap = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}

func (r *stageRig) stageRequest(id int64, encrypted bool) *csi.NodeStageVolumeRequest {
	vol := "ch-gen-1/" + strconv.FormatInt(id, 10)
	vc := map[string]string{}
	if encrypted {
		vc["cloud.whitesky/encrypted"] = "true"
	}
	return &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: kubeletpath.Staging(r.kubelet, "cloud.whitesky.csi", vol),
		VolumeCapability: fsCap, PublishContext: map[string]string{driver.PubDiskID: strconv.FormatInt(id, 10)}, VolumeContext: vc}
}

func (r *stageRig) unstage(ctx context.Context, t *testing.T, req *csi.NodeStageVolumeRequest) {
	t.Helper()
	if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: req.VolumeId, StagingTargetPath: req.StagingTargetPath}); err != nil {
		t.Fatalf("unstage of %s: %v", req.VolumeId, err)
	}
}

// mounted says whether path is a mount point in this mount namespace.
func mounted(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

// TestStageBelowMinDecryptionVersion: a whole stage through the node
// plugin and the real agent against the real server. An encrypted volume
// formatted with version 1 of its transit key, then the key rotated and
// min_decryption_version raised to 2 with no rewrap: the stage fails
// FAILED_PRECONDITION naming the key's version 1 and the remedy, and
// leaves nothing mounted; a plain volume on the node stages as before.
// With min_decryption_version back at 1 the kubelet's retry opens the
// volume with its data, and its stage rewraps the token to version 2.
func TestStageBelowMinDecryptionVersion(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, root, _ := unsealed(ctx, t, cachedServer(t))
	const mount, key = "transit", "vco-volumes"
	cli := func(args ...string) {
		t.Helper()
		if _, err := s.CLI(ctx, root, args...); err != nil {
			t.Fatal(err)
		}
	}
	cli("secrets", "enable", "-path="+mount, "transit")
	cli("write", "-f", mount+"/keys/"+key)
	c, err := transit.New(transit.Config{Address: s.Addr, CACertFile: s.CACert, Mount: mount, Token: root})
	if err != nil {
		t.Fatal(err)
	}
	r := newStageRig(t, c, mount, key)
	r.disk(t, 1)
	r.disk(t, 2)
	enc, plain := r.stageRequest(1, true), r.stageRequest(2, false)

	if _, err := r.d.NodeStageVolume(ctx, enc); err != nil {
		t.Fatalf("first stage of the encrypted volume: %v", err)
	}
	if err := os.WriteFile(filepath.Join(enc.StagingTargetPath, "data"), []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	r.unstage(ctx, t, enc)

	cli("write", "-f", mount+"/keys/"+key+"/rotate")
	cli("write", mount+"/keys/"+key+"/config", "min_decryption_version=2")
	_, err = r.d.NodeStageVolume(ctx, enc)
	if driver.CodeForError(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "version 1 of transit key \"vco-volumes\"") ||
		!strings.Contains(err.Error(), "set min_decryption_version to 1 or lower") {
		t.Fatalf("stage of a volume wrapped below min_decryption_version: %v (%v); want FAILED_PRECONDITION naming version 1 and the remedy",
			err, driver.CodeForError(err))
	}
	if mounted(t, enc.StagingTargetPath) {
		t.Fatalf("the refused stage left %s mounted", enc.StagingTargetPath)
	}
	if _, err := r.d.NodeStageVolume(ctx, plain); err != nil {
		t.Fatalf("a plain volume's stage with the key's min_decryption_version raised: %v", err)
	}
	r.unstage(ctx, t, plain)

	cli("write", mount+"/keys/"+key+"/config", "min_decryption_version=1")
	if _, err := r.d.NodeStageVolume(ctx, enc); err != nil {
		t.Fatalf("the kubelet's retry with min_decryption_version back at 1: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(enc.StagingTargetPath, "data")); err != nil || string(b) != "kept" {
		t.Fatalf("data after the retry: %q, %v", b, err)
	}
	r.unstage(ctx, t, enc)
	cli("write", mount+"/keys/"+key+"/config", "min_decryption_version=2")
	if _, err := r.d.NodeStageVolume(ctx, enc); err != nil {
		t.Fatalf("stage with min_decryption_version 2 after the rewrap the last stage made: %v", err)
	}
	r.unstage(ctx, t, enc)
}
