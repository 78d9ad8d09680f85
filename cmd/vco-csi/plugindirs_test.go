package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

func owner(t *testing.T, p string) (uid, gid uint32, mode os.FileMode) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	return st.Uid, st.Gid, fi.Mode().Perm()
}

// pluginDirs makes what the kubelet and a plugin that ran as root leave:
// the two directories, root's, holding a socket, the kube-events state,
// a symlink to a file elsewhere, a subdirectory and a hard link.
type pluginDirs struct{ csi, reg, secret string }

func makePluginDirs(t *testing.T) pluginDirs {
	t.Helper()
	base := t.TempDir()
	d := pluginDirs{csi: filepath.Join(base, "csi"), reg: filepath.Join(base, "registration")}
	elsewhere := filepath.Join(base, "elsewhere")
	for _, dir := range []string{d.csi, d.reg, elsewhere, filepath.Join(d.csi, "sub")} {
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	d.secret = filepath.Join(elsewhere, "secret")
	for _, f := range []string{filepath.Join(d.csi, "kube-events.json"), d.secret} {
		if err := os.WriteFile(f, []byte("{}"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ln, err := net.Listen("unix", filepath.Join(d.csi, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	if err := os.Symlink(d.secret, filepath.Join(d.csi, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(d.secret, filepath.Join(d.reg, "hardlink")); err != nil {
		t.Fatal(err)
	}
	return d
}

// wantOwner checks the owner (and, when mode is not 0, the mode) of paths.
func wantOwner(t *testing.T, uid, gid uint32, mode os.FileMode, paths ...string) {
	t.Helper()
	for _, p := range paths {
		if u, g, m := owner(t, p); u != uid || g != gid || (mode != 0 && m != mode) {
			t.Errorf("%s: %d:%d %o, want %d:%d %o", p, u, g, m, uid, gid, mode)
		}
	}
}

// plugin-dirs, the node pod's init container, gives the plugin's own host
// directories and what a root plugin left in them (its sockets, the
// kube-events state) to the plugin's user; it follows nothing: a
// symlink's target, a hard-linked file and a subdirectory keep their
// owner, and it says so. At the pod's next start it changes nothing;
// a directory of another owner it refuses.
func TestPluginDirsGivesTheDirectoriesToThePlugin(t *testing.T) {
	hosttest.NeedRoot(t, "chown needs root")
	d := makePluginDirs(t)
	var out, errs bytes.Buffer
	if rc := runPluginDirs([]string{"--owner=65532:573", d.csi, d.reg}, &out, &errs); rc != 0 {
		t.Fatalf("plugin-dirs: exit %d\n%s%s", rc, out.String(), errs.String())
	}
	wantOwner(t, 65532, 573, 0o750, d.csi, d.reg)
	wantOwner(t, 65532, 573, 0, filepath.Join(d.csi, "kube-events.json"), filepath.Join(d.csi, "csi.sock"))
	wantOwner(t, 0, 0, 0, d.secret, filepath.Join(d.csi, "link"), filepath.Join(d.csi, "sub"))
	for _, want := range []string{"link left as it is: a symlink", "sub left as it is: a directory", "hardlink left as it is: a file of 2 links"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("plugin-dirs does not say %q:\n%s", want, out.String())
		}
	}
	out.Reset()
	if rc := runPluginDirs([]string{"--owner=65532:573", d.csi, d.reg}, &out, &errs); rc != 0 || strings.Count(out.String(), "already") != 2 {
		t.Fatalf("plugin-dirs again: exit %d\n%s%s", rc, out.String(), errs.String())
	}
	if err := os.Chown(d.reg, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	errs.Reset()
	if rc := runPluginDirs([]string{"--owner=65532:573", d.reg}, &out, &errs); rc != 1 || !strings.Contains(errs.String(), "belongs to 1000:1000") {
		t.Errorf("plugin-dirs over a directory of 1000:1000: exit %d, %q", rc, errs.String())
	}
}

func TestPluginDirsRefuses(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		rc   int
		says string
	}{
		{[]string{"--owner=0:0", dir}, 2, "other than root's"},
		{[]string{"--owner=65532", dir}, 2, "not UID:GID"},
		{[]string{"--owner=nonroot:nonroot", dir}, 2, "numeric"},
		{[]string{"--owner=65532:65532"}, 2, "name the plugin's directories"},
		{[]string{"--owner=65532:65532", link}, 1, "is a symlink, not a directory"},
		{[]string{"--owner=65532:65532", filepath.Join(dir, "absent")}, 1, "no such file"},
	} {
		var out, errs bytes.Buffer
		if rc := runPluginDirs(c.args, &out, &errs); rc != c.rc || !strings.Contains(errs.String(), c.says) {
			t.Errorf("plugin-dirs %q: exit %d, %q; want exit %d saying %q", c.args, rc, errs.String(), c.rc, c.says)
		}
	}
	if u, _, _ := owner(t, dir); u != uint32(os.Getuid()) {
		t.Errorf("a refused call changed %s", dir)
	}
}
