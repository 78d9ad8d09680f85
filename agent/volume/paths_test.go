package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

// Unpublish acts only on a publication of the volume it names. Another
// pod's mount, a file of the kubelet's and a directory with data are
// refused, and stay as they were; what a publish that never finished
// leaves (an empty directory of the kubelet's pod volume form) goes, and
// so does a target that is already gone.
func TestUnpublishActsOnlyOnItsOwnPublications(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 64)
	req := e.stageReq("vol-1", img, "vol-1")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	pod := e.target("11111111-2222-3333-4444-555555555555", "pv-1")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: pod}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pod, "data"), []byte("pod data"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.unpublishRefusesWhatIsNotItsOwn(ctx, pod)
	e.unpublishRemovesWhatAnUnfinishedPublishLeft(ctx)

	// The volume's own publication goes, and a retry succeeds.
	if err := e.m.Unpublish(ctx, "vol-1", pod); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(pod); !os.IsNotExist(err) || isMounted(t, pod) {
		t.Fatalf("the publication is still there: %v", err)
	}
	if err := e.m.Unpublish(ctx, "vol-1", pod); err != nil {
		t.Fatalf("retried unpublish: %v", err)
	}
	if err := e.m.Unstage(ctx, "vol-1", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// unpublishRefusesWhatIsNotItsOwn: another pod's mount (by a volume this
// node does not know and by one it knows that is not published there), a
// file of the kubelet's, a directory with data and a path that is no pod
// volume's are refused, and stay as they were.
func (e *env) unpublishRefusesWhatIsNotItsOwn(ctx context.Context, pod string) {
	t := e.t
	t.Helper()
	config := e.path("config.yaml")
	if err := os.WriteFile(config, []byte("kubelet config"), 0o600); err != nil {
		t.Fatal(err)
	}
	full := e.target("66666666-2222-3333-4444-555555555555", "pv-2")
	if err := os.MkdirAll(full, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(full, "kept"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	// Another pod's mount, by a volume this node does not know and by one
	// it knows that is not published there.
	wantCode(t, e.m.Unpublish(ctx, "no-such-volume", pod), codes.FailedPrecondition, "not staged or published", "nothing unmounted")
	wantCode(t, e.m.Unpublish(ctx, "vol-other", pod), codes.FailedPrecondition, "refused")
	if b, err := os.ReadFile(filepath.Join(pod, "data")); err != nil || string(b) != "pod data" || !isMounted(t, pod) {
		t.Fatalf("another volume's unpublish touched the pod's mount: mounted %v, %q %v", isMounted(t, pod), b, err)
	}
	// The kubelet's own file, and a directory holding data.
	wantCode(t, e.m.Unpublish(ctx, "no-such-volume", config), codes.FailedPrecondition, "not a pod volume path")
	wantCode(t, e.m.Unpublish(ctx, "vol-1", config), codes.FailedPrecondition, "not published at")
	if b, err := os.ReadFile(config); err != nil || string(b) != "kubelet config" {
		t.Fatalf("the kubelet's file was removed or changed: %q %v", b, err)
	}
	wantCode(t, e.m.Unpublish(ctx, "no-such-volume", full), codes.FailedPrecondition, "not an empty directory")
	if _, err := os.Stat(filepath.Join(full, "kept")); err != nil {
		t.Fatalf("a directory with data was removed: %v", err)
	}
	wantCode(t, e.m.Unpublish(ctx, "no-such-volume", e.kubelet+"/pods"), codes.FailedPrecondition, "not a pod volume path")
}

// unpublishRemovesWhatAnUnfinishedPublishLeft: what a publish that never
// finished leaves (an empty pod volume directory, an empty raw block
// target file) goes, and a target already gone is no error.
func (e *env) unpublishRemovesWhatAnUnfinishedPublishLeft(ctx context.Context) {
	t := e.t
	t.Helper()
	stray := e.target("77777777-2222-3333-4444-555555555555", "pv-3")
	if err := os.MkdirAll(stray, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unpublish(ctx, "no-such-volume", stray); err != nil {
		t.Fatalf("unpublishing an empty pod volume directory: %v", err)
	}
	if _, err := os.Lstat(stray); !os.IsNotExist(err) {
		t.Fatalf("the empty pod volume directory is still there: %v", err)
	}
	strayDev := e.blockTarget("pv-4", "88888888-2222-3333-4444-555555555555")
	if err := os.MkdirAll(filepath.Dir(strayDev), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(strayDev, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unpublish(ctx, "no-such-volume", strayDev); err != nil {
		t.Fatalf("unpublishing an empty raw block target file: %v", err)
	}
	if _, err := os.Lstat(strayDev); !os.IsNotExist(err) {
		t.Fatalf("the empty raw block target file is still there: %v", err)
	}
	if err := e.m.Unpublish(ctx, "no-such-volume", e.target("gone", "pv")); err != nil {
		t.Fatalf("unpublishing a target that does not exist: %v", err)
	}
}

// swapOnChoose replaces dir (under the kubelet root) by a symlink to
// elsewhere when the stage chooses its fencing: after the staging path
// was checked, before the agent makes it and mounts on it.
type swapOnChoose struct {
	FencerFactory
	dir, elsewhere string
}

func (s swapOnChoose) Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	if err := os.RemoveAll(s.dir); err != nil {
		return Choice{}, err
	}
	if err := os.Symlink(s.elsewhere, s.dir); err != nil {
		return Choice{}, err
	}
	return s.FencerFactory.Choose(ctx, dev, volume, onLost)
}

// A directory on the staging path swapped for a symlink between the check
// and the mount: the stage refuses it, and nothing is made or mounted
// where the symlink points.
func TestStageDoesNotFollowASymlinkSwappedInAfterTheCheck(t *testing.T) {
	e := newEnv(t)
	elsewhere := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(elsewhere) }) // what the old code mounted there
	img, _ := loop(t, 64)
	req := e.stageReq("vol-s", img, "vol-s")
	dir := filepath.Dir(req.StagingPath)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	e.fencers = swapOnChoose{FencerFactory: e.fencers, dir: dir, elsewhere: elsewhere}
	e.start()
	_, err := e.m.Stage(context.Background(), req)
	wantCode(t, err, codes.InvalidArgument, "symlink", "refused")
	if ents, _ := os.ReadDir(elsewhere); len(ents) != 0 || isMounted(t, filepath.Join(elsewhere, "globalmount")) {
		t.Fatalf("the stage followed the swapped symlink: %v made where it points", ents)
	}
}

// swapped makes dir/<name> under the kubelet root resolve, through a
// symlink put in place of dir after the path was checked, to a mounted
// filesystem elsewhere, and returns that mount point. The filesystem
// stands for the node's root.
func swapped(t *testing.T, e *env, dir, name string) (checked, victim string) {
	t.Helper()
	checked = filepath.Join(dir, name)
	if err := os.MkdirAll(checked, 0o750); err != nil {
		t.Fatal(err)
	}
	if p, err := confine(e.kubelet, "staging path", checked); err != nil || p != checked {
		t.Fatalf("the path does not pass the check before the swap: %q %v", p, err)
	}
	elsewhere := t.TempDir()
	victim = filepath.Join(elsewhere, name)
	mountExt4(t, victim)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, dir); err != nil {
		t.Fatal(err)
	}
	return checked, victim
}

// The filesystem stop of a lost claim acts on the staging path checked at
// its stage; a directory on it swapped for a symlink since must not make
// the stop remount or shut down the filesystem the symlink leads to.
func TestFilesystemStopDoesNotFollowASwappedStagingPath(t *testing.T) {
	e := newEnv(t)
	staging, victim := swapped(t, e, filepath.Dir(e.staging("vol-stop")), "globalmount")
	c := &Claim{Volume: "vol-stop", StagingPath: staging, Phase: PhaseStaged, FsType: "ext4"}
	e.m.lose(c, nil, &fence.LostError{Device: "/dev/null", Reason: "test: taken over"})
	if err := os.WriteFile(filepath.Join(victim, "probe"), []byte("x"), 0o644); err != nil {
		t.Fatalf("the filesystem behind the swapped staging path was stopped: %v", err)
	}
	if !isMounted(t, victim) {
		t.Fatal("the filesystem behind the swapped staging path was unmounted")
	}
}

// An unmount of a path checked earlier (the staging path at unstage, a
// failed stage's undo) does not follow a symlink swapped in since.
func TestUnmountDoesNotFollowASwappedPath(t *testing.T) {
	e := newEnv(t)
	staging, victim := swapped(t, e, filepath.Dir(e.staging("vol-umount")), "globalmount")
	err := e.m.unmountIfMounted(staging)
	wantCode(t, err, codes.InvalidArgument, "symlink")
	if !isMounted(t, victim) {
		t.Fatal("the unmount followed the swapped symlink and unmounted the filesystem it leads to")
	}
	if err := os.WriteFile(filepath.Join(victim, "probe"), []byte("x"), 0o644); errors.Is(err, unix.EROFS) || err != nil {
		t.Fatalf("the filesystem behind the swapped path: %v", err)
	}
}

// Forgetting the claim of a vanished disk detaches its mounts; a staging
// path swapped for a symlink since its stage must not have the detach
// land on the filesystem the symlink leads to.
func TestVanishedDiskCleanupDoesNotFollowASwappedPath(t *testing.T) {
	e := newEnv(t)
	staging, victim := swapped(t, e, filepath.Dir(e.staging("vol-gone")), "globalmount")
	c := &Claim{Volume: "vol-gone", StagingPath: staging, Phase: PhaseStaged, FsType: "ext4"}
	e.m.cleanupGone(c, errors.New("test: the disk was detached"))
	if !isMounted(t, victim) {
		t.Fatal("the cleanup followed the swapped symlink and detached the filesystem it leads to")
	}
}

// A staging path directly under the kubelet root is unmounted through the
// root's own descriptor.
func TestUnmountOfAPathDirectlyUnderTheKubeletRoot(t *testing.T) {
	e := newEnv(t)
	p := e.path("staging")
	mountExt4(t, p)
	if err := e.m.unmountIfMounted(p); err != nil {
		t.Fatal(err)
	}
	if isMounted(t, p) {
		t.Fatal("still mounted")
	}
}
