// Package images makes the container images the lab's Kubernetes cluster
// runs, with no registry on the internet: the CSI sidecars the shipped
// manifests name, built from their Go modules at the manifests' tags; a
// pause image; a busybox workload image from Debian's busybox-static;
// and the vco-csi image of `make image`. Each is one linux/amd64 image,
// cached as an OCI layout under a key that holds its version, so only the
// first run builds. Serve puts them in a registry on loopback under the
// names the manifests use; containerd in the guests mirrors
// registry.k8s.io (and the portal host) to it, so the manifests apply
// unchanged.
package images

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

// References of the images Build makes besides the sidecars.
const (
	// PauseRef is the pod sandbox image; containerd's sandbox_image.
	PauseRef = "registry.k8s.io/pause:3.10.1"
	// WorkloadRef is a busybox image (/bin/sh and the usual tools) for
	// the scenarios' pods.
	WorkloadRef = "registry.k8s.io/vco-lab/busybox:static"
)

// DefaultCacheDir is where the lab keeps built images.
const DefaultCacheDir = "/var/cache/vco-lab/k8s-images"

// recipe is part of every cache key: change it when the way an image is
// assembled changes, so old cache entries are not reused.
const recipe = "r1"

// Logf receives progress lines.
type Logf func(format string, args ...any)

// Sidecar is a kubernetes-csi sidecar named by the manifests.
type Sidecar struct {
	Ref     string // as the manifest names it, registry.k8s.io/sig-storage/csi-provisioner:v6.4.1
	Name    string // csi-provisioner
	Tag     string // v6.4.1
	Module  string // github.com/kubernetes-csi/external-provisioner/v6
	Package string // <Module>/cmd/csi-provisioner
}

var sidecarImage = regexp.MustCompile(`(?m)^\s*image:\s*(registry\.k8s\.io/sig-storage/(csi-([a-z]+)):(v(\d+)\.\d+\.\d+))\s*$`)

// Sidecars lists the sidecar images of the add-on's core manifests
// (deploy/manifests), so a new tag there is what the lab builds next.
func Sidecars() ([]Sidecar, error) {
	b, err := deploy.BundleOf(deploy.Core)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var out []Sidecar
	for _, m := range sidecarImage.FindAllSubmatch(b, -1) {
		ref := string(m[1])
		if seen[ref] {
			continue
		}
		seen[ref] = true
		mod := "github.com/kubernetes-csi/external-" + string(m[3])
		if major := string(m[5]); major != "0" && major != "1" {
			mod += "/v" + major
		}
		out = append(out, Sidecar{Ref: ref, Name: string(m[2]), Tag: string(m[4]), Module: mod, Package: mod + "/cmd/" + string(m[2])})
	}
	if len(out) == 0 {
		return nil, errors.New("the add-on's manifests name no registry.k8s.io/sig-storage sidecar image")
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Ref < out[j].Ref })
	return out, nil
}

// Build returns every image the cluster runs except vco-csi's (see
// LoadArchive), by reference, building what cacheDir does not hold yet.
// Building needs the go tool, the Go module proxy and busybox-static;
// a warm cache needs none of them.
func Build(ctx context.Context, cacheDir string, logf Logf) (map[string]v1.Image, error) {
	logf, unlock, err := openCache(cacheDir, logf)
	if err != nil {
		return nil, err
	}
	defer unlock()
	sidecars, err := Sidecars()
	if err != nil {
		return nil, err
	}
	b := &builder{cache: cacheDir, logf: logf, sidecars: append(sidecars, snapshotController(sidecars)...)}
	defer b.close()
	var jobs []job
	for _, s := range b.sidecars {
		jobs = append(jobs, job{s.Ref, cacheKey(s.Ref), func(ctx context.Context) (v1.Image, error) { return b.sidecar(ctx, s) }})
	}
	jobs = append(jobs, job{PauseRef, cacheKey(PauseRef) + "-" + shortHash(pauseSource), b.pause})
	bbVersion, err := busyboxVersion()
	if err != nil {
		return nil, err
	}
	jobs = append(jobs, job{WorkloadRef, cacheKey(WorkloadRef) + "-" + sanitize(bbVersion), func(ctx context.Context) (v1.Image, error) {
		return b.workload(ctx, bbVersion)
	}})
	return run(ctx, cacheDir, logf, jobs)
}

// snapshotController is the snapshot-controller of the csi-snapshotter
// sidecar's release: not in the add-on (clusters install it with the
// snapshot CRDs, docs/csi-addon.md), but the lab's cluster needs it to
// take snapshots.
func snapshotController(sidecars []Sidecar) []Sidecar {
	for _, s := range sidecars {
		if s.Name == "csi-snapshotter" {
			return []Sidecar{{Ref: "registry.k8s.io/sig-storage/snapshot-controller:" + s.Tag, Name: "snapshot-controller", Tag: s.Tag,
				Module: s.Module, Package: s.Module + "/cmd/snapshot-controller"}}
		}
	}
	return nil
}

// job makes one image; key names its cache entry.
type job struct {
	ref, key string
	make     func(context.Context) (v1.Image, error)
}

// run returns each job's image from the cache, making and caching those
// it does not hold.
func run(ctx context.Context, cacheDir string, logf Logf, jobs []job) (map[string]v1.Image, error) {
	out := map[string]v1.Image{}
	for _, j := range jobs {
		dir := filepath.Join(cacheDir, j.key)
		if img, err := readCached(dir); err == nil {
			logf("image %s: cached (%s)", j.ref, dir)
			out[j.ref] = img
			continue
		} else if !errors.Is(err, os.ErrNotExist) {
			logf("image %s: cache entry %s unusable (%v); building again", j.ref, dir, err)
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		img, err := j.make(ctx)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", j.ref, err)
		}
		if err := writeCached(dir, j.ref, img); err != nil {
			return nil, fmt.Errorf("image %s: caching in %s: %w", j.ref, dir, err)
		}
		// Served from the cache's files from now on, as a warm run would.
		if img, err = readCached(dir); err != nil {
			return nil, fmt.Errorf("image %s: reading back %s: %w", j.ref, dir, err)
		}
		out[j.ref] = img
	}
	return out, nil
}

// openCache makes cacheDir and holds its lock (lockCache) for one Build;
// a nil logf logs nothing.
func openCache(cacheDir string, logf Logf) (Logf, func(), error) {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, nil, fmt.Errorf("image cache: %w", err)
	}
	unlock, err := lockCache(cacheDir, logf)
	return logf, unlock, err
}

// lockCache holds <cacheDir>/.lock for one Build at a time, so two lab
// runs on a machine do not both spend minutes on the same image.
func lockCache(cacheDir string, logf Logf) (func(), error) {
	f, err := os.OpenFile(filepath.Join(cacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("image cache lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		logf("image cache %s: another build holds it; waiting", cacheDir)
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("image cache lock: %w", err)
		}
	}
	return func() { f.Close() }, nil
}

// cacheKey turns a reference into a directory name that holds its tag,
// plus the recipe: registry.k8s.io/sig-storage/csi-attacher:v4.13.0 ->
// sig-storage_csi-attacher_v4.13.0-r1.
func cacheKey(ref string) string {
	r := strings.TrimPrefix(ref, "registry.k8s.io/")
	return sanitize(r) + "-" + recipe
}

var unsafeName = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

func sanitize(s string) string { return unsafeName.ReplaceAllString(s, "_") }

// readCached opens the one image of a cache entry's OCI layout.
func readCached(dir string) (v1.Image, error) {
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err != nil {
		return nil, err
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, err
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, err
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(im.Manifests) != 1 {
		return nil, fmt.Errorf("holds %d manifests, want 1", len(im.Manifests))
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		return nil, err
	}
	// A layout whose blobs were cut short (a full disk, a killed run)
	// must not be served: check every layer is there in full.
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return nil, err
		}
		sz, err := l.Size()
		if err != nil {
			return nil, err
		}
		fi, err := os.Stat(filepath.Join(dir, "blobs", d.Algorithm, d.Hex))
		if err != nil {
			return nil, err
		}
		if fi.Size() != sz {
			return nil, fmt.Errorf("layer %s has %d of %d bytes", d, fi.Size(), sz)
		}
	}
	return img, nil
}

// writeCached writes the image as an OCI layout beside dir and renames it
// into place, so a cache entry is whole or absent.
func writeCached(dir, ref string, img v1.Image) error {
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := writeLayout(tmp, ref, img); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	return os.Rename(tmp, dir)
}
