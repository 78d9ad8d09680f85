package lab

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// Kernel is an unpacked Debian guest kernel in the cache.
type Kernel struct {
	Version string // e.g. 6.1.0-57-amd64
	Root    string // the unpacked package; modules under lib/modules/<Version>
	Vmlinuz string
}

// DefaultCacheDir is where the guest kernel and built initramfs images are
// kept between runs. VCO_LAB_CACHE overrides it.
func DefaultCacheDir() string {
	if d := os.Getenv("VCO_LAB_CACHE"); d != "" {
		return d
	}
	return "/var/cache/vco-lab"
}

var kernelPkgRe = regexp.MustCompile(`^linux-image-([0-9][^ ]*-amd64)$`)

// kernelPackage asks apt which versioned kernel package the
// linux-image-amd64 metapackage stands for today.
func kernelPackage(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "apt-cache", "depends", "linux-image-amd64").Output()
	if err != nil {
		return "", fmt.Errorf("apt-cache depends linux-image-amd64: %w (run 'apt-get update' so apt knows the kernel package)", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		dep, ok := strings.CutPrefix(line, "Depends: ")
		if !ok {
			continue
		}
		if kernelPkgRe.MatchString(dep) {
			return dep, nil
		}
	}
	return "", fmt.Errorf("apt-cache depends linux-image-amd64 names no linux-image-*-amd64 package:\n%s", out)
}

// EnsureKernel returns the cached guest kernel, fetching and unpacking it
// first if the cache has none. A kernel already in the cache is used as is,
// so the lab works offline once set up; VCO_LAB_KERNEL picks a version
// among several cached ones.
func EnsureKernel(ctx context.Context, cacheDir string) (*Kernel, error) {
	if k, err := cachedKernel(cacheDir); err == nil {
		return k, nil
	}
	pkg, err := kernelPackage(ctx)
	if err != nil {
		return nil, err
	}
	version := strings.TrimPrefix(pkg, "linux-image-")
	kdir := filepath.Join(cacheDir, "kernel")
	if err := os.MkdirAll(kdir, 0o755); err != nil {
		return nil, err
	}
	dl, err := os.MkdirTemp(kdir, ".download-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dl)
	cmd := exec.CommandContext(ctx, "apt-get", "download", pkg)
	cmd.Dir = dl
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("apt-get download %s: %w\n%s", pkg, err, out)
	}
	debs, _ := filepath.Glob(filepath.Join(dl, "*.deb"))
	if len(debs) != 1 {
		return nil, fmt.Errorf("apt-get download %s left %d .deb files in %s, want 1", pkg, len(debs), dl)
	}
	tmpRoot := filepath.Join(dl, "root")
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", debs[0], tmpRoot).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("dpkg-deb -x %s: %w\n%s", debs[0], err, out)
	}
	if out, err := exec.CommandContext(ctx, "depmod", "-b", tmpRoot, version).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("depmod -b %s %s: %w\n%s", tmpRoot, version, err, out)
	}
	final := filepath.Join(kdir, version)
	_ = os.RemoveAll(final)
	if err := os.Rename(tmpRoot, final); err != nil {
		return nil, err
	}
	return cachedKernel(cacheDir)
}

func cachedKernel(cacheDir string) (*Kernel, error) {
	kdir := filepath.Join(cacheDir, "kernel")
	want := os.Getenv("VCO_LAB_KERNEL")
	ents, err := os.ReadDir(kdir)
	if err != nil {
		return nil, err
	}
	var best *Kernel
	var bestTime time.Time
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		if want != "" && e.Name() != want {
			continue
		}
		root := filepath.Join(kdir, e.Name())
		k := &Kernel{Version: e.Name(), Root: root, Vmlinuz: filepath.Join(root, "boot", "vmlinuz-"+e.Name())}
		st, err := os.Stat(k.Vmlinuz)
		if err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(root, "lib", "modules", e.Name(), "modules.dep")); err != nil {
			continue
		}
		if best == nil || st.ModTime().After(bestTime) {
			best, bestTime = k, st.ModTime()
		}
	}
	if best == nil {
		return nil, fmt.Errorf("no unpacked guest kernel in %s", kdir)
	}
	return best, nil
}

// ModuleFiles lists the module files, dependencies first and without
// repeats, that loading the named modules takes. Names built into the
// kernel contribute nothing. A name the kernel does not know is an error.
func (k *Kernel) ModuleFiles(ctx context.Context, names []string) ([]string, error) {
	seen := map[string]bool{}
	var files []string
	for _, name := range names {
		out, err := exec.CommandContext(ctx, "modprobe", "-d", k.Root, "-S", k.Version, "--show-depends", name).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("modprobe --show-depends %s for guest kernel %s: %w\n%s", name, k.Version, err, out)
		}
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) < 2 || f[0] != "insmod" {
				continue // "builtin NAME"
			}
			if !seen[f[1]] {
				seen[f[1]] = true
				files = append(files, f[1])
			}
		}
	}
	return files, nil
}
