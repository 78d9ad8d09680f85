package volume

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// mountExt4 makes an ext4 filesystem on a fresh loop device and mounts it
// at dir (unmounted when the test ends).
func mountExt4(t *testing.T, dir string) {
	t.Helper()
	_, dev := loop(t, 64)
	if out, err := exec.Command("mkfs.ext4", "-q", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v: %s", dev, err, out)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev, dir, "ext4", 0, ""); err != nil {
		t.Fatalf("mounting %s at %s: %v", dev, dir, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}

// A fenced volume's filesystem is stopped at its staging path; when the
// path is no longer a mount point (an unstage killed after its unmount,
// then the claim found lost), the filesystem holding the directory -- on
// a node, its root -- is left alone. Here that filesystem is one of the
// test's own, on a loop device.
func TestStopFilesystemTouchesOnlyAMountedStagingPath(t *testing.T) {
	e := newEnv(t)
	parent := e.path("parent")
	mountExt4(t, parent)
	staging := filepath.Join(parent, "staging")
	if err := os.Mkdir(staging, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := e.m.host.StopFilesystem(staging, ""); err != nil {
		t.Fatalf("stopping an unmounted staging path: %v", err)
	}
	if err := os.WriteFile(filepath.Join(parent, "probe"), []byte("x"), 0o644); err != nil {
		t.Fatalf("the filesystem holding an unmounted staging path was stopped: %v", err)
	}
	if err := e.m.host.StopFilesystem(filepath.Join(parent, "gone"), ""); err != nil {
		t.Fatalf("stopping a staging path that does not exist: %v", err)
	}

	mountExt4(t, staging)
	if err := e.m.host.StopFilesystem(staging, ""); err != nil {
		t.Fatalf("stopping a mounted staging path: %v", err)
	}
	if err := os.WriteFile(filepath.Join(staging, "late"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("a write to the stopped filesystem got %v, want EROFS", err)
	}
	if err := os.WriteFile(filepath.Join(parent, "probe"), []byte("y"), 0o644); err != nil {
		t.Fatalf("stopping the staging path's filesystem stopped its parent's too: %v", err)
	}
}
