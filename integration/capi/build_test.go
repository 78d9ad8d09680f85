package capi

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
)

// TestBuildModulePinsVersion: build/go.mod requires Cluster API at
// Version, so the version the docs and the cache entry name is the one
// built.
func TestBuildModulePinsVersion(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(BuildDir(), "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse("go.mod", b, nil)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, r := range f.Require {
		if r.Mod.Path == Module {
			found = true
			if r.Mod.Version != Version {
				t.Errorf("build/go.mod requires %s %s, Version says %s", Module, r.Mod.Version, Version)
			}
		}
	}
	if !found {
		t.Errorf("build/go.mod does not require %s", Module)
	}
}

// copyBuildModule copies the build module's inputs into a directory of
// the test's own.
func copyBuildModule(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range buildInputs {
		b, err := os.ReadFile(filepath.Join(BuildDir(), f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestCacheEntryFollowsTheBuildInputs: a change of any input of the build
// module names another cache entry; the same inputs the same one.
func TestCacheEntryFollowsTheBuildInputs(t *testing.T) {
	cache := t.TempDir()
	mod := copyBuildModule(t)
	first, err := cacheEntry(cache, mod)
	if err != nil {
		t.Fatal(err)
	}
	again, err := cacheEntry(cache, mod)
	if err != nil || again != first {
		t.Fatalf("the same inputs gave %s then %s (%v)", first, again, err)
	}
	if !strings.HasPrefix(filepath.Base(first), Version+"-") || filepath.Dir(first) != filepath.Join(cache, "capi") {
		t.Errorf("entry %s, want %s/capi/%s-<digest>", first, cache, Version)
	}
	for _, f := range buildInputs {
		p := filepath.Join(mod, f)
		orig, _ := os.ReadFile(p)
		if err := os.WriteFile(p, append(orig, "\n// changed\n"...), 0o644); err != nil {
			t.Fatal(err)
		}
		if e, err := cacheEntry(cache, mod); err != nil || e == first {
			t.Errorf("a change of %s kept the entry %s (%v)", f, e, err)
		}
		if err := os.WriteFile(p, orig, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Remove(filepath.Join(mod, "go.sum")); err != nil {
		t.Fatal(err)
	}
	if _, err := cacheEntry(cache, mod); err == nil {
		t.Error("a build module without go.sum gave a cache entry")
	}
}

// TestCachedOnlyOnceTheMarkerIsWritten: a build in progress (binary
// there, no marker) is not a build; with the marker it is, and Cached
// names the binary and the CRDs in the entry.
func TestCachedOnlyOnceTheMarkerIsWritten(t *testing.T) {
	cache := t.TempDir()
	mod := copyBuildModule(t)
	m, ok, err := cached(cache, mod)
	if err != nil || ok {
		t.Fatalf("empty cache: ok %v, err %v", ok, err)
	}
	dir := filepath.Dir(m.Bin)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.Bin, []byte("half"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := cached(cache, mod); ok {
		t.Fatal("a binary without the marker counted as a build")
	}
	if err := os.WriteFile(filepath.Join(dir, marker), []byte("1s\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, ok, err := cached(cache, mod)
	if err != nil || !ok {
		t.Fatalf("with the marker: ok %v, err %v", ok, err)
	}
	if got.Bin != filepath.Join(dir, "manager") || got.CRDDir != filepath.Join(dir, "crds") {
		t.Errorf("build %+v, want the manager and crds of %s", got, dir)
	}
}

// TestCopyCRDsTakesTheYAMLAndRefusesAnIncompleteSet: every YAML file of
// config/crd/bases is copied, nothing else; a set without one of the
// CRDs K14 uses is refused and copies nothing.
func TestCopyCRDsTakesTheYAMLAndRefusesAnIncompleteSet(t *testing.T) {
	src := t.TempDir()
	files := append([]string{"ipam.cluster.x-k8s.io_ipaddresses.yaml", "kustomization.yaml"}, NeededCRDs...)
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(src, f), []byte("kind: "+f+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(src, "README.md"), []byte("no"), 0o644); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "crds")
	if err := copyCRDs(src, dst); err != nil {
		t.Fatal(err)
	}
	got, err := Manager{CRDDir: dst}.CRDs()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(files) {
		t.Errorf("copied %v, want the %d YAML files", got, len(files))
	}
	for _, f := range got {
		if b, _ := os.ReadFile(f); string(b) != "kind: "+filepath.Base(f)+"\n" {
			t.Errorf("%s holds %q", f, b)
		}
	}
	if err := os.Remove(filepath.Join(src, NeededCRDs[1])); err != nil {
		t.Fatal(err)
	}
	dst2 := filepath.Join(t.TempDir(), "crds")
	err = copyCRDs(src, dst2)
	if err == nil || !strings.Contains(err.Error(), NeededCRDs[1]) {
		t.Errorf("a set without %s: %v, want a refusal naming it", NeededCRDs[1], err)
	}
	if _, err := os.Stat(dst2); err == nil {
		t.Error("the refused set was copied")
	}
	if _, err := (Manager{CRDDir: dst2}).CRDs(); err == nil {
		t.Error("an empty CRD directory listed CRDs")
	}
}
