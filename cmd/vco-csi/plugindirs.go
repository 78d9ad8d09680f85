package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// runPluginDirs is `vco-csi plugin-dirs`, the node pod's init container:
// it gives the node plugin's own host directories (its CSI socket's and
// its registration socket's, which the kubelet made as root) to the
// plugin's user, which runs as no root. Each DIR owned by root gets mode
// 0750 and owner UID:GID, and so do the sockets and files directly in it,
// left by an earlier plugin that ran as root. Nothing is followed: a symlink, a
// directory or a file of more than one link inside stays as it is and is
// named. See docs/csi-addon.md, "Users and groups".
func runPluginDirs(args []string, out, errs io.Writer) int {
	fs := flag.NewFlagSet("plugin-dirs", flag.ContinueOnError)
	fs.SetOutput(errs)
	owner := fs.String("owner", "", "UID:GID, numeric, to own the directories (the node plugin's user and group; not root)")
	fs.Usage = func() {
		fmt.Fprintln(errs, "usage: vco-csi plugin-dirs --owner=UID:GID DIR...")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	uid, gid, err := parseOwner(*owner)
	if err == nil && fs.NArg() == 0 {
		err = errors.New("name the plugin's directories")
	}
	if err != nil {
		fmt.Fprintf(errs, "vco-csi plugin-dirs: %v\n", err)
		return 2
	}
	for _, dir := range fs.Args() {
		if err := ownDir(dir, uid, gid, out); err != nil {
			fmt.Fprintf(errs, "vco-csi plugin-dirs: %v\n", err)
			return 1
		}
	}
	return 0
}

func parseOwner(s string) (uid, gid int, err error) {
	u, g, ok := strings.Cut(s, ":")
	if !ok {
		return 0, 0, fmt.Errorf("--owner=%q is not UID:GID", s)
	}
	uid, err1 := strconv.Atoi(u)
	gid, err2 := strconv.Atoi(g)
	if err1 != nil || err2 != nil || uid <= 0 || gid <= 0 {
		return 0, 0, fmt.Errorf("--owner=%q: give a numeric UID:GID other than root's", s)
	}
	return uid, gid, nil
}

// ownDir gives dir, and the sockets and single-link files directly in it,
// to uid:gid, acting on descriptors only. A directory already the
// plugin's (uid:gid, 0750: a later start of the pod) is left as it is: the
// init container, root without CAP_DAC_OVERRIDE or CAP_FOWNER, could not
// read or chmod it, and what is in it is the plugin's own. Any other
// owner than root (as the kubelet makes it) is refused, naming it.
func ownDir(dir string, uid, gid int, out io.Writer) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("the plugin directory %s: %w (is it mounted?)", dir, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("the plugin directory %s is %s, not a directory", dir, notOwned(st))
	case int(st.Uid) == uid && int(st.Gid) == gid && st.Mode&0o7777 == 0o750:
		fmt.Fprintf(out, "%s: already mode 0750, owner %d:%d\n", dir, uid, gid)
		return nil
	case st.Uid != 0:
		return fmt.Errorf("the plugin directory %s belongs to %d:%d, mode %#o: neither root's, as the kubelet makes it, nor %d:%d 0750; "+
			"on the node, remove it (the pod's next start makes it again) or give it to %d:%d with mode 0750", dir, st.Uid, st.Gid, st.Mode&0o7777, uid, gid, uid, gid)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening the plugin directory %s: %w", dir, err)
	}
	f := os.NewFile(uintptr(fd), dir)
	defer f.Close()
	n, err := ownEntries(f, uid, gid, out)
	if err != nil {
		return err
	}
	if err := unix.Fchmod(fd, 0o750); err != nil {
		return fmt.Errorf("chmod 0750 %s: %w", dir, err)
	}
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return fmt.Errorf("giving %s to %d:%d: %w (the init container needs CAP_CHOWN)", dir, uid, gid, err)
	}
	fmt.Fprintf(out, "%s: mode 0750, owner %d:%d, and %d entries of it\n", dir, uid, gid, n)
	return nil
}

// ownEntries gives the sockets and single-link files directly in the
// directory d to uid:gid, and names what it leaves.
func ownEntries(d *os.File, uid, gid int, out io.Writer) (int, error) {
	names, err := d.Readdirnames(-1)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", d.Name(), err)
	}
	fd := int(d.Fd())
	n := 0
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return n, fmt.Errorf("%s/%s: %w", d.Name(), name, err)
		}
		switch t := st.Mode & unix.S_IFMT; {
		case (t == unix.S_IFSOCK || t == unix.S_IFREG) && st.Nlink == 1:
			// A second link would make the chown reach a file or socket
			// outside the directory (the kubelet's own sockets).
			if err := unix.Fchownat(fd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return n, fmt.Errorf("giving %s/%s to %d:%d: %w (the init container needs CAP_CHOWN)", d.Name(), name, uid, gid, err)
			}
			n++
		default:
			fmt.Fprintf(out, "%s/%s left as it is: %s\n", d.Name(), name, notOwned(st))
		}
	}
	return n, nil
}

func notOwned(st unix.Stat_t) string {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		return "a symlink"
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFREG:
		return fmt.Sprintf("a file of %d links", st.Nlink)
	case unix.S_IFSOCK:
		return fmt.Sprintf("a socket of %d links", st.Nlink)
	}
	return fmt.Sprintf("not a socket or a file (mode %#o)", st.Mode)
}
