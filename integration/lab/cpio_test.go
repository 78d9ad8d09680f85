package lab

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestCpioReadByGNUCpio writes an archive and unpacks it with cpio(1), the
// reference reader of the newc format.
func TestCpioReadByGNUCpio(t *testing.T) {
	if _, err := exec.LookPath("cpio"); err != nil {
		t.Fatal("cpio(1) is needed (Debian package cpio, installed by make deps)")
	}
	var buf bytes.Buffer
	w := newCpioWriter(&buf)
	w.File("bin/tool", 0o755, []byte("#!/bin/sh\necho hi\n"))
	w.File("/etc/deep/nested/conf", 0o600, []byte("odd-length"))
	w.File("empty", 0o644, nil)
	w.Symlink("bin/sh", "busybox")
	w.Dir("proc", 0o555)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command("cpio", "-i", "-d", "--quiet", "--no-absolute-filenames")
	cmd.Dir = dir
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	check := func(name string, want string, perm os.FileMode) {
		t.Helper()
		p := filepath.Join(dir, name)
		got, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
		st, _ := os.Stat(p)
		if st.Mode().Perm() != perm {
			t.Errorf("%s: mode %v, want %v", name, st.Mode().Perm(), perm)
		}
	}
	check("bin/tool", "#!/bin/sh\necho hi\n", 0o755)
	check("etc/deep/nested/conf", "odd-length", 0o600)
	check("empty", "", 0o644)
	if target, err := os.Readlink(filepath.Join(dir, "bin/sh")); err != nil || target != "busybox" {
		t.Errorf("bin/sh: link to %q (%v), want busybox", target, err)
	}
	if st, err := os.Stat(filepath.Join(dir, "proc")); err != nil || !st.IsDir() {
		t.Errorf("proc: %v, want a directory", err)
	}
}
