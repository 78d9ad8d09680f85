package k8s

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// Version is the Kubernetes release the lab builds, pinned in
// build/go.mod together with its staging modules.
const Version = "v1.34.2"

// Binaries are the cluster's programs, built from Kubernetes' sources.
type Binaries struct {
	Dir                                                       string
	APIServer, ControllerManager, Scheduler, Kubelet, Kubectl string
	Etcd                                                      string
}

var commands = []string{
	"k8s.io/kubernetes/cmd/kube-apiserver",
	"k8s.io/kubernetes/cmd/kube-controller-manager",
	"k8s.io/kubernetes/cmd/kube-scheduler",
	"k8s.io/kubernetes/cmd/kubelet",
	"k8s.io/kubernetes/cmd/kubectl",
	"./cmd/lab-etcd",
}

// buildDir is the module that pins the Kubernetes build (build/go.mod),
// kept out of the product's go.mod.
func buildDir() string { return filepath.Join(repoRoot(), "integration", "k8s", "build") }

// Build returns the cluster's binaries, building them into the cache
// (cacheDir/k8s/<version>-<digest of the build module>) unless a build of
// the same inputs is there. The first build compiles about 2500 packages:
// about 15 minutes on 2 cores with an empty Go build cache.
func Build(ctx context.Context, cacheDir string, log io.Writer) (*Binaries, error) {
	src := buildDir()
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum", "cmd/lab-etcd/main.go"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			return nil, fmt.Errorf("the Kubernetes build module: %w", err)
		}
		fmt.Fprintf(h, "%s\n%s\n", f, b)
	}
	fmt.Fprintf(h, "%s %s\n", runtime.Version(), ldflags())
	dir := filepath.Join(cacheDir, "k8s", Version+"-"+hex.EncodeToString(h.Sum(nil))[:12])
	b := &Binaries{Dir: dir,
		APIServer: filepath.Join(dir, "kube-apiserver"), ControllerManager: filepath.Join(dir, "kube-controller-manager"),
		Scheduler: filepath.Join(dir, "kube-scheduler"), Kubelet: filepath.Join(dir, "kubelet"),
		Kubectl: filepath.Join(dir, "kubectl"), Etcd: filepath.Join(dir, "lab-etcd")}
	done := filepath.Join(dir, ".complete")
	if _, err := os.Stat(done); err == nil {
		return b, nil
	}
	if err := os.MkdirAll(filepath.Join(cacheDir, "k8s"), 0o755); err != nil {
		return nil, err
	}
	unlock, err := lab.LockFile(filepath.Join(cacheDir, "k8s", "lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()
	if _, err := os.Stat(done); err == nil {
		return b, nil // built by another process while we waited
	}
	fmt.Fprintf(log, "k8s: building Kubernetes %s (%s) into %s; the first build takes about 15 minutes on 2 cores\n",
		Version, strings.Join(commandNames(), ", "), dir)
	start := time.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	args := append([]string{"build", "-trimpath", "-ldflags", ldflags(), "-o", dir + "/"}, commands...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building Kubernetes %s in %s: %w\n%s", Version, src, err, out)
	}
	if err := os.WriteFile(done, []byte(time.Since(start).String()+"\n"), 0o644); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "k8s: built Kubernetes %s in %s\n", Version, time.Since(start).Round(time.Second))
	return b, nil
}

func commandNames() []string {
	var n []string
	for _, c := range commands {
		n = append(n, filepath.Base(c))
	}
	return n
}

// ldflags stamp the release into the binaries, which otherwise report
// v0.0.0-master (the kubelet's version reaches the Node object).
func ldflags() string {
	var minor string
	if p := strings.Split(strings.TrimPrefix(Version, "v"), "."); len(p) > 1 {
		minor = p[1]
	}
	var f []string
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		f = append(f, "-X "+pkg+".gitVersion="+Version, "-X "+pkg+".gitMajor=1", "-X "+pkg+".gitMinor="+minor,
			"-X "+pkg+".gitTreeState=clean")
	}
	return "-s -w " + strings.Join(f, " ")
}
