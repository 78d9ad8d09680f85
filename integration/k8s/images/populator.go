package images

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// PopulatorManifest is the suite's Deployment of the example volume
// populator, applied by the provisioning pattern "should provision
// storage with any volume data source" (test/e2e/storage/testsuites/
// provisioning.go): a controller that fills a claim whose dataSourceRef
// names a Hello object, by a pod of the same image in --mode=populate.
const PopulatorManifest = "test/e2e/testing-manifests/storage-csi/any-volume-datasource/hello-populator-deploy.yaml"

// PopulatorModule holds the example populator (example/hello-populator).
const PopulatorModule = "github.com/kubernetes-csi/lib-volume-populator"

// populatorFallback is built when the module proxy does not serve the
// manifest's tag: Kubernetes v1.34.2 names hello-populator v1.0.1, and
// the proxy reachable here answers 403 for lib-volume-populator v1.0.x
// (and for its version list) but serves v1.1.0 and v1.2.0, whose example
// takes the same flags (--mode, --image-name, --namespace,
// --http-endpoint).
const populatorFallback = "v1.2.0"

var populatorImage = regexp.MustCompile(`(?m)^\s*image:\s*(registry\.k8s\.io/sig-storage/hello-populator:(v\d+\.\d+\.\d+))\s*$`)

// ParsePopulatorManifest reads the populator's image reference and tag
// from the suite's Deployment of it.
func ParsePopulatorManifest(src []byte) (ref, tag string, err error) {
	m := populatorImage.FindSubmatch(src)
	if m == nil {
		return "", "", fmt.Errorf("%s names no registry.k8s.io/sig-storage/hello-populator image; the lab cannot tell which populator the suite deploys", PopulatorManifest)
	}
	return string(m[1]), string(m[2]), nil
}

// populatorJob is the image job of the suite's example populator, its
// reference read from the pinned Kubernetes source in k8sDir.
func (b *builder) populatorJob(k8sDir string) (job, error) {
	src, err := os.ReadFile(filepath.Join(k8sDir, PopulatorManifest))
	if err != nil {
		return job{}, fmt.Errorf("the suite's populator Deployment: %w", err)
	}
	ref, tag, err := ParsePopulatorManifest(src)
	if err != nil {
		return job{}, err
	}
	// The key names the fallback too: the image under the manifest's tag
	// may be built from it, and a new fallback must build anew.
	key := cacheKey(ref) + "-or-" + populatorFallback
	return job{ref, key, func(ctx context.Context) (v1.Image, error) { return b.populator(ctx, ref, tag) }}, nil
}

// populator builds example/hello-populator of PopulatorModule at tag (or
// populatorFallback) into an image laid out as upstream's: the binary at
// /hello-populator, its entrypoint, run as root as upstream's (the
// populate pod writes into the new volume's root directory).
func (b *builder) populator(ctx context.Context, ref, tag string) (v1.Image, error) {
	start := time.Now()
	dir, done, err := b.moduleWorkDir("hello-populator")
	if err != nil {
		return nil, err
	}
	defer done()
	pkg := PopulatorModule + "/example/hello-populator"
	ver := tag
	if _, err := goRun(ctx, dir, "get", pkg+"@"+tag); err != nil {
		b.logf("image %s: %s@%s is not on the module proxy (%v); building %s and serving it under the manifest's tag", ref, PopulatorModule, tag, strings.SplitN(err.Error(), "\n", 2)[0], populatorFallback)
		ver = populatorFallback
		if _, err := goRun(ctx, dir, "get", pkg+"@"+ver); err != nil {
			return nil, err
		}
	}
	b.logf("image %s: building %s@%s (minutes on a cold Go build cache)", ref, pkg, ver)
	bin, err := goBuild(ctx, dir, pkg, "hello-populator", "")
	if err != nil {
		return nil, err
	}
	r := rootfs{}
	r.users()
	r.file("/hello-populator", 0o755, bin)
	img, err := image(r, v1.Config{
		Entrypoint: []string{"/hello-populator"},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "hello-populator",
			"org.opencontainers.image.version": ver,
			"vco-lab.module":                   PopulatorModule + "@" + ver,
		},
	}, pkg+"@"+ver+" built by go "+runtime.Version())
	if err == nil {
		b.logf("image %s: built %s@%s in %s", ref, PopulatorModule, ver, time.Since(start).Round(time.Second))
	}
	return img, err
}
