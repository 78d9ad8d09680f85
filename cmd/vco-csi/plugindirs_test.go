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

// plugin-dirs, the node pod's init container, gives the plugin's own host
// directories and what a root plugin left in them (its sockets, the
// kube-events state) to the plugin's user; it follows nothing: a
// symlink's target, a hard-linked file and a subdirectory keep their
// owner, and it says so.
func TestPluginDirsGivesTheDirectoriesToThePlugin(t *testing.T) {
	hosttest.NeedRoot(t, "chown needs root")
	base := t.TempDir()
	csiDir, reg, elsewhere := filepath.Join(base, "csi"), filepath.Join(base, "registration"), filepath.Join(base, "elsewhere")
	for _, d := range []string{csiDir, reg, elsewhere, filepath.Join(csiDir, "sub")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	state := filepath.Join(csiDir, "kube-events.json")
	secret := filepath.Join(elsewhere, "secret")
	for _, f := range []string{state, secret} {
		if err := os.WriteFile(f, []byte("{}"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ln, err := net.Listen("unix", filepath.Join(csiDir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if err := os.Symlink(secret, filepath.Join(csiDir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(secret, filepath.Join(reg, "hardlink")); err != nil {
		t.Fatal(err)
	}

	var out, errs bytes.Buffer
	if rc := runPluginDirs([]string{"--owner=65532:573", csiDir, reg}, &out, &errs); rc != 0 {
		t.Fatalf("plugin-dirs: exit %d\n%s%s", rc, out.String(), errs.String())
	}
	for _, p := range []string{csiDir, reg} {
		if u, g, m := owner(t, p); u != 65532 || g != 573 || m != 0o750 {
			t.Errorf("%s: %d:%d %o, want 65532:573 750", p, u, g, m)
		}
	}
	for _, p := range []string{state, filepath.Join(csiDir, "csi.sock")} {
		if u, g, _ := owner(t, p); u != 65532 || g != 573 {
			t.Errorf("%s: %d:%d, want 65532:573", p, u, g)
		}
	}
	for _, p := range []string{secret, filepath.Join(csiDir, "link"), filepath.Join(csiDir, "sub")} {
		if u, g, _ := owner(t, p); u != 0 || g != 0 {
			t.Errorf("%s was given away: %d:%d", p, u, g)
		}
	}
	for _, want := range []string{"link left as it is: a symlink", "sub left as it is: a directory", "hardlink left as it is: a file of 2 links"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("plugin-dirs does not say %q:\n%s", want, out.String())
		}
	}
	// The pod's next start finds the directories the plugin's already.
	out.Reset()
	if rc := runPluginDirs([]string{"--owner=65532:573", csiDir, reg}, &out, &errs); rc != 0 || strings.Count(out.String(), "already") != 2 {
		t.Fatalf("plugin-dirs again: exit %d\n%s%s", rc, out.String(), errs.String())
	}
	// Another owner than root or the plugin is refused, and named.
	if err := os.Chown(reg, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	errs.Reset()
	if rc := runPluginDirs([]string{"--owner=65532:573", reg}, &out, &errs); rc != 1 || !strings.Contains(errs.String(), "belongs to 1000:1000") {
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
