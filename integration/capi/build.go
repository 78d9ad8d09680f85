// Package capi builds Cluster API's core manager from its sources, with
// the CustomResourceDefinitions of the same release, for the lab's
// ClusterResourceSet scenario (K14): the manager whose
// ClusterResourceSet controller delivers the add-on to every cluster
// labelled for it.
package capi

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
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
)

// Version is the Cluster API release built, pinned in build/go.mod: the
// newest whose Kubernetes libraries (v0.35) are one minor from the lab's
// Kubernetes (v1.34); v1.14 takes v0.36.
const Version = "v1.13.6"

// Module is Cluster API's module; the core manager is its main package,
// at the module's root (main.go).
const Module = "sigs.k8s.io/cluster-api"

// BuildDir is the module that pins the manager's build (build/go.mod),
// kept out of the product's go.mod.
func BuildDir() string {
	return filepath.Join(srctree.Root(), "integration", "capi", "build")
}

// buildInputs are the build module's files whose content decides the
// cache entry.
var buildInputs = []string{"go.mod", "go.sum", "deps/deps.go"}

// ldflags strip the symbol table.
const ldflags = "-s -w"

// cacheEntry is the cache directory of the manager's build:
// cacheDir/capi/<version>-<digest of the build module in buildDir and the
// Go release>, so a change of go.mod, go.sum or Go builds anew.
func cacheEntry(cacheDir, buildDir string) (string, error) {
	h := sha256.New()
	for _, f := range buildInputs {
		b, err := os.ReadFile(filepath.Join(buildDir, f))
		if err != nil {
			return "", fmt.Errorf("the Cluster API build module: %w", err)
		}
		fmt.Fprintf(h, "%s\n%s\n", f, b)
	}
	fmt.Fprintf(h, "%s %s\n", runtime.Version(), ldflags)
	return filepath.Join(cacheDir, "capi", Version+"-"+hex.EncodeToString(h.Sum(nil))[:12]), nil
}

const marker = ".complete"

// Manager is a complete build in the cache: the core manager's binary and
// the release's CRDs (config/crd/bases of the module, one file each).
type Manager struct {
	Bin    string
	CRDDir string
}

func managerIn(dir string) Manager {
	return Manager{Bin: filepath.Join(dir, "manager"), CRDDir: filepath.Join(dir, "crds")}
}

// Cached returns the build when a complete one of the build module's
// inputs is in cacheDir, and ok false otherwise. It never builds.
func Cached(cacheDir string) (m Manager, ok bool, err error) {
	return cached(cacheDir, BuildDir())
}

func cached(cacheDir, buildDir string) (Manager, bool, error) {
	dir, err := cacheEntry(cacheDir, buildDir)
	if err != nil {
		return Manager{}, false, err
	}
	if _, err := os.Stat(filepath.Join(dir, marker)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return managerIn(dir), false, nil
		}
		return Manager{}, false, err
	}
	return managerIn(dir), true, nil
}

// Build returns the manager, building it into the cache (cacheEntry)
// unless a build of the same inputs is there. One build at a time holds
// cacheDir/capi/lock; the marker is written last.
func Build(ctx context.Context, cacheDir string, log io.Writer) (Manager, error) {
	m, ok, err := Cached(cacheDir)
	if err != nil || ok {
		return m, err
	}
	unlock, err := lab.LockFile(filepath.Join(cacheDir, "capi", "lock"))
	if err != nil {
		return Manager{}, err
	}
	defer unlock()
	if _, ok, err := Cached(cacheDir); err != nil || ok {
		return m, err // built by another process while we waited
	}
	dir := filepath.Dir(m.Bin)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Manager{}, err
	}
	fmt.Fprintf(log, "capi: building Cluster API %s's core manager into %s; the first build takes about 5 minutes on 2 cores\n", Version, dir)
	start := time.Now()
	src, err := moduleDir(ctx)
	if err != nil {
		return Manager{}, err
	}
	if err := copyCRDs(filepath.Join(src, "config", "crd", "bases"), m.CRDDir); err != nil {
		return Manager{}, err
	}
	cmd := goCmd(ctx, "build", "-trimpath", "-ldflags", ldflags, "-o", m.Bin, Module)
	if out, err := cmd.CombinedOutput(); err != nil {
		return Manager{}, fmt.Errorf("building Cluster API %s in %s: %w\n%s", Version, cmd.Dir, err, out)
	}
	took := time.Since(start).Round(time.Second)
	if err := os.WriteFile(filepath.Join(dir, marker), []byte(took.String()+"\n"), 0o644); err != nil {
		return Manager{}, err
	}
	fmt.Fprintf(log, "capi: built Cluster API %s's core manager in %s\n", Version, took)
	return m, nil
}

// goCmd is the go command in the build module, which alone decides the
// versions (-mod=readonly, no workspace).
func goCmd(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = BuildDir()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly", "GOWORK=off")
	return cmd
}

// moduleDir is Cluster API's module as go.mod pins it, downloaded into
// the module cache and checked against go.sum.
func moduleDir(ctx context.Context) (string, error) {
	out, err := goCmd(ctx, "mod", "download", "-json", Module).Output()
	if err != nil {
		return "", fmt.Errorf("the Cluster API module: %w", err)
	}
	var mod struct{ Dir, Version string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		return "", fmt.Errorf("the Cluster API module: go mod download answered %q (%v)", out, err)
	}
	if mod.Version != Version {
		return "", fmt.Errorf("the build module pins Cluster API %s, want %s (capi.Version)", mod.Version, Version)
	}
	return mod.Dir, nil
}

// NeededCRDs are the CRDs K14 uses, which every release's
// config/crd/bases must hold.
var NeededCRDs = []string{
	"cluster.x-k8s.io_clusters.yaml",
	"addons.cluster.x-k8s.io_clusterresourcesets.yaml",
	"addons.cluster.x-k8s.io_clusterresourcesetbindings.yaml",
}

// copyCRDs copies the YAML files of src (the module's config/crd/bases:
// the manager watches every kind of them, so all are installed) into dst,
// refusing a src without NeededCRDs.
func copyCRDs(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return fmt.Errorf("the Cluster API CRDs: %w", err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() && strings.HasSuffix(e.Name(), ".yaml") {
			names = append(names, e.Name())
		}
	}
	for _, n := range NeededCRDs {
		if !slices.Contains(names, n) {
			return fmt.Errorf("the Cluster API CRDs in %s: no %s", src, n)
		}
	}
	if err := os.RemoveAll(dst); err != nil {
		return err
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(src, n))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dst, n), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// CRDs lists the CRD files of a build, sorted.
func (m Manager) CRDs() ([]string, error) {
	files, err := filepath.Glob(filepath.Join(m.CRDDir, "*.yaml"))
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no CRDs in %s", m.CRDDir)
	}
	slices.Sort(files)
	return files, nil
}
