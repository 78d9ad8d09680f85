// Package vault builds a Vault server from its sources and runs it as an
// operator would: file storage, TLS from a CA of the lab's own, initialised
// and unsealed through the server's own CLI. It is the real key backend
// the lab's encryption can talk to; crypt/transit/transittest stays the
// fake of the unit tests.
package vault

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// Version is the Vault release built, pinned in build/go.mod together with
// the published api and sdk modules its tree matches.
const Version = "v1.14.0"

// buildPkg is the server's main package, at the root of Vault's module.
const buildPkg = "github.com/hashicorp/vault"

// BuildDir is the module that pins the server's build (build/go.mod),
// kept out of the product's go.mod.
func BuildDir() string { return filepath.Join(repoRoot(), "integration", "vault", "build") }

func repoRoot() string {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		return filepath.Join(filepath.Dir(file), "..", "..")
	}
	dir, err := os.Getwd()
	if err != nil {
		return "."
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "integration", "vault", "build", "go.mod")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}

// cacheEntry is the cache directory of the server's binary:
// cacheDir/vault/<version>-<digest of the build module>, so a change of
// go.mod, go.sum or the Go release builds anew.
func cacheEntry(cacheDir string) (string, error) {
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum", "deps/deps.go"} {
		b, err := os.ReadFile(filepath.Join(BuildDir(), f))
		if err != nil {
			return "", fmt.Errorf("the Vault build module: %w", err)
		}
		fmt.Fprintf(h, "%s\n%s\n", f, b)
	}
	fmt.Fprintf(h, "%s %s\n", runtime.Version(), ldflags)
	return filepath.Join(cacheDir, "vault", Version+"-"+hex.EncodeToString(h.Sum(nil))[:12]), nil
}

// ldflags strip the symbol table; the release is the module's own
// (version.Version in Vault's tree), so nothing needs stamping.
const ldflags = "-s -w"

const marker = ".complete"

// Cached returns the path of the server's binary when a complete build of
// the build module's inputs is in cacheDir, and ok false otherwise. It
// never builds.
func Cached(cacheDir string) (bin string, ok bool, err error) {
	dir, err := cacheEntry(cacheDir)
	if err != nil {
		return "", false, err
	}
	if _, err := os.Stat(filepath.Join(dir, marker)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return filepath.Join(dir, "vault"), false, nil
		}
		return "", false, err
	}
	return filepath.Join(dir, "vault"), true, nil
}

// Build returns the server's binary, building it into the cache
// (cacheEntry) unless a build of the same inputs is there. One build at a
// time holds cacheDir/vault/lock; the marker is written last. The first
// build compiles about 1500 packages.
func Build(ctx context.Context, cacheDir string, log io.Writer) (string, error) {
	bin, ok, err := Cached(cacheDir)
	if err != nil || ok {
		return bin, err
	}
	dir := filepath.Dir(bin)
	unlock, err := lab.LockFile(filepath.Join(cacheDir, "vault", "lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, ok, err := Cached(cacheDir); err != nil || ok {
		return bin, err // built by another process while we waited
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	fmt.Fprintf(log, "vault: building Vault %s into %s; the first build takes about 20 minutes on 2 cores\n", Version, dir)
	start := time.Now()
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", ldflags, "-o", bin, buildPkg)
	cmd.Dir = BuildDir()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building Vault %s in %s: %w\n%s", Version, cmd.Dir, err, out)
	}
	took := time.Since(start).Round(time.Second)
	if err := os.WriteFile(filepath.Join(dir, marker), []byte(took.String()+"\n"), 0o644); err != nil {
		return "", err
	}
	fmt.Fprintf(log, "vault: built Vault %s in %s\n", Version, took)
	return bin, nil
}
