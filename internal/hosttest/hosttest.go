// Package hosttest holds what the tests that work on the host itself
// share: the check that they run as root with the tools they call.
// Imported by tests only; the stand-ins of tests that need no root stay
// with their packages.
package hosttest

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// NeedRoot skips t unless it runs as root and finds every one of tools
// on the PATH. why says what root is needed for, as the skip's text.
func NeedRoot(t testing.TB, why string, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip(why)
	}
	NeedTools(t, tools...)
}

// NeedTools skips t unless it finds every one of tools on the PATH.
func NeedTools(t testing.TB, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (make deps installs it)", tool)
		}
	}
}

// SparseFile makes a sparse file of size bytes in t's temporary directory
// (a disk image for a loop device) and returns its path.
func SparseFile(t testing.TB, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}
