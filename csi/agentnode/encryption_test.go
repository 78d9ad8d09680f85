package agentnode_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// TestEncryptedVolumeThroughTheNodeService stages an encrypted volume
// through the node service and the real agent: on a blank disk the plugin
// wraps a new passphrase with the transit engine (a FAKE Vault transit
// server, as no Vault runs here) and the agent formats LUKS2 with it;
// staged again, the plugin unwraps the header's token and the data is
// still there. A disk holding other data is never formatted.
func TestEncryptedVolumeThroughTheNodeService(t *testing.T) {
	tc, vault := agentnodetest.Transit(t)
	n := agentnodetest.NewNode(t, nodeA, tc, crypt.TransitKey{Mount: "transit", Name: "vco-volumes"})
	d, a, kubelet, diskDir := n.Driver, n.Agent, n.Kubelet, n.DiskDir
	_, dev := agentnodetest.LoopDisk(t, diskDir, 8)

	ctx := context.Background()
	const vol = "ch-gen-1/8"
	encrypted := map[string]string{"cloud.whitesky/encrypted": "true"}
	staging := kubeletpath.Staging(kubelet, "cloud.whitesky.csi", vol)
	target := kubeletpath.Target(kubelet, "p", "pv-8")
	stage := &csi.NodeStageVolumeRequest{VolumeId: vol, StagingTargetPath: staging, VolumeCapability: mountCap,
		PublishContext: map[string]string{driver.PubDiskID: "8"}, VolumeContext: encrypted}

	if _, err := d.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("first stage of an encrypted volume: %v", err)
	}
	tok := checkFormattedWithAWrappedPassphrase(ctx, t, a, vault, stage, dev)
	publishWriteUnpublishUnstage(ctx, t, d, vol, staging, target)

	// Staged again: the passphrase comes from the header's token.
	if _, err := d.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("second stage: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "secret-data")); err != nil || string(b) != "kept" {
		t.Fatalf("data after the second stage: %q %v", b, err)
	}
	if transitRequests(vault, "encrypt") != 1 || transitRequests(vault, "decrypt") != 1 {
		t.Fatalf("transit requests after the second stage: %v", vault.Requests)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	rotationRewrapsTheToken(ctx, t, d, a, tc, vault, stage)

	// The transit engine refuses (the node's token revoked): the stage
	// fails saying so, and names no secret.
	vault.Mu.Lock()
	delete(vault.Tokens, "node-token")
	vault.Mu.Unlock()
	_, err := d.NodeStageVolume(ctx, stage)
	if driver.CodeForError(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "unwrapping its passphrase") ||
		strings.Contains(err.Error(), "node-token") || strings.Contains(err.Error(), tok.Token.Ciphertext) {
		t.Fatalf("stage with the transit engine refusing: %v", err)
	}

	encryptedStageNeverFormatsOverData(ctx, t, d, kubelet, diskDir, encrypted)
}

// rotationRewrapsTheToken: after the transit key's rotation, the next
// stage brings the volume's token to the new version (driver.Rewrap after
// the stage); after another rotation `vco-csi rewrap`'s loop does the same
// for the volume staged here; with min_decryption_version past the first
// wrap the volume still opens. The passphrase never changes.
func rotationRewrapsTheToken(ctx context.Context, t *testing.T, d *driver.Driver, a *agentnode.Agent, tc crypt.Wrapper, vault *transittest.Fake, stage *csi.NodeStageVolumeRequest) {
	t.Helper()
	unstage := &csi.NodeUnstageVolumeRequest{VolumeId: stage.VolumeId, StagingTargetPath: stage.StagingTargetPath}
	vault.Rotate("vco-volumes")
	readOnlyStageLeavesTheToken(ctx, t, d, a, vault, stage)
	if _, err := d.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("stage after the key's rotation: %v", err)
	}
	if tok, err := a.StagedVolumeToken(ctx, stage.VolumeId); err != nil || tok.Token == nil || tok.Token.KeyVersion != 2 {
		t.Fatalf("the token after a stage following the rotation: %+v, %v; want version 2", tok.Token, err)
	}
	vault.Rotate("vco-volumes")
	vols, err := a.EncryptedVolumes(ctx)
	if err != nil || len(vols) != 1 || vols[0] != stage.VolumeId {
		t.Fatalf("encrypted volumes staged here: %v, %v", vols, err)
	}
	r, err := driver.Rewrap(ctx, a, tc, stage.VolumeId)
	if err != nil || r.From != 2 || r.To != 3 {
		t.Fatalf("rewrap of the staged volume: %+v, %v; want 2 -> 3", r, err)
	}
	if r, err := driver.Rewrap(ctx, a, tc, stage.VolumeId); err != nil || r.From != 3 || r.To != 3 {
		t.Fatalf("a second rewrap: %+v, %v; want nothing to do at version 3", r, err)
	}
	if _, err := d.NodeUnstageVolume(ctx, unstage); err != nil {
		t.Fatal(err)
	}
	vault.Mu.Lock()
	vault.MinDecryptionVersion["vco-volumes"] = 3
	vault.Mu.Unlock()
	if _, err := d.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("stage with min_decryption_version 3 after the rewrap: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(stage.StagingTargetPath, "secret-data")); err != nil || string(b) != "kept" {
		t.Fatalf("data after the rewraps: %q %v", b, err)
	}
	if _, err := d.NodeUnstageVolume(ctx, unstage); err != nil {
		t.Fatal(err)
	}
	vault.Mu.Lock()
	vault.MinDecryptionVersion["vco-volumes"] = 0
	vault.Mu.Unlock()
}

// readOnlyStageLeavesTheToken: a read-only stage after the key's rotation
// writes no header: the token keeps its version and the plugin asks the
// transit engine for no rewrap.
func readOnlyStageLeavesTheToken(ctx context.Context, t *testing.T, d *driver.Driver, a *agentnode.Agent, vault *transittest.Fake, stage *csi.NodeStageVolumeRequest) {
	t.Helper()
	ro := &csi.NodeStageVolumeRequest{VolumeId: stage.VolumeId, StagingTargetPath: stage.StagingTargetPath,
		PublishContext: stage.PublishContext, VolumeContext: stage.VolumeContext,
		VolumeCapability: &csi.VolumeCapability{AccessType: stage.VolumeCapability.AccessType,
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY}}}
	rewraps := transitRequests(vault, "rewrap")
	if _, err := d.NodeStageVolume(ctx, ro); err != nil {
		t.Fatalf("read-only stage after the key's rotation: %v", err)
	}
	tok, err := a.StagedVolumeToken(ctx, stage.VolumeId)
	if err != nil || tok.Token == nil || tok.Token.KeyVersion != 1 || transitRequests(vault, "rewrap") != rewraps {
		t.Fatalf("the token after a read-only stage following the rotation: %+v, %v, %d rewrap requests; want version 1 and none",
			tok.Token, err, transitRequests(vault, "rewrap")-rewraps)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: stage.VolumeId, StagingTargetPath: stage.StagingTargetPath}); err != nil {
		t.Fatal(err)
	}
}

// transitRequests counts the fake transit server's requests of op
// (encrypt, decrypt or rewrap) with the key vco-volumes.
func transitRequests(vault *transittest.Fake, op string) int {
	vault.Mu.Lock()
	defer vault.Mu.Unlock()
	n := 0
	for _, r := range vault.Requests {
		if strings.HasSuffix(r, "/transit/"+op+"/vco-volumes") {
			n++
		}
	}
	return n
}

// checkFormattedWithAWrappedPassphrase: after the first stage the disk
// holds a LUKS2 header whose token is the passphrase wrapped by the
// transit key, for which the plugin asked transit once to encrypt and
// never to decrypt. It returns the token.
func checkFormattedWithAWrappedPassphrase(ctx context.Context, t *testing.T, a *agentnode.Agent, vault *transittest.Fake,
	stage *csi.NodeStageVolumeRequest, dev string) driver.VolumeToken {
	t.Helper()
	if out, _ := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", dev).Output(); strings.TrimSpace(string(out)) != "crypto_LUKS" {
		t.Fatalf("the disk holds %q after the first stage, want a LUKS2 header", out)
	}
	tok, err := a.VolumeToken(ctx, stage.VolumeId, stage.PublishContext)
	if err != nil || tok.Content != driver.ContentLUKS2 || tok.Token == nil || tok.Token.KeyName != "vco-volumes" ||
		!strings.HasPrefix(tok.Token.Ciphertext, "vault:v1:") {
		t.Fatalf("token after the first stage: %+v %v", tok, err)
	}
	if transitRequests(vault, "encrypt") != 1 || transitRequests(vault, "decrypt") != 0 {
		t.Fatalf("transit requests after the first stage: %v", vault.Requests)
	}
	return tok
}

// publishWriteUnpublishUnstage publishes the staged volume at target,
// writes secret-data ("kept") through it, then unpublishes and unstages.
func publishWriteUnpublishUnstage(ctx context.Context, t *testing.T, d *driver.Driver, vol, staging, target string) {
	t.Helper()
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: mountCap}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "secret-data"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
}

// encryptedStageNeverFormatsOverData: a disk with a filesystem on it is
// never formatted as LUKS2.
func encryptedStageNeverFormatsOverData(ctx context.Context, t *testing.T, d *driver.Driver, kubelet, diskDir string, encrypted map[string]string) {
	t.Helper()
	_, plain := agentnodetest.LoopDisk(t, diskDir, 9)
	if out, err := exec.Command("mkfs.ext4", "-q", plain).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	other := &csi.NodeStageVolumeRequest{VolumeId: "ch-gen-1/9", StagingTargetPath: filepath.Join(kubelet, "plugins", "staging", "9"),
		VolumeCapability: mountCap, PublishContext: map[string]string{driver.PubDiskID: "9"}, VolumeContext: encrypted}
	_, err := d.NodeStageVolume(ctx, other)
	if st := status.Convert(driverStatus(err)); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "never formatted over data") {
		t.Fatalf("encrypted stage of a disk with ext4 on it: %v", err)
	}
	if out, _ := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", plain).Output(); strings.TrimSpace(string(out)) != "ext4" {
		t.Fatalf("the ext4 disk holds %q after the refused stage", out)
	}
}
