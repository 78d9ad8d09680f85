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

// cacheEntry is the cache directory of the build module's binaries:
// cacheDir/k8s/<version>-<digest of the build module>, so a change of
// go.mod, go.sum, the lab's own sources there or the Go release builds
// anew.
func cacheEntry(cacheDir string) (string, error) {
	src := buildDir()
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum", "cmd/lab-etcd/main.go", "e2e/deps.go"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			return "", fmt.Errorf("the Kubernetes build module: %w", err)
		}
		fmt.Fprintf(h, "%s\n%s\n", f, b)
	}
	fmt.Fprintf(h, "%s %s\n", runtime.Version(), ldflags())
	return filepath.Join(cacheDir, "k8s", Version+"-"+hex.EncodeToString(h.Sum(nil))[:12]), nil
}

// Build returns the cluster's binaries, building them into the cache
// (cacheEntry) unless a build of the same inputs is there. The first
// build compiles about 2500 packages: about 15 minutes on 2 cores with an
// empty Go build cache.
func Build(ctx context.Context, cacheDir string, log io.Writer) (*Binaries, error) {
	dir, err := cacheEntry(cacheDir)
	if err != nil {
		return nil, err
	}
	b := &Binaries{Dir: dir,
		APIServer: filepath.Join(dir, "kube-apiserver"), ControllerManager: filepath.Join(dir, "kube-controller-manager"),
		Scheduler: filepath.Join(dir, "kube-scheduler"), Kubelet: filepath.Join(dir, "kubelet"),
		Kubectl: filepath.Join(dir, "kubectl"), Etcd: filepath.Join(dir, "lab-etcd")}
	what := fmt.Sprintf("Kubernetes %s (%s)", Version, strings.Join(commandNames(), ", "))
	args := append([]string{"build", "-trimpath", "-ldflags", ldflags(), "-o", dir + "/"}, commands...)
	if err := buildOnce(ctx, cacheDir, dir, ".complete", what, "about 15 minutes", args, log); err != nil {
		return nil, err
	}
	return b, nil
}

// E2ETest returns Kubernetes' end-to-end test binary, e2e.test (`go test
// -c k8s.io/kubernetes/test/e2e`), built from the same module, sources
// and flags as the cluster's binaries and cached beside them. e2e/deps.go
// keeps its test imports in go.mod and go.sum. The first build compiles
// about 3000 packages more than the cluster's.
func E2ETest(ctx context.Context, cacheDir string, log io.Writer) (string, error) {
	dir, err := cacheEntry(cacheDir)
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "e2e.test")
	// -vet=off: upstream's tests are not ours to vet, and vetting them
	// takes minutes.
	args := []string{"test", "-c", "-vet=off", "-trimpath", "-ldflags", ldflags(), "-o", bin, "k8s.io/kubernetes/test/e2e"}
	if err := buildOnce(ctx, cacheDir, dir, ".e2e-complete", "Kubernetes "+Version+" e2e.test", "about 40 minutes", args, log); err != nil {
		return "", err
	}
	return bin, nil
}

// buildOnce runs the go command with args in the build module unless
// dir/marker says it ran to the end before; the marker is written last,
// and one build at a time holds cacheDir/k8s/lock.
func buildOnce(ctx context.Context, cacheDir, dir, marker, what, takes string, args []string, log io.Writer) error {
	done := filepath.Join(dir, marker)
	if _, err := os.Stat(done); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Join(cacheDir, "k8s"), 0o755); err != nil {
		return err
	}
	unlock, err := lab.LockFile(filepath.Join(cacheDir, "k8s", "lock"))
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := os.Stat(done); err == nil {
		return nil // built by another process while we waited
	}
	fmt.Fprintf(log, "k8s: building %s into %s; the first build takes %s on 2 cores\n", what, dir, takes)
	start := time.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = buildDir()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s in %s: %w\n%s", what, cmd.Dir, err, out)
	}
	if err := os.WriteFile(done, []byte(time.Since(start).String()+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(log, "k8s: built %s in %s\n", what, time.Since(start).Round(time.Second))
	return nil
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
