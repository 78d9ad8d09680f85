package images

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/mod/modfile"
)

// SnapshotterFiles are the upstream files a cluster needs before it can
// take snapshots (the add-on does not ship them: docs/csi-addon.md,
// "Snapshots"): the CRDs of external-snapshotter's client module and the
// snapshot-controller's RBAC and Deployment, read from the module cache at
// the csi-snapshotter sidecar's release, the same release the lab builds
// the snapshot-controller image from.
type SnapshotterFiles struct {
	CRDs       []string // snapshot.storage.k8s.io_*.yaml
	Controller []string // rbac-snapshot-controller.yaml, setup-snapshot-controller.yaml
	// Image is the snapshot-controller image the lab serves.
	Image string
}

// Snapshotter finds the files of SnapshotterFiles, downloading the
// modules into the Go module cache if they are not there yet.
func Snapshotter(ctx context.Context, cacheDir string) (*SnapshotterFiles, error) {
	sidecars, err := Sidecars()
	if err != nil {
		return nil, err
	}
	sc := snapshotController(sidecars)
	if len(sc) == 0 {
		return nil, fmt.Errorf("the add-on's manifests name no csi-snapshotter sidecar")
	}
	s := sc[0]
	b := &builder{cache: cacheDir}
	dir, done, err := b.moduleWorkDir("snapshotter-files")
	if err != nil {
		return nil, err
	}
	defer done()
	version, err := moduleVersion(ctx, dir, s.Module, s.Tag)
	if err != nil {
		return nil, err
	}
	mainDir, err := moduleDir(ctx, dir, s.Module, version)
	if err != nil {
		return nil, err
	}
	client := strings.TrimSuffix(s.Module, "/v8") + "/client/v8"
	clientVersion, err := requiredVersion(filepath.Join(mainDir, "go.mod"), client)
	if err != nil {
		return nil, err
	}
	clientDir, err := moduleDir(ctx, dir, client, clientVersion)
	if err != nil {
		return nil, err
	}
	f := &SnapshotterFiles{Image: s.Ref}
	f.CRDs, _ = filepath.Glob(filepath.Join(clientDir, "config", "crd", "snapshot.storage.k8s.io_*.yaml"))
	for _, n := range []string{"rbac-snapshot-controller.yaml", "setup-snapshot-controller.yaml"} {
		f.Controller = append(f.Controller, filepath.Join(mainDir, "deploy", "kubernetes", "snapshot-controller", n))
	}
	if len(f.CRDs) != 3 {
		return nil, fmt.Errorf("%s@%s: want the 3 snapshot CRDs under config/crd, found %v", client, clientVersion, f.CRDs)
	}
	for _, p := range f.Controller {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("%s@%s: %w", s.Module, version, err)
		}
	}
	return f, nil
}

// moduleDir is where the Go module cache holds mod@version.
func moduleDir(ctx context.Context, dir, mod, version string) (string, error) {
	out, err := goRun(ctx, dir, "mod", "download", "-json", mod+"@"+version)
	if err != nil {
		return "", err
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		return "", fmt.Errorf("go mod download %s@%s printed %q: %w", mod, version, out, err)
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go mod download %s@%s: %s", mod, version, m.Error)
	}
	return m.Dir, nil
}

// requiredVersion is the version of mod that the go.mod at path requires.
func requiredVersion(path, mod string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	f, err := modfile.ParseLax(path, data, nil)
	if err != nil {
		return "", err
	}
	for _, r := range f.Require {
		if r.Mod.Path == mod {
			return r.Mod.Version, nil
		}
	}
	return "", fmt.Errorf("%s does not require %s", path, mod)
}
