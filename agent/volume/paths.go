package volume

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// confine checks that p, a staging or target path, lies strictly under the
// kubelet root, and returns it with symlinks in its existing parents
// resolved. ".." is refused outright; the nearest existing parent is
// resolved with EvalSymlinks and compared with the resolved root, so a
// symlink planted anywhere along the path cannot point a mount elsewhere;
// the last element itself may not be a symlink.
func confine(root, what, p string) (string, error) {
	if p == "" {
		return "", agenterr.New(agenterr.InvalidArgument, "%s is required", what)
	}
	// A NUL byte or an over-long path is refused here: the kernel would
	// refuse it later, as EINVAL or ENAMETOOLONG, read as an internal error.
	if strings.IndexByte(p, 0) >= 0 {
		return "", agenterr.New(agenterr.InvalidArgument, "%s %q holds a NUL byte", what, p)
	}
	if len(p) >= unix.PathMax {
		return "", agenterr.New(agenterr.InvalidArgument, "%s is %d bytes long; paths are limited to %d", what, len(p), unix.PathMax-1)
	}
	for _, part := range strings.Split(p, "/") {
		if len(part) > 255 {
			return "", agenterr.New(agenterr.InvalidArgument, "%s has an element of %d bytes; each is limited to 255", what, len(part))
		}
	}
	if !filepath.IsAbs(p) {
		return "", agenterr.New(agenterr.InvalidArgument, "%s %q is not an absolute path", what, p)
	}
	for _, part := range strings.Split(p, "/") {
		if part == ".." {
			return "", agenterr.New(agenterr.InvalidArgument, "%s %q contains \"..\"; give the path without it", what, p)
		}
	}
	rroot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", agenterr.New(agenterr.FailedPrecondition, "the kubelet root %s is not usable (%v): set volumes.kubelet_root", root, err)
	}
	clean := filepath.Clean(p)
	base := filepath.Base(clean)
	parent, rest, err := resolveParent(filepath.Dir(clean))
	if err != nil {
		return "", agenterr.New(agenterr.InvalidArgument, "%s %q: %v", what, p, err)
	}
	resolved := filepath.Join(parent, rest, base)
	if !strings.HasPrefix(resolved, rroot+"/") {
		return "", agenterr.New(agenterr.InvalidArgument, "%s %q resolves to %s, outside the kubelet directory %s", what, p, resolved, root)
	}
	if st, err := os.Lstat(resolved); err == nil && st.Mode()&fs.ModeSymlink != 0 {
		return "", agenterr.New(agenterr.InvalidArgument, "%s %q is a symlink; the agent mounts only on real directories and files", what, p)
	}
	return resolved, nil
}

// resolveParent resolves the longest existing prefix of dir and returns it
// with the part that does not exist yet.
func resolveParent(dir string) (string, string, error) {
	rest := ""
	cur := dir
	for {
		r, err := filepath.EvalSymlinks(cur)
		if err == nil {
			return r, rest, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", "", err
		}
		up := filepath.Dir(cur)
		if up == cur {
			return "", "", err
		}
		rest = filepath.Join(filepath.Base(cur), rest)
		cur = up
	}
}
