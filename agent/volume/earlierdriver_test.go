package volume

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/adopt"
	"github.com/whitesky-cloud/vco-storage/fence"
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

	req := e.stageReq("7431", img, "earlier")
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

// earlierDriversDisk prepares a loop disk as the earlier driver left its
// volumes (mkfs.ext4 -F -m0 on the whole disk, a file written), grown by
// the given MiB as through the API, and returns the image, its loop
// device and the file's content.
func earlierDriversDisk(t *testing.T, mib, growMiB int64) (string, string, []byte) {
	t.Helper()
	img, dev := loop(t, mib)
	if out, err := exec.Command("mkfs.ext4", "-F", "-m0", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	mnt := t.TempDir()
	if out, err := exec.Command("mount", dev, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v: %s", err, out)
	}
	// Data in most of the filesystem's MiB, each different, so that a
	// chunk moved twice or from the wrong place shows.
	content := make([]byte, (mib*3/4)<<20)
	rng := rand.NewChaCha8([32]byte{byte(mib), 7})
	rng.Read(content)
	werr := os.WriteFile(filepath.Join(mnt, "data"), content, 0o644)
	if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil || werr != nil {
		t.Fatalf("writing the volume's data: %v %v: %s", werr, err, out)
	}
	if growMiB > 0 {
		if err := os.Truncate(img, (mib+growMiB)<<20); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
			t.Fatalf("losetup -c: %v: %s", err, out)
		}
	}
	return img, dev, content
}

// TestAdoptedDiskOfTheEarlierDriverStagesFenced: `vco-agent adopt` (package
// agent/adopt) moves the earlier driver's filesystem up past a lease area
// it then writes; the volume then stages on the lease, fenced, with its
// files intact. An adoption cut short is finished by running it again.
// Without room to move into, it refuses and changes nothing.
func TestAdoptedDiskOfTheEarlierDriverStagesFenced(t *testing.T) {
	needRoot(t)
	e := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	key, _ := fence.KeyFromUUID(nodeA)

	// Not grown: refused, untouched.
	adoptionWithoutRoomIsRefused(ctx, t, key)

	// Grown by 8 MiB; three runs are cut short, none stages.
	img, dev, content := earlierDriversDisk(t, 32, 8)
	orig := readRange(t, img, 0, 32<<20)
	req := e.stageReq("7431", img, "adopted")
	req.AllowUnfenced = false
	e.adoptionCutShortThreeTimes(ctx, req, img, dev, key)
	res, err := adopt.Adopt(ctx, dev, adopt.Options{Key: key})
	if err != nil || !res.Resumed {
		t.Fatalf("finishing the adoption: %+v %v", res, err)
	}
	if res, err := adopt.Adopt(ctx, dev, adopt.Options{Key: key}); err != nil || !res.AlreadyLease {
		t.Fatalf("adopting an adopted disk again: %+v %v, want it left as a lease volume", res, err)
	}
	// Every byte of the filesystem moved up by the lease data offset.
	if !bytes.Equal(readRange(t, img, 1<<20, 32<<20), orig) {
		t.Fatal("the adopted filesystem is not the earlier driver's, moved up by 1 MiB, byte for byte")
	}

	st, err := e.m.Stage(ctx, req)
	if err != nil {
		t.Fatalf("staging the adopted volume: %v", err)
	}
	if st.Method != fence.MethodLease {
		t.Fatalf("the adopted volume staged with %q, want the lease", st.Method)
	}
	got, err := os.ReadFile(filepath.Join(req.StagingPath, "data"))
	if err != nil || !bytes.Equal(got, content) {
		t.Fatalf("the adopted volume's file: %d bytes, %v; want the earlier driver's %d bytes", len(got), err, len(content))
	}
	if err := e.m.Unstage(ctx, "7431", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// adoptionWithoutRoomIsRefused: the earlier driver's disk, not grown, is
// refused (saying to grow it) and left untouched.
func adoptionWithoutRoomIsRefused(ctx context.Context, t *testing.T, key fence.Key) {
	t.Helper()
	img0, dev0, _ := earlierDriversDisk(t, 32, 0)
	before := sha256File(t, img0)
	if _, err := adopt.Adopt(ctx, dev0, adopt.Options{Key: key}); err == nil || !strings.Contains(err.Error(), "grow the disk") {
		t.Fatalf("adopting a disk with no room: %v, want a refusal that says to grow it", err)
	}
	if sha256File(t, img0) != before {
		t.Fatal("the refused adoption changed the disk")
	}
}

// adoptionCutShortThreeTimes: the first run is cut short after 5 of its
// chunks, and the disk does not stage; the disk grows again before the
// next run (a PVC resize), which still finds where the first one stopped
// and is cut short after 3; a third is cut short after the move, with the
// first MiB zeroed and no lease header yet: no stage takes it either.
func (e *env) adoptionCutShortThreeTimes(ctx context.Context, req StageRequest, img, dev string, key fence.Key) {
	t := e.t
	t.Helper()
	if _, err := adopt.Adopt(ctx, dev, adopt.Options{Key: key, StopAfter: 5}); !errors.Is(err, adopt.ErrStopped) {
		t.Fatalf("the cut-short adoption: %v", err)
	}
	if _, err := e.m.Stage(ctx, req); err == nil {
		t.Fatal("a disk whose adoption was cut short staged")
	}
	// The disk grows again before the next run (a PVC resize): the run
	// still finds where the first one stopped.
	if err := os.Truncate(img, 48<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
		t.Fatalf("losetup -c: %v: %s", err, out)
	}
	if _, err := adopt.Adopt(ctx, dev, adopt.Options{Key: key, StopAfter: 3}); !errors.Is(err, adopt.ErrStopped) {
		t.Fatalf("the second cut-short run: %v", err)
	}
	// A third is cut short after the move, with the first MiB zeroed and
	// no lease header yet: no stage takes it either.
	if _, err := adopt.Adopt(ctx, dev, adopt.Options{Key: key, StopBeforeHeader: true}); !errors.Is(err, adopt.ErrStopped) {
		t.Fatalf("the run cut short before the header: %v", err)
	}
	if _, err := e.m.Stage(ctx, req); err == nil {
		t.Fatal("a disk whose adoption was cut short before its lease header staged")
	}
}

func readRange(t *testing.T, img string, off, n int64) []byte {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}
