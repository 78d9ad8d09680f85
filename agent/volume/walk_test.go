package volume

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// Without openat2 (ENOSYS under a seccomp filter that does not know it),
// the element-by-element walk keeps openat2's rules: nothing outside the
// root, no symlink anywhere on the path.
func TestWalkBeneathKeepsTheRulesOfOpenat2(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "a/b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "a/b/f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/", filepath.Join(root, "a/up")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("b/f", filepath.Join(root, "a/lf")); err != nil {
		t.Fatal(err)
	}
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	for _, c := range []struct {
		name string
		want error
	}{
		{"a/b/f", nil},
		{"a/b", nil},
		{".", nil},
		{"a/up/etc", unix.ENOTDIR},
		{"a/lf", unix.ELOOP},
		{"a/../..", unix.EXDEV},
		{"/etc", unix.EXDEV},
	} {
		fd, err := walkBeneath(rfd, c.name, unix.O_PATH, 0)
		if err == nil {
			unix.Close(fd)
		}
		if !errors.Is(err, c.want) && !(c.want == nil && err == nil) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
	}
}
