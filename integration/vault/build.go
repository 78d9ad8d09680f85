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
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
)

// Version is the Vault release built (MPL-2.0, the 1.14 line OpenBao was
// forked from), pinned in build/go.mod. Its tree's own api and sdk
// modules are not in its module zip; the build takes the published ones it
// requires (api v1.9.2, sdk v0.9.2), with one statement of the sdk left
// out (sdkCheck).
const Version = "v1.14.2"

// buildPkg is the server's main package, at the root of Vault's module.
const buildPkg = "github.com/hashicorp/vault"

// BuildDir is the module that pins the server's build (build/go.mod),
// kept out of the product's go.mod.
func BuildDir() string { return filepath.Join(repoRoot(), "integration", "vault", "build") }

// repoRoot is the source tree (srctree.Root).
func repoRoot() string { return srctree.Root() }

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
	fmt.Fprintf(h, "%s %s\n%s\n", runtime.Version(), ldflags, sdkCheck)
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
// build compiles about 2200 packages.
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
	fmt.Fprintf(log, "vault: building Vault %s into %s; the first build takes about 25 minutes on 2 cores\n", Version, dir)
	start := time.Now()
	modfile, err := patchedSDK(ctx, dir)
	if err != nil {
		return "", err
	}
	cmd := goCmd(ctx, "build", "-trimpath", "-modfile", modfile, "-ldflags", ldflags, "-o", bin, buildPkg)
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

// goCmd is the go command in the build module, which alone decides the
// versions (-mod=readonly, no workspace).
func goCmd(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = BuildDir()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly", "GOWORK=off")
	return cmd
}

// sdkCheck is the one statement of the published sdk (v0.9.2, the 1.14
// line's own tag) that Vault 1.14's tree does not match: a check, made
// when a backend routes its first request, that every path accepting a
// create has an existence check. The sdk of the release/1.14.x branch has
// no such check and the tree's system backend has paths that fail it
// (managed-keys/..., an Enterprise placeholder), so with it every request
// to sys/ panics. The build drops the check, nothing else.
const sdkCheck = `panic(fmt.Sprintf("Pattern %v defines a CreateOperation but no ExistenceCheck", p.Pattern))`

// patchedSDK copies the sdk module that go.mod pins (go mod download
// verifies it against go.sum) into dir/sdk without sdkCheck (both of its
// statements; anything else refuses the build), and writes dir/build.mod
// and dir/build.sum: the build module's go.mod and go.sum with the sdk
// replaced by that copy, for go build -modfile. (go build -overlay may not
// replace files of the module cache.)
func patchedSDK(ctx context.Context, dir string) (modfile string, err error) {
	out, err := goCmd(ctx, "mod", "download", "-json", "github.com/hashicorp/vault/sdk").Output()
	if err != nil {
		return "", fmt.Errorf("the Vault sdk module: %w", err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		return "", fmt.Errorf("the Vault sdk module: go mod download answered %q (%v)", out, err)
	}
	sdk := filepath.Join(dir, "sdk")
	if err := os.RemoveAll(sdk); err != nil {
		return "", err
	}
	if err := os.CopyFS(sdk, os.DirFS(mod.Dir)); err != nil {
		return "", fmt.Errorf("copying the Vault sdk module: %w", err)
	}
	backend := filepath.Join(sdk, "framework", "backend.go")
	src, err := os.ReadFile(backend)
	if err != nil {
		return "", err
	}
	if n := strings.Count(string(src), sdkCheck); n != 2 {
		return "", fmt.Errorf("%s has the create-without-existence-check panic %d times, want 2: the sdk is not the one the build module pins", backend, n)
	}
	fixed := strings.ReplaceAll(string(src), sdkCheck, "_ = p // no such check in Vault 1.14's own sdk")
	if err := os.WriteFile(backend, []byte(fixed), 0o644); err != nil {
		return "", err
	}
	gomod, err := os.ReadFile(filepath.Join(BuildDir(), "go.mod"))
	if err != nil {
		return "", err
	}
	gosum, err := os.ReadFile(filepath.Join(BuildDir(), "go.sum"))
	if err != nil {
		return "", err
	}
	modfile = filepath.Join(dir, "build.mod")
	gomod = append(gomod, "\nreplace github.com/hashicorp/vault/sdk => "+sdk+"\n"...)
	if err := os.WriteFile(modfile, gomod, 0o644); err != nil {
		return "", err
	}
	return modfile, os.WriteFile(filepath.Join(dir, "build.sum"), gosum, 0o644)
}
