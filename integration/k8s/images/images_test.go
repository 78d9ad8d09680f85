package images

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/whitesky-cloud/vco-storage/deploy/ociimage"
)

func TestSidecarsFollowTheManifests(t *testing.T) {
	sc, err := Sidecars()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]Sidecar{}
	for _, s := range sc {
		byName[s.Name] = s
		if !strings.HasPrefix(s.Ref, "registry.k8s.io/sig-storage/"+s.Name+":"+s.Tag) {
			t.Errorf("%+v: reference and name/tag disagree", s)
		}
	}
	for n, mod := range map[string]string{
		"csi-provisioner": "github.com/kubernetes-csi/external-provisioner/v6",
		"csi-attacher":    "github.com/kubernetes-csi/external-attacher/v4",
		"csi-resizer":     "github.com/kubernetes-csi/external-resizer/v2",
		"csi-snapshotter": "github.com/kubernetes-csi/external-snapshotter/v8",
	} {
		if s, ok := byName[n]; !ok || s.Module != mod || s.Package != mod+"/cmd/"+n {
			t.Errorf("sidecar %s: %+v, want module %s", n, s, mod)
		}
	}
	if len(sc) != 4 {
		t.Errorf("the manifests name %d sidecars (%v), want the controller's 4", len(sc), sc)
	}
	if x := snapshotController(sc); len(x) != 1 || x[0].Ref != "registry.k8s.io/sig-storage/snapshot-controller:"+byName["csi-snapshotter"].Tag {
		t.Errorf("snapshot-controller %+v does not follow csi-snapshotter's tag", x)
	}
}

func TestNearestVersion(t *testing.T) {
	listed := []string{"v6.3.0", "v6.4.0", "v6.5.0-rc.1", "v7.0.0", "v5.9.9"}
	for _, c := range []struct{ tag, want string }{
		{"v6.4.0", "v6.4.0"},
		{"v6.4.1", "v6.4.0"}, // not published: the release just below
		{"v6.2.0", "v6.3.0"}, // nothing below in v6: the lowest above
		{"v6.9.0", "v6.4.0"}, // a pre-release is never picked
	} {
		if got, err := nearest(listed, c.tag); err != nil || got != c.want {
			t.Errorf("nearest(%s) = %q, %v; want %s", c.tag, got, err, c.want)
		}
	}
	if got, err := nearest(listed, "v8.0.0"); err == nil {
		t.Errorf("nearest(v8.0.0) = %s; want an error: no v8 release at all", got)
	}
}

// pulled fetches ref back from the registry as containerd would: the
// manifest first, then the config it names.
func pulled(t *testing.T, r *Registry, ref string) (*v1.Manifest, *v1.ConfigFile, v1.Image) {
	t.Helper()
	dst, err := r.Ref(ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(dst)
	if err != nil {
		t.Fatalf("pulling %s as %s: %v", ref, dst, err)
	}
	if !desc.MediaType.IsImage() {
		t.Fatalf("%s is served as %s, want a single-platform image manifest", ref, desc.MediaType)
	}
	img, err := desc.Image()
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != "amd64" {
		t.Errorf("%s is for %s/%s, want linux/amd64", ref, cf.OS, cf.Architecture)
	}
	return m, cf, img
}

// files lists an image's layer entries: path -> tar header.
func files(t *testing.T, img v1.Image) map[string]*tar.Header {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*tar.Header{}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			out["/"+strings.TrimSuffix(h.Name, "/")] = h
		}
		rc.Close()
	}
	return out
}

// TestPauseAndWorkloadThroughTheRegistry builds the two images made here
// (no sidecar: those take minutes, see TestBuildEverything), serves them,
// pulls them back, runs the workload's shell, and checks a second run
// builds nothing.
func TestPauseAndWorkloadThroughTheRegistry(t *testing.T) {
	if _, err := os.Stat(BusyboxPath); err != nil {
		t.Skipf("busybox-static is not installed (%v)", err)
	}
	cache := t.TempDir()
	bbVersion, err := busyboxVersion()
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	logf := func(f string, a ...any) { fmt.Fprintf(&log, f+"\n", a...) }
	b := &builder{cache: cache, logf: logf}
	made := 0
	count := func(f func(context.Context) (v1.Image, error)) func(context.Context) (v1.Image, error) {
		return func(ctx context.Context) (v1.Image, error) { made++; return f(ctx) }
	}
	jobs := []job{
		{PauseRef, cacheKey(PauseRef) + "-" + shortHash(pauseSource), count(b.pause)},
		{WorkloadRef, cacheKey(WorkloadRef) + "-" + sanitize(bbVersion), count(func(ctx context.Context) (v1.Image, error) { return b.workload(ctx, bbVersion) })},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	imgs, err := run(ctx, cache, logf, jobs)
	if err != nil {
		t.Fatal(err)
	}
	if made != 2 {
		t.Fatalf("first run made %d images, want 2", made)
	}
	if entries, _ := os.ReadDir(filepath.Join(cache, "build")); len(entries) != 0 {
		t.Errorf("build directories left behind: %v", entries)
	}

	reg, err := Serve(ctx, "127.0.0.1:0", imgs)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	if !strings.HasPrefix(reg.URL, "http://127.0.0.1:") {
		t.Errorf("registry URL %s", reg.URL)
	}

	img := checkServedPause(t, reg)
	checkServedWorkload(t, reg)

	// The pause binary really is one: it runs, and exits 0 on SIGTERM.
	runPause(t, img, reg)

	// A second run builds nothing: every image comes from the cache with
	// the same digest.
	made = 0
	log.Reset()
	again, err := run(ctx, cache, logf, jobs)
	if err != nil {
		t.Fatal(err)
	}
	if made != 0 {
		t.Errorf("second run made %d images; the cache should have served all\n%s", made, log.String())
	}
	for ref, img := range imgs {
		d1, _ := img.Digest()
		d2, _ := again[ref].Digest()
		if d1 != d2 {
			t.Errorf("%s: digest %s, then %s from the cache", ref, d1, d2)
		}
	}
}

// checkServedPause pulls the pause image back: its entrypoint is its
// executable /pause, served under the registry's host as containerd asks
// a registry.k8s.io mirror for it. It returns the image.
func checkServedPause(t *testing.T, reg *Registry) v1.Image {
	t.Helper()
	_, cf, img := pulled(t, reg, PauseRef)
	if got := cf.Config.Entrypoint; len(got) != 1 || got[0] != "/pause" {
		t.Errorf("pause entrypoint %q, want [/pause]", got)
	}
	if h := files(t, img)["/pause"]; h == nil || h.Mode&0o111 == 0 {
		t.Errorf("pause image has no executable /pause: %+v", h)
	}
	// The served name is the repository path under the registry's host,
	// as containerd asks a registry.k8s.io mirror for it.
	if dst, _ := reg.Ref(PauseRef); dst.String() != reg.Host+"/pause:3.10.1" {
		t.Errorf("pause served as %s, want %s/pause:3.10.1", dst, reg.Host)
	}
	return img
}

// checkServedWorkload pulls the workload image back: it runs /bin/sh, and
// its tools are links to busybox.
func checkServedWorkload(t *testing.T, reg *Registry) {
	t.Helper()
	_, cf, img := pulled(t, reg, WorkloadRef)
	if got := cf.Config.Cmd; len(got) != 1 || got[0] != "/bin/sh" || len(cf.Config.Entrypoint) != 0 {
		t.Errorf("workload entrypoint %q cmd %q, want none and [/bin/sh]", cf.Config.Entrypoint, got)
	}
	fs := files(t, img)
	for _, p := range []string{"/bin/sh", "/bin/dd", "/bin/sync", "/bin/cat"} {
		if h := fs[p]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "/bin/busybox" {
			t.Errorf("workload image: %s is %+v, want a link to /bin/busybox", p, h)
		}
	}
}

// runPause extracts /pause from the served pause image and runs it.
func runPause(t *testing.T, _ v1.Image, reg *Registry) {
	t.Helper()
	dst, _ := reg.Ref(PauseRef)
	img, err := remote.Image(dst)
	if err != nil {
		t.Fatal(err)
	}
	layers, _ := img.Layers()
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	dir := t.TempDir()
	if err := untarAll(rc, dir); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(dir, "pause"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		t.Fatalf("pause exited by itself: %v", err)
	default:
	}
	cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("pause on SIGINT: %v, want exit 0", err)
		}
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		t.Error("pause did not exit on SIGINT")
	}
}

func untarAll(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		p := filepath.Join(dir, h.Name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		b, err := io.ReadAll(tr)
		if err != nil {
			return err
		}
		if err := os.WriteFile(p, b, os.FileMode(h.Mode)); err != nil {
			return err
		}
	}
}

func TestReadCachedRefusesATruncatedLayer(t *testing.T) {
	if _, err := os.Stat(BusyboxPath); err != nil {
		t.Skipf("busybox-static is not installed (%v)", err)
	}
	cache := t.TempDir()
	b := &builder{cache: cache, logf: t.Logf}
	img, err := b.workload(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(cache, "entry")
	if err := writeCached(dir, WorkloadRef, img); err != nil {
		t.Fatal(err)
	}
	if _, err := readCached(dir); err != nil {
		t.Fatalf("a whole entry: %v", err)
	}
	layers, _ := img.Layers()
	d, _ := layers[0].Digest()
	blob := filepath.Join(dir, "blobs", d.Algorithm, d.Hex)
	if err := os.Truncate(blob, 100); err != nil {
		t.Fatal(err)
	}
	if _, err := readCached(dir); err == nil {
		t.Error("a cache entry with a cut-short layer was taken as whole")
	}
}

// TestLoadArchiveOfMakeImage reads an archive as `make image` writes it
// (ociimage, two architectures) and gets the amd64 image back, then
// serves it under a portal-host name.
func TestLoadArchiveOfMakeImage(t *testing.T) {
	gt, err := goTool()
	if err != nil {
		t.Skip(err)
	}
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "go.mod"), []byte("module x\n\ngo 1.22\n"), 0o644)
	os.WriteFile(filepath.Join(src, "main.go"), pauseSource, 0o644)
	bins := map[string]string{}
	for _, arch := range []string{"amd64", "arm64"} {
		bins[arch] = filepath.Join(src, "bin-"+arch)
		cmd := exec.Command(gt, "build", "-o", bins[arch], ".")
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
	}
	archive := filepath.Join(t.TempDir(), "vco-csi-1.2.3.oci.tar")
	if err := ociimage.WriteArchive(ociimage.Options{Version: "1.2.3", Binaries: bins, Created: epoch}, archive); err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	img, err := LoadArchive(cache, archive)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil || cf.Architecture != "amd64" || cf.Config.Entrypoint[0] != ociimage.BinaryPath {
		t.Fatalf("loaded %+v, %v; want the amd64 vco-csi image", cf, err)
	}
	ref := "try.whitesky.cloud/csi-driver:latest"
	ctx := context.Background()
	reg, err := Serve(ctx, "127.0.0.1:0", map[string]v1.Image{ref: img})
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	_, pcf, _ := pulled(t, reg, ref)
	if pcf.Config.Entrypoint[0] != ociimage.BinaryPath {
		t.Errorf("served vco-csi entrypoint %q", pcf.Config.Entrypoint)
	}
	// A second load reuses the unpacked archive.
	if _, err := LoadArchive(cache, archive); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(filepath.Join(cache, "vco-csi")); len(entries) != 1 {
		t.Errorf("unpacked archives: %v, want one", entries)
	}
}

// TestWriteArchiveForCtrImport checks what `ctr images import` relies
// on: the image listed with its platform and containerd's name.
func TestWriteArchiveForCtrImport(t *testing.T) {
	cache := t.TempDir()
	b := &builder{cache: cache, logf: t.Logf}
	img, err := b.pause(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "pause.tar")
	if err := WriteArchive(path, PauseRef, img); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dir := t.TempDir()
	if err := untar(f, dir); err != nil {
		t.Fatal(err)
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, _ := idx.IndexManifest()
	if len(im.Manifests) != 1 {
		t.Fatalf("archive lists %d manifests", len(im.Manifests))
	}
	d := im.Manifests[0]
	if d.Platform == nil || d.Platform.OS != "linux" || d.Platform.Architecture != "amd64" {
		t.Errorf("archive lists the image with platform %+v; ctr import would drop it", d.Platform)
	}
	want, _ := name.ParseReference(PauseRef)
	if d.Annotations[containerdName] != want.Name() || d.Annotations[ociimage.RefNameAnnotation] != "3.10.1" {
		t.Errorf("archive annotations %v; want %s=%s", d.Annotations, containerdName, want.Name())
	}
}

func TestServeRefusesNonLoopback(t *testing.T) {
	for _, a := range []string{"0.0.0.0:0", ":0", "localhost:0"} {
		if r, err := Serve(context.Background(), a, nil); err == nil {
			r.Stop()
			t.Errorf("Serve(%s) accepted a non-loopback address", a)
		}
	}
}

// TestBuildEverything builds (or takes from the lab's cache) every image
// and serves them: minutes per sidecar on a cold Go build cache, so only
// with VCO_LAB set, as the lab's other heavy tests (and a -timeout to
// match).
func TestBuildEverything(t *testing.T) {
	if os.Getenv("VCO_LAB") == "" {
		t.Skip("builds the sidecars from source; set VCO_LAB=1")
	}
	cache := os.Getenv("VCO_K8S_IMAGE_CACHE")
	if cache == "" {
		cache = DefaultCacheDir
	}
	// Bounded by go test's -timeout only: a cold build of the five
	// sidecars took 36 and 22 minutes for the first two on a loaded
	// 2-core machine.
	ctx := t.Context()
	start := time.Now()
	imgs, err := Build(ctx, cache, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Build: %s", time.Since(start).Round(time.Second))
	sc, _ := Sidecars()
	reg, err := Serve(ctx, "127.0.0.1:0", imgs)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	for _, s := range append(sc, snapshotController(sc)...) {
		_, cf, img := pulled(t, reg, s.Ref)
		if got := cf.Config.Entrypoint; len(got) != 1 || got[0] != "/"+s.Name {
			t.Errorf("%s entrypoint %q, want [/%s]", s.Ref, got, s.Name)
		}
		if h := files(t, img)["/"+s.Name]; h == nil || h.Mode&0o111 == 0 {
			t.Errorf("%s has no executable /%s", s.Ref, s.Name)
		}
		t.Logf("%s: built from %s", s.Ref, cf.Config.Labels["vco-lab.module"])
	}
	for _, ref := range []string{PauseRef, WorkloadRef} {
		pulled(t, reg, ref)
	}
	// Warm: nothing is built the second time.
	start = time.Now()
	var log strings.Builder
	if _, err := Build(ctx, cache, func(f string, a ...any) { fmt.Fprintf(&log, f+"\n", a...) }); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(log.String(), "building") {
		t.Errorf("a warm Build built again:\n%s", log.String())
	}
	t.Logf("warm Build: %s", time.Since(start).Round(time.Millisecond))
}

// TestOneBuildAtATime: a second Build on the same cache waits for the
// first instead of building the same images beside it.
func TestOneBuildAtATime(t *testing.T) {
	cache := t.TempDir()
	unlock, err := lockCache(cache, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	got := make(chan func(), 1)
	go func() {
		u, err := lockCache(cache, func(f string, a ...any) { fmt.Fprintf(&log, f, a...) })
		if err != nil {
			t.Error(err)
		}
		got <- u
	}()
	select {
	case u := <-got:
		u()
		t.Fatal("a second lock was granted while the first was held")
	case <-time.After(300 * time.Millisecond):
	}
	unlock()
	select {
	case u := <-got:
		u()
	case <-time.After(10 * time.Second):
		t.Fatal("the second lock was not granted after the first was released")
	}
	if !strings.Contains(log.String(), "waiting") {
		t.Errorf("the waiting build said nothing: %q", log.String())
	}
}
