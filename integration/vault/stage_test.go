package vault

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

const stageNode = "4c4c4544-0042-3510-8052-b4c04f4a4d33"

// stageRig is a node plugin and the real agent on this host
// (agentnodetest.NewNode), unwrapping with the real server's transit
// engine.
type stageRig struct {
	*agentnodetest.Node
	d *driver.Driver
}

func newStageRig(t *testing.T, c *transit.Client, mount, key string) *stageRig {
	t.Helper()
	n := agentnodetest.NewNode(t, stageNode, c, crypt.TransitKey{Mount: mount, Name: key})
	return &stageRig{Node: n, d: n.Driver}
}

// disk makes disk id: a file of the host backend with a loop device on it.
func (r *stageRig) disk(t *testing.T, id int64) { agentnodetest.LoopDisk(t, r.DiskDir, id) }

var fsCap = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}

func (r *stageRig) stageRequest(id int64, encrypted bool) *csi.NodeStageVolumeRequest {
	vol := "ch-gen-1/" + strconv.FormatInt(id, 10)
	vc := map[string]string{}
	if encrypted {
		vc["cloud.whitesky/encrypted"] = "true"
	}
	return &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: kubeletpath.Staging(r.Kubelet, "cloud.whitesky.csi", vol),
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
