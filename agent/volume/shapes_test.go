package volume

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// testDriver is the CSI driver name in the tests' staging paths.
const testDriver = "cloud.whitesky.csi"

// staging is the staging path the kubelet gives the filesystem volume
// with handle name under the test's kubelet root.
func (e *env) staging(name string) string { return kubeletpath.Staging(e.kubelet, testDriver, name) }

// blockStaging is the staging path the kubelet gives raw block volume pv.
func (e *env) blockStaging(pv string) string { return kubeletpath.BlockStaging(e.kubelet, pv) }

// target is the target path the kubelet gives filesystem volume pv in pod.
func (e *env) target(pod, pv string) string { return kubeletpath.Target(e.kubelet, pod, pv) }

// blockTarget is the target path the kubelet gives raw block volume pv in
// pod.
func (e *env) blockTarget(pv, pod string) string { return kubeletpath.BlockTarget(e.kubelet, pv, pod) }

// The kubelet's own directories, which a volume must never cover: its
// client certificate and key (pki), another pod's emptyDir, the plugin
// registration directory. Each holds a file the test checks afterwards.
func (e *env) kubeletOwnDirs(t *testing.T) []string {
	t.Helper()
	dirs := []string{
		e.path("pki"),
		e.path("pods/22222222-3333-4444-5555-666666666666/volumes/kubernetes.io~empty-dir/x"),
		e.path("plugins_registry"),
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "kubelet-file"), []byte("the kubelet's"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dirs
}

// untouched fails the test when p was mounted over or its file changed.
func untouched(t *testing.T, p string) {
	t.Helper()
	if isMounted(t, p) {
		t.Errorf("%s was mounted over", p)
	}
	if b, err := os.ReadFile(filepath.Join(p, "kubelet-file")); err != nil || string(b) != "the kubelet's" {
		t.Errorf("%s: the kubelet's file reads %q, %v", p, b, err)
	}
}

// A caller of the agent's socket cannot publish a staged volume, whose
// content its user controls, over a directory of the kubelet's that is no
// pod's CSI volume: the kubelet's pki, another pod's emptyDir, the plugin
// registry. Each is refused with INVALID_ARGUMENT naming the shape the
// kubelet gives a target, and nothing is mounted.
func TestPublishOnlyAtTheKubeletsTargetShapes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 64)
	req := e.stageReq("vol-1", img, "vol-1")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	own := e.kubeletOwnDirs(t)
	for _, target := range append(slices.Clone(own),
		e.path("pods/p/volumes/kubernetes.io~csi/pv/mount/deeper"), // below a pod's CSI volume
		e.kubelet+"/pods/p/volumes/kubernetes.io~csi/./mount",      // an element that is no element
		e.kubelet+"/pods//volumes/kubernetes.io~csi/pv/mount",      // an empty pod uid
		e.blockTarget("pv", "p"),                                   // a raw block volume's target, for a filesystem volume
	) {
		t.Run(strings.TrimPrefix(target, e.kubelet), func(t *testing.T) {
			err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: target})
			if isMounted(t, target) {
				t.Errorf("%s was mounted over", target)
			}
			wantCode(t, err, codes.InvalidArgument, "is not where the kubelet publishes a filesystem volume", e.kubelet+"/pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount")
		})
	}
	for _, d := range own {
		untouched(t, d)
	}
	// ".." is refused before any shape is looked at.
	err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: e.kubelet + "/pods/p/volumes/kubernetes.io~csi/../../../../pki/x/y/mount"})
	wantCode(t, err, codes.InvalidArgument, "\"..\"")
	// The kubelet's own shape is published.
	target := e.target("33333333-4444-5555-6666-777777777777", "pv-1")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: target}); err != nil || !isMounted(t, target) {
		t.Fatalf("publish at %s: %v", target, err)
	}
}

// A raw block volume is published only at the kubelet's raw block target
// shape.
func TestBlockPublishOnlyAtTheKubeletsTargetShape(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 16)
	req := StageRequest{Volume: "vol-b", Locator: Locator{BackingFile: img}, StagingPath: e.blockStaging("pv-b"), Block: true, AllowUnfenced: true}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{
		e.path("pki/kubelet-client-current.pem"),
		e.path("plugins_registry/cloud.whitesky.csi-reg.sock"),
		e.path("plugins/kubernetes.io/csi/volumeDevices/publish/pv-b"),
		e.target("p", "pv-b"),
	} {
		err := e.m.Publish(ctx, PublishRequest{Volume: "vol-b", StagingPath: req.StagingPath, TargetPath: target, Block: true})
		wantCode(t, err, codes.InvalidArgument, "is not where the kubelet publishes a raw block volume", kubeletpath.BlockTargetShape)
		if _, err := os.Lstat(target); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s was made: %v", target, err)
		}
	}
}

// A stage mounts only at the kubelet's staging shape of the volume's kind:
// a filesystem volume under its driver's plugins/kubernetes.io/csi/<driver>/<hash>/globalmount,
// a raw block volume at plugins/kubernetes.io/csi/volumeDevices/staging/<pv>.
// The kubelet's own directories and every other shape are refused with
// INVALID_ARGUMENT, before the disk is touched.
func TestStageOnlyAtTheKubeletsStagingShapes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	own := e.kubeletOwnDirs(t)
	for _, staging := range append(slices.Clone(own),
		e.path("plugins/kubernetes.io/csi/globalmount"),
		e.path("plugins/kubernetes.io/csi/cloud.whitesky.csi/globalmount"),      // no volume directory
		e.path("plugins/kubernetes.io/csi/volumeDevices/publish/globalmount"),   // raw block publications
		e.path("plugins/kubernetes.io/csi/cloud.whitesky.csi/h/globalmount/x"),  // below a staging path
		e.kubelet+"/plugins/kubernetes.io/csi/cloud.whitesky.csi/./globalmount", // an element that is no element
		e.path("plugins/kubernetes.io/csi/Not_A_Driver/h/globalmount"),          // no CSI driver name
		e.target("p", "pv"),  // a pod's volume
		e.blockStaging("pv"), // a raw block volume's
	) {
		t.Run(strings.TrimPrefix(staging, e.kubelet), func(t *testing.T) {
			req := e.stageReq("vol-s", img, "vol-s")
			req.StagingPath = staging
			_, err := e.m.Stage(ctx, req)
			if isMounted(t, staging) {
				t.Errorf("%s was mounted over", staging)
				unix.Unmount(staging, 0)
				e.m.Store().Delete("vol-s")
			}
			wantCode(t, err, codes.InvalidArgument, "is not where the kubelet stages a filesystem volume", e.kubelet+"/"+kubeletpath.StagingShape)
		})
	}
	for _, staging := range []string{e.staging("vol-s"), e.path("plugins/kubernetes.io/csi/volumeDevices/staging"), e.path("pki/x")} {
		req := StageRequest{Volume: "vol-s", Locator: Locator{BackingFile: img}, StagingPath: staging, Block: true, AllowUnfenced: true}
		_, err := e.m.Stage(ctx, req)
		wantCode(t, err, codes.InvalidArgument, "is not where the kubelet stages a raw block volume", kubeletpath.BlockStagingShape)
	}
	for _, d := range own {
		untouched(t, d)
	}
	if got := blkid(t, dev, "TYPE"); got != "" {
		t.Fatalf("a refused stage made a %s filesystem", got)
	}
	if c, _ := e.m.Store().Get("vol-s"); c != nil {
		t.Fatalf("a refused stage left a claim: %+v", c)
	}
}

// statfsFlags are the ST_* flags of the mount at p.
func statfsFlags(t *testing.T, p string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Flags
}

// A filesystem volume is staged and published nosuid,nodev: a set-uid
// program or a device node its user put on it counts for nothing on the
// host or in a pod. Mount flags suid and dev ask otherwise and get it. A
// raw block volume's publication stays a usable device node.
func TestStagedAndPublishedFilesystemsAreNosuidNodev(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 64)
	req := e.stageReq("vol-h", img, "vol-h")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	target := e.target("p", "pv-h")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-h", StagingPath: req.StagingPath, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{req.StagingPath, target} {
		if f := statfsFlags(t, p); f&unix.ST_NOSUID == 0 || f&unix.ST_NODEV == 0 {
			t.Errorf("%s is mounted with flags %#x: not nosuid,nodev", p, f)
		}
	}

	img2, _ := loop(t, 64)
	req2 := e.stageReq("vol-d", img2, "vol-d")
	req2.MountFlags = []string{"suid", "dev"}
	if _, err := e.m.Stage(ctx, req2); err != nil {
		t.Fatal(err)
	}
	target2 := e.target("p", "pv-d")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-d", StagingPath: req2.StagingPath, TargetPath: target2, MountFlags: req2.MountFlags}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{req2.StagingPath, target2} {
		if f := statfsFlags(t, p); f&(unix.ST_NOSUID|unix.ST_NODEV) != 0 {
			t.Errorf("%s, asked suid and dev, is mounted with flags %#x", p, f)
		}
	}

	img3, dev3 := loop(t, 16)
	req3 := StageRequest{Volume: "vol-b", Locator: Locator{BackingFile: img3}, StagingPath: e.blockStaging("pv-b"), Block: true, AllowUnfenced: true}
	if _, err := e.m.Stage(ctx, req3); err != nil {
		t.Fatal(err)
	}
	target3 := e.blockTarget("pv-b", "p")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-b", StagingPath: req3.StagingPath, TargetPath: target3, Block: true}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(target3)
	if err != nil {
		t.Fatalf("the raw block publication of %s cannot be opened: %v", dev3, err)
	}
	f.Close()
}
