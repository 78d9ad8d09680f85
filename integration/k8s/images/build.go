package images

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/mod/semver"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/whitesky-cloud/vco-storage/deploy/ociimage"
)

//go:embed pause/main.go
var pauseSource []byte

// BusyboxPath is Debian's busybox-static binary.
const BusyboxPath = "/bin/busybox"

type builder struct {
	cache string
	logf  Logf

	// sidecars are built in one work module (sidecarModule), made by
	// the first sidecar that is not cached and removed by close.
	sidecars []Sidecar
	scOnce   sync.Once
	scDir    string
	scVers   map[string]string // the version built, by Sidecar.Name
	scErr    error
	cleanups []func()
}

// close removes what the builder made to build in.
func (b *builder) close() {
	for _, f := range b.cleanups {
		f()
	}
	b.cleanups = nil
}

// goTool finds the go command: on PATH, else where Debian's golang and
// the upstream tarball put it.
func goTool() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/local/go/bin/go", "/usr/lib/go/bin/go"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no go command on PATH, in /usr/local/go/bin or /usr/lib/go/bin; the lab builds the sidecars and pause with it")
}

// goRun runs the go command in a module directory of its own: never the
// product's go.mod (GOWORK=off, -mod=mod), static linux/amd64 output.
func goRun(ctx context.Context, dir string, args ...string) (string, error) {
	return goWith(ctx, dir, "-mod=mod -buildvcs=false", args...)
}

// goWith runs the go command in dir with GOFLAGS goflags, static
// linux/amd64 output, no workspace.
func goWith(ctx context.Context, dir, goflags string, args ...string) (string, error) {
	gt, err := goTool()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, gt, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS="+goflags, "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64", "GOTOOLCHAIN=local")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("go %s (in %s): %v\n%s", strings.Join(args, " "), dir, err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// workDir is a fresh temporary module directory under the cache.
func (b *builder) workDir(name string) (string, func(), error) {
	base := filepath.Join(b.cache, "build")
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", nil, err
	}
	d, err := os.MkdirTemp(base, name+"-")
	if err != nil {
		return "", nil, err
	}
	return d, func() { os.RemoveAll(d) }, nil
}

func writeGoMod(dir, module string) error {
	return os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module "+module+"\n\ngo 1.22\n"), 0o644)
}

// moduleWorkDir is a fresh work directory (workDir) holding a go.mod of
// module vco-lab/build/<name>, to build other modules' programs in.
func (b *builder) moduleWorkDir(name string) (string, func(), error) {
	dir, done, err := b.workDir(name)
	if err != nil {
		return "", nil, err
	}
	if err := writeGoMod(dir, "vco-lab/build/"+name); err != nil {
		done()
		return "", nil, err
	}
	return dir, done, nil
}

// moduleVersion picks the version of mod to build for tag: the tag itself
// when the module proxy has it, else the nearest it has with the same
// major version (the highest below the tag, or the lowest above it).
func moduleVersion(ctx context.Context, dir, mod, tag string) (string, error) {
	out, err := goRun(ctx, dir, "list", "-m", "-versions", mod)
	if err != nil {
		return "", err
	}
	f := strings.Fields(out)
	if len(f) < 2 {
		return "", fmt.Errorf("the module proxy lists no version of %s", mod)
	}
	return nearest(f[1:], tag)
}

func nearest(versions []string, tag string) (string, error) {
	var below, above string
	for _, v := range versions {
		if !semver.IsValid(v) || semver.Prerelease(v) != "" || semver.Major(v) != semver.Major(tag) {
			continue
		}
		switch c := semver.Compare(v, tag); {
		case c == 0:
			return v, nil
		case c < 0 && (below == "" || semver.Compare(v, below) > 0):
			below = v
		case c > 0 && (above == "" || semver.Compare(v, above) < 0):
			above = v
		}
	}
	if below != "" {
		return below, nil
	}
	if above != "" {
		return above, nil
	}
	return "", fmt.Errorf("no release of major version %s among %v", semver.Major(tag), versions)
}

// goBuild builds pkg in dir into dir/name and returns its bytes.
func goBuild(ctx context.Context, dir, pkg, name, version string) ([]byte, error) {
	ld := "-s -w"
	if version != "" {
		ld += " -X main.version=" + version
	}
	bin := filepath.Join(dir, name)
	if _, err := goRun(ctx, dir, "build", "-trimpath", "-ldflags", ld, "-o", bin, pkg); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	return data, staticAMD64(bin, data)
}

// sidecarModule is the one work module every sidecar of b.sidecars is
// built in, each at its manifest's tag or the nearest version the proxy
// has: resolved together, the dependencies they share (client-go,
// apimachinery, grpc, csi-lib-utils) are compiled once, at the versions
// the go command picks for all of them, instead of once per sidecar at
// each one's own (about 12-16 min per sidecar on a loaded 2-core machine
// with a cold Go build cache, 2026-12-02).
func (b *builder) sidecarModule(ctx context.Context) (string, map[string]string, error) {
	b.scOnce.Do(func() {
		dir, done, err := b.moduleWorkDir("sidecars")
		if err != nil {
			b.scErr = err
			return
		}
		b.cleanups = append(b.cleanups, done)
		vers := map[string]string{}
		args := []string{"get"}
		for _, s := range b.sidecars {
			ver, err := moduleVersion(ctx, dir, s.Module, s.Tag)
			if err != nil {
				b.scErr = err
				return
			}
			if ver != s.Tag {
				b.logf("image %s: %s@%s is not on the module proxy; building %s, the nearest release it has, and serving it under the manifest's tag %s",
					s.Ref, s.Module, s.Tag, ver, s.Tag)
			}
			vers[s.Name] = ver
			args = append(args, s.Package+"@"+ver)
		}
		if _, err := goRun(ctx, dir, args...); err != nil {
			b.scErr = err
			return
		}
		b.scDir, b.scVers = dir, vers
	})
	return b.scDir, b.scVers, b.scErr
}

// sidecar builds a kubernetes-csi sidecar from its module at the
// manifest's tag (or the nearest version the proxy has), in the module of
// every sidecar (sidecarModule), into an image laid out as upstream's:
// the binary at /<name>, its entrypoint.
func (b *builder) sidecar(ctx context.Context, s Sidecar) (v1.Image, error) {
	start := time.Now()
	dir, vers, err := b.sidecarModule(ctx)
	if err != nil {
		return nil, err
	}
	ver, ok := vers[s.Name]
	if !ok {
		return nil, fmt.Errorf("%s is not among the sidecars the build resolved", s.Name)
	}
	b.logf("image %s: building %s@%s (minutes on a cold Go build cache; the dependencies it shares with the other sidecars once)", s.Ref, s.Package, ver)
	bin, err := goBuild(ctx, dir, s.Package, s.Name, ver)
	if err != nil {
		return nil, err
	}
	r := rootfs{}
	r.users()
	r.file("/"+s.Name, 0o755, bin)
	img, err := image(r, v1.Config{
		Entrypoint: []string{"/" + s.Name},
		User:       fmt.Sprintf("%d:%d", ociimage.UID, ociimage.GID),
		Labels: map[string]string{
			"org.opencontainers.image.title":   s.Name,
			"org.opencontainers.image.version": ver,
			"org.opencontainers.image.source":  "https://" + strings.TrimSuffix(s.Module, "/"+semver.Major(s.Tag)),
			"vco-lab.module":                   s.Module + "@" + ver,
		},
	}, s.Package+"@"+ver+" built by go "+runtime.Version())
	if err == nil {
		b.logf("image %s: built %s@%s in %s", s.Ref, s.Module, ver, time.Since(start).Round(time.Second))
	}
	return img, err
}

// pause builds the lab's pause program (pause/main.go, embedded) as a
// module of its own.
func (b *builder) pause(ctx context.Context) (v1.Image, error) {
	dir, done, err := b.moduleWorkDir("pause")
	if err != nil {
		return nil, err
	}
	defer done()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), pauseSource, 0o644); err != nil {
		return nil, err
	}
	b.logf("image %s: building the lab's pause", PauseRef)
	bin, err := goBuild(ctx, dir, ".", "pause", "")
	if err != nil {
		return nil, err
	}
	r := rootfs{}
	r.file("/pause", 0o755, bin)
	return image(r, v1.Config{
		Entrypoint: []string{"/pause"},
		// The sandbox needs no privilege; 65535 as upstream's pause.
		User:   "65535:65535",
		Labels: map[string]string{"org.opencontainers.image.title": "pause", "vco-lab.source": "integration/k8s/images/pause " + shortHash(pauseSource)},
	}, "pause "+shortHash(pauseSource))
}

// busyboxVersion is the installed busybox-static package's version, the
// workload image's cache key.
func busyboxVersion() (string, error) {
	out, err := exec.Command("dpkg-query", "-W", "-f", "${Version}", "busybox-static").Output()
	v := strings.TrimSpace(string(out))
	if err != nil || v == "" {
		return "", fmt.Errorf("busybox-static is not installed (dpkg-query: %v); the workload image is made from it: apt-get install busybox-static (`make deps` does)", err)
	}
	return v, nil
}

// workload makes a busybox image: /bin/busybox with a link for each of
// its applets at the path it lists, users, /tmp and /root.
func (b *builder) workload(ctx context.Context, version string) (v1.Image, error) {
	r, err := busyboxRoot(ctx)
	if err != nil {
		return nil, err
	}
	b.logf("image %s: from busybox-static %s", WorkloadRef, version)
	return image(r, v1.Config{
		Cmd:    []string{"/bin/sh"},
		Labels: map[string]string{"org.opencontainers.image.title": "busybox", "org.opencontainers.image.version": version, "vco-lab.source": "Debian busybox-static " + version},
	}, "Debian busybox-static "+version)
}

// busyboxRoot is the root of the busybox images: Debian's busybox-static
// with a link for each applet at the path it lists, users, /tmp, /root.
func busyboxRoot(ctx context.Context) (rootfs, error) {
	bin, err := os.ReadFile(BusyboxPath)
	if err != nil {
		return nil, fmt.Errorf("reading %s of busybox-static: %w", BusyboxPath, err)
	}
	if err := staticAMD64(BusyboxPath, bin); err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, BusyboxPath, "--list-full").Output()
	if err != nil {
		return nil, fmt.Errorf("%s --list-full: %w", BusyboxPath, err)
	}
	r := rootfs{}
	r.users()
	r.dir("/root", 0o700)
	r.file("/bin/busybox", 0o755, bin)
	for _, applet := range strings.Fields(string(out)) {
		p := "/" + strings.TrimPrefix(applet, "/")
		if p != "/bin/busybox" {
			r.symlink(p, "/bin/busybox")
		}
	}
	return r, nil
}

func shortHash(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:6])
}
