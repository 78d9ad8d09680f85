// Package srctree finds the project's source tree, which the lab's
// builds (Kubernetes, Vault) and scenarios read files of.
package srctree

import (
	"os"
	"path/filepath"
	"runtime"
)

// Root is the source tree: this file's when it was compiled without
// -trimpath (go test), else the nearest directory at or above the working
// directory that holds this package (make runs vco-lab from the
// repository's root), else the working directory.
func Root() string {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		return filepath.Join(filepath.Dir(file), "..", "..")
	}
	dir, err := os.Getwd()
	if err != nil {
		return "."
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "integration", "srctree", "srctree.go")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}
