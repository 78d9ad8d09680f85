package volume

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
)

// TestDiskOfTheEarlierDriverIsNeverStagedUnfenced: a disk as the driver
// this one replaces left it (its node plugin ran mount-utils'
// FormatAndMount on the whole virtio disk: `mkfs.ext4 -F -m0`, the
// filesystem at offset 0, no lease area, files written) has no
// reservations and no room for a lease. Its stage is refused with
// FAILED_PRECONDITION naming what is on it, nothing is mounted, and not a
// byte of it changes: never a silent unfenced stage (docs/storage.md,
// "Volumes of the earlier driver").
func TestDiskOfTheEarlierDriverIsNeverStagedUnfenced(t *testing.T) {
	needRoot(t)
	e := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, dev := loop(t, 64)
	if out, err := exec.Command("mkfs.ext4", "-F", "-m0", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	mnt := t.TempDir()
	if out, err := exec.Command("mount", dev, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v: %s", err, out)
	}
	werr := os.WriteFile(filepath.Join(mnt, "data"), []byte("the earlier driver's data\n"), 0o644)
	if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil || werr != nil {
		t.Fatalf("writing the volume's data: %v %v: %s", werr, err, out)
	}
	before := sha256File(t, img)

	req := e.stageReq("7431", img, "staging/earlier")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "7431", "ext2/3/4 superblock", "not a lease area", "opt-in")
	if isMounted(t, req.StagingPath) {
		t.Fatal("the refused stage left the volume mounted")
	}
	if sha256File(t, img) != before {
		t.Fatal("the refused stage changed the disk")
	}
}
