package volume

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// confine checks that p, a staging or target path, lies strictly under the
// kubelet root, and returns it with symlinks in its existing parents
// resolved. ".." is refused outright; the nearest existing parent is
// resolved with EvalSymlinks and compared with the resolved root, so a
// symlink planted anywhere along the path cannot point a mount elsewhere;
// the last element itself may not be a symlink. This is the check; each
// act on the path later resolves it again, refusing any symlink (see
// openBeneath below).
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

// confineStaging is confine for a stage's staging path, which must also
// have the shape the kubelet gives a staging path of the volume's kind
// (package kubeletpath): a filesystem volume's
// plugins/kubernetes.io/csi/<driver>/<hash>/globalmount, a raw block
// volume's plugins/kubernetes.io/csi/volumeDevices/staging/<pv>. Any
// other directory under the kubelet root (its pki/, plugins_registry/, a
// pod's volumes) is refused: a volume, whose content its user controls,
// is never mounted over it.
func confineStaging(root, p string, block bool) (string, error) {
	resolved, err := confine(root, "staging path", p)
	if err != nil {
		return "", err
	}
	shape := kubeletpath.StagingShape
	if block {
		shape = kubeletpath.BlockStagingShape
	}
	if rel, ok := shapeRel(root, resolved); !ok || !kubeletpath.IsStaging(rel, block) {
		return "", agenterr.New(agenterr.InvalidArgument, "staging path %q is not where the kubelet stages a %s volume, %s/%s: refused",
			p, kindName(block), root, shape)
	}
	return resolved, nil
}

// confineTarget is confine for a publish's target path, which must also
// have the shape the kubelet gives a pod's CSI volume of the volume's kind:
// a filesystem volume's pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount,
// a raw block volume's plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>.
func confineTarget(root, p string, block bool) (string, error) {
	resolved, err := confine(root, "target path", p)
	if err != nil {
		return "", err
	}
	shape := kubeletpath.TargetShape
	if block {
		shape = kubeletpath.BlockTargetShape
	}
	rel, ok := shapeRel(root, resolved)
	if isBlock, shaped := kubeletpath.IsTarget(rel); !ok || !shaped || isBlock != block {
		return "", agenterr.New(agenterr.InvalidArgument, "target path %q is not where the kubelet publishes a %s volume to a pod, %s/%s: refused",
			p, kindName(block), root, shape)
	}
	return resolved, nil
}

// shapeRel is p, a path confine returned, relative to the resolved
// kubelet root.
func shapeRel(root, p string) (string, bool) {
	_, rel, err := relBeneath(root, p)
	return rel, err == nil
}

// pubTargetShape reports whether rel (a target relative to the kubelet
// root) has the form the kubelet gives a pod's CSI volume, and whether it
// is a raw block volume's (kubeletpath.IsTarget).
func pubTargetShape(rel string) (block, ok bool) { return kubeletpath.IsTarget(rel) }

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

// Acting on a path. confine checks a path once; the agent acts on it
// later (mkdir, mount, unmount, the filesystem stop), sometimes much later
// (a claim's staging path is stopped when its fence is lost). Whoever can
// write under the kubelet root could swap a directory on that path for a
// symlink in between, and a later act by name would follow it. So every
// act resolves the path again from the kubelet root with openat2
// (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS: a symlink anywhere on the path, or
// an escape from the root, is refused) and acts on the descriptor it got:
// a mount or unmount goes through /proc/self/fd/N or the mount API's
// descriptors, never through the name (docs/security.md).

// resolveBeneath is how every act resolves a path under the kubelet root.
const resolveBeneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// relBeneath splits p, a path confine returned, into the resolved kubelet
// root and p relative to it.
func relBeneath(root, p string) (string, string, error) {
	rroot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", "", agenterr.New(agenterr.FailedPrecondition, "the kubelet root %s is not usable (%v): set volumes.kubelet_root", root, err)
	}
	clean := filepath.Clean(p)
	if clean == rroot {
		// The parent of a path directly under the root.
		return rroot, ".", nil
	}
	rel, ok := strings.CutPrefix(clean, rroot+"/")
	if !ok || rel == "" {
		return "", "", agenterr.New(agenterr.InvalidArgument, "%s is not under the kubelet directory %s; refused", p, root)
	}
	return rroot, rel, nil
}

// openat2 opens name under dir with the act's resolution rules. Where the
// kernel or a seccomp filter has no openat2 (ENOSYS: the packaged unit's
// filter on a systemd that does not know the call), the same rules are
// kept by walking the path one element at a time.
func openat2(dir int, name string, flags int, mode uint32) (int, error) {
	for {
		fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: resolveBeneath})
		switch err {
		case unix.EINTR, unix.EAGAIN:
			continue
		case unix.ENOSYS:
			return walkBeneath(dir, name, flags, mode)
		}
		return fd, err
	}
}

// walkBeneath resolves name under dir as openat2 with resolveBeneath
// does: an absolute name or a ".." element leaves dir (EXDEV), and no
// element may be a symlink (each is opened with O_NOFOLLOW; a symlink
// where a directory must be is ENOTDIR, a symlink at the end ELOOP).
func walkBeneath(dir int, name string, flags int, mode uint32) (int, error) {
	if filepath.IsAbs(name) {
		return -1, unix.EXDEV
	}
	parts := strings.Split(filepath.Clean(name), "/")
	cur, owned := dir, false
	for i, p := range parts {
		if p == ".." {
			if owned {
				unix.Close(cur)
			}
			return -1, unix.EXDEV
		}
		var fd int
		var err error
		if i < len(parts)-1 {
			fd, err = unix.Openat(cur, p, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		} else {
			fd, err = unix.Openat(cur, p, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
		}
		if owned {
			unix.Close(cur)
		}
		if err != nil {
			return -1, err
		}
		cur, owned = fd, true
	}
	var st unix.Stat_t
	if err := unix.Fstat(cur, &st); err != nil {
		unix.Close(cur)
		return -1, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		unix.Close(cur)
		return -1, unix.ELOOP
	}
	return cur, nil
}

// refusedPath turns openat2's refusals into errors that say what happened.
func refusedPath(p string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		return agenterr.New(agenterr.InvalidArgument, "%s is or passes through a symlink now (it was checked without one); the agent does not follow it: refused. Something under the kubelet root replaced a directory", p)
	case errors.Is(err, unix.EXDEV):
		return agenterr.New(agenterr.InvalidArgument, "%s leads outside the kubelet root now; refused", p)
	case errors.Is(err, unix.ENOTDIR):
		return agenterr.New(agenterr.InvalidArgument, "%s: an element of the path is not a directory; refused", p)
	}
	return fmt.Errorf("opening %s: %w", p, err)
}

// openBeneath opens p, a path under root that confine returned, without
// following any symlink and without leaving root. Errors wrap the errno,
// so fs.ErrNotExist can be tested.
func openBeneath(root, p string, flags int) (*os.File, error) {
	rroot, rel, err := relBeneath(root, p)
	if err != nil {
		return nil, err
	}
	rfd, err := unix.Open(rroot, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, agenterr.New(agenterr.FailedPrecondition, "the kubelet root %s is not usable (%v): set volumes.kubelet_root", root, err)
	}
	defer unix.Close(rfd)
	fd, err := openat2(rfd, rel, flags, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, &fs.PathError{Op: "open", Path: p, Err: err}
		}
		return nil, refusedPath(p, err)
	}
	return os.NewFile(uintptr(fd), p), nil
}

// mkdirBeneath makes the directory p and its missing parents under root,
// one element at a time through descriptors, and returns p opened with
// O_PATH. An element that is a symlink is refused, never followed.
func mkdirBeneath(root, p string, mode uint32) (*os.File, error) {
	rroot, rel, err := relBeneath(root, p)
	if err != nil {
		return nil, err
	}
	cur, err := unix.Open(rroot, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, agenterr.New(agenterr.FailedPrecondition, "the kubelet root %s is not usable (%v): set volumes.kubelet_root", root, err)
	}
	for _, name := range strings.Split(rel, "/") {
		next, err := openat2(cur, name, unix.O_PATH|unix.O_DIRECTORY, 0)
		if errors.Is(err, unix.ENOENT) {
			if err = unix.Mkdirat(cur, name, mode); err == nil || errors.Is(err, unix.EEXIST) {
				next, err = openat2(cur, name, unix.O_PATH|unix.O_DIRECTORY, 0)
			}
		}
		unix.Close(cur)
		if err != nil {
			return nil, refusedPath(p, err)
		}
		cur = next
	}
	return os.NewFile(uintptr(cur), p), nil
}

// createBeneath creates (or opens) the regular file p under root, its
// parents made as by mkdirBeneath, and returns it opened with O_PATH.
func createBeneath(root, p string, mode uint32) (*os.File, error) {
	dir, err := mkdirBeneath(root, filepath.Dir(p), 0o750)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	fd, err := openat2(int(dir.Fd()), filepath.Base(p), unix.O_CREAT|unix.O_RDONLY|unix.O_NONBLOCK, mode)
	if err != nil {
		return nil, refusedPath(p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, agenterr.New(agenterr.InvalidArgument, "%s exists and is not a regular file; a raw block volume is published only onto a file", p)
	}
	return openBeneath(root, p, unix.O_PATH)
}

// fdPath names the object f was opened on, for the calls that take a
// path: the kernel follows /proc/self/fd/N to that very object, whatever
// has happened to its name since.
func fdPath(f *os.File) string { return fmt.Sprintf("/proc/self/fd/%d", f.Fd()) }

// isMountRoot reports whether f is the root of a mount (a mount point as
// it is reached by path).
func isMountRoot(f *os.File) (bool, error) {
	var sx unix.Statx_t
	if err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_BASIC_STATS, &sx); err != nil {
		return false, fmt.Errorf("statx %s: %w", f.Name(), err)
	}
	if sx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, fmt.Errorf("statx %s: this kernel does not report mount roots (STATX_ATTR_MOUNT_ROOT, Linux 5.8)", f.Name())
	}
	return sx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

// mountFlags splits mount options as mount(8) does: the generic ones
// become mount(2) flags, the rest the filesystem's data.
var mountFlags = map[string]struct {
	set   bool
	flags uintptr
}{
	"ro": {true, unix.MS_RDONLY}, "rw": {false, unix.MS_RDONLY},
	"nosuid": {true, unix.MS_NOSUID}, "suid": {false, unix.MS_NOSUID},
	"nodev": {true, unix.MS_NODEV}, "dev": {false, unix.MS_NODEV},
	"noexec": {true, unix.MS_NOEXEC}, "exec": {false, unix.MS_NOEXEC},
	"sync": {true, unix.MS_SYNCHRONOUS}, "async": {false, unix.MS_SYNCHRONOUS},
	"dirsync": {true, unix.MS_DIRSYNC},
	"noatime": {true, unix.MS_NOATIME}, "atime": {false, unix.MS_NOATIME},
	"nodiratime": {true, unix.MS_NODIRATIME}, "diratime": {false, unix.MS_NODIRATIME},
	"relatime": {true, unix.MS_RELATIME}, "norelatime": {false, unix.MS_RELATIME},
	"strictatime": {true, unix.MS_STRICTATIME},
	"lazytime":    {true, unix.MS_LAZYTIME}, "nolazytime": {false, unix.MS_LAZYTIME},
	"silent": {true, unix.MS_SILENT}, "loud": {false, unix.MS_SILENT},
	"nosymfollow": {true, unix.MS_NOSYMFOLLOW},
	"defaults":    {false, 0},
}

func splitMountOptions(opts []string) (uintptr, string, error) {
	var flags uintptr
	var data []string
	for _, o := range opts {
		if f, ok := mountFlags[o]; ok {
			if f.set {
				flags |= f.flags
			} else {
				flags &^= f.flags
			}
			continue
		}
		switch o {
		case "bind", "rbind", "remount", "move":
			return 0, "", fmt.Errorf("mount option %q is not one for a filesystem mount", o)
		}
		data = append(data, o)
	}
	return flags, strings.Join(data, ","), nil
}

// bindAttrs are the mount attributes a bind mount takes from its options;
// a filesystem's own options are its staging mount's and are ignored on a
// bind, as mount(8) ignores them.
var bindAttrs = map[string]uint64{
	"ro": unix.MOUNT_ATTR_RDONLY, "nosuid": unix.MOUNT_ATTR_NOSUID, "nodev": unix.MOUNT_ATTR_NODEV,
	"noexec": unix.MOUNT_ATTR_NOEXEC, "nodiratime": unix.MOUNT_ATTR_NODIRATIME, "nosymfollow": unix.MOUNT_ATTR_NOSYMFOLLOW,
}

var bindAtime = map[string]uint64{
	"noatime": unix.MOUNT_ATTR_NOATIME, "relatime": unix.MOUNT_ATTR_RELATIME, "strictatime": unix.MOUNT_ATTR_STRICTATIME,
}

// bindAt bind-mounts src onto target, both given as descriptors: the new
// mount is made detached (open_tree), given its attributes there (so a
// read-only bind is never writable, not even for a moment) and attached
// with move_mount, so no name is resolved at all.
func bindAt(src, target *os.File, opts []string) error {
	attr := unix.MountAttr{}
	for _, o := range opts {
		if a, ok := bindAttrs[o]; ok {
			attr.Attr_set |= a
		}
		if a, ok := bindAtime[o]; ok {
			attr.Attr_set = attr.Attr_set&^unix.MOUNT_ATTR__ATIME | a
			attr.Attr_clr |= unix.MOUNT_ATTR__ATIME
		}
	}
	tree, err := unix.OpenTree(int(src.Fd()), "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return fmt.Errorf("cloning the mount of %s (open_tree): %w", src.Name(), err)
	}
	defer unix.Close(tree)
	if attr.Attr_set != 0 || attr.Attr_clr != 0 {
		if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			return fmt.Errorf("setting %v on the bind mount of %s (mount_setattr): %w", opts, src.Name(), err)
		}
	}
	if err := unix.MoveMount(tree, "", int(target.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("attaching the bind mount of %s at %s (move_mount): %w", src.Name(), target.Name(), err)
	}
	return nil
}

// unmountBeneath unmounts the mount whose root is p (under root), found
// without following symlinks; flags are umount2's (MNT_DETACH). It reports whether there was one; a p that
// does not exist had none. The unmount names p as /proc/self/fd/N/<name>,
// N the descriptor of p's verified parent, with UMOUNT_NOFOLLOW: the
// kernel reaches the very parent directory that was opened, and a symlink
// put in the last element's place since is not followed. (A descriptor of
// the mount itself cannot be used: it keeps the mount busy.)
func unmountBeneath(root, p string, flags int) (bool, error) {
	dir, err := openBeneath(root, filepath.Dir(p), unix.O_PATH|unix.O_DIRECTORY)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer dir.Close()
	name := filepath.Base(p)
	fd, err := openat2(int(dir.Fd()), name, unix.O_PATH, 0)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, refusedPath(p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	mp, err := isMountRoot(f)
	f.Close()
	if err != nil || !mp {
		return false, err
	}
	if err := unix.Unmount(fdPath(dir)+"/"+name, flags|unix.UMOUNT_NOFOLLOW); err != nil {
		return true, fmt.Errorf("unmounting %s: %w", p, err)
	}
	return true, nil
}

// beneathMounter is the manager's mounter: its mounts and unmounts act
// through descriptors opened beneath the kubelet root (see above) instead
// of running mount(8) and umount(8) on names. Listing and mount point
// checks, which only read, are mount-utils' own.
type beneathMounter struct {
	table mount.Interface
	root  string
}

// Mount mounts the filesystem on source at target: target is opened
// beneath the kubelet root and the mount made on /proc/self/fd/N.
func (b beneathMounter) Mount(source, target, fstype string, options []string) error {
	flags, data, err := splitMountOptions(options)
	if err != nil {
		return err
	}
	t, err := openBeneath(b.root, target, unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer t.Close()
	if err := unix.Mount(source, fdPath(t), fstype, flags, data); err != nil {
		return fmt.Errorf("mounting %s (%s) at %s: %w", source, fstype, target, err)
	}
	return nil
}

func (b beneathMounter) IsMountPoint(p string) (bool, error) { return b.table.IsMountPoint(p) }

func (b beneathMounter) List() ([]mount.MountPoint, error) { return b.table.List() }

// Unmount unmounts the mount whose root is target, through its parent's
// descriptor (unmountBeneath); a target that is not a mount point is left
// alone.
func (b beneathMounter) Unmount(target string) error {
	_, err := unmountBeneath(b.root, target, 0)
	return err
}
