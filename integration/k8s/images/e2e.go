package images

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// E2ERegistry is where Kubernetes' end-to-end suite takes its test images
// from (its promoterE2eRegistry); the lab serves them under these names.
const E2ERegistry = "registry.k8s.io/e2e-test-images"

// E2EImage is one test image of the suite, by the ImageID of
// test/utils/image/manifest.go in the pinned Kubernetes source.
type E2EImage struct {
	ID, Name, Tag string
}

// Ref is the image's reference in the suite's default registry.
func (e E2EImage) Ref() string { return E2ERegistry + "/" + e.Name + ":" + e.Tag }

// e2eImageIDs are the images the External Storage patterns pull, found in
// test/e2e/storage and the framework packages it uses (pinned source):
//   - BusyBox: every pod of the framework's e2epod (GetDefaultTestImage)
//     on Linux nodes, and the volume tester pods;
//   - Agnhost: the subPath patterns' containers (mounttest) and
//     e2epod.MakePod's;
//   - Nginx: volumes.go's "should allow exec of files on the volume" pod,
//     which runs a /bin/sh script and nothing of nginx;
//   - JessieDnsutils: multivolume.go's concurrent-access pods, which run
//     e2epod's /bin/sh sleep loop and exec sh, dd and sha256sum; their
//     block-mode writes use GNU dd's oflag=nocache, which upstream's
//     image (Debian jessie) has and busybox's dd refuses.
//
// Nginx and JessieDnsutils are served as busybox images under their names:
// the patterns use only a shell and coreutils in them. JessieDnsutils gets
// GNU dd and dash as its shell, the host's, with the C library they load
// (gnuDD).
var e2eImageIDs = []string{"BusyBox", "Agnhost", "Nginx", "JessieDnsutils"}

var e2eConfig = regexp.MustCompile(`(?m)^\s*configs\[(\w+)\]\s*=\s*Config\{list\.PromoterE2eRegistry,\s*"([^"]+)",\s*"([^"]+)"\}`)

// ParseE2EManifest reads the tags of e2eImageIDs from the source of
// test/utils/image/manifest.go, so the lab serves what the pinned suite
// asks for.
func ParseE2EManifest(src []byte) ([]E2EImage, error) {
	found := map[string]E2EImage{}
	for _, m := range e2eConfig.FindAllSubmatch(src, -1) {
		found[string(m[1])] = E2EImage{ID: string(m[1]), Name: string(m[2]), Tag: string(m[3])}
	}
	var out []E2EImage
	for _, id := range e2eImageIDs {
		e, ok := found[id]
		if !ok {
			return nil, fmt.Errorf("test/utils/image/manifest.go names no %s image of the promoter registry; the lab cannot tell which tag the suite pulls", id)
		}
		out = append(out, e)
	}
	return out, nil
}

// RepoList is the suite's registry list (the file KUBE_TEST_REPO_LIST
// names) that points its test images and pause at the lab registry as the
// workers reach it, host:port (containerd there speaks plain HTTP to it).
func RepoList(host string) string {
	return fmt.Sprintf("promoterE2eRegistry: %[1]s/e2e-test-images\ngcRegistry: %[1]s\n", host)
}

// E2EImages returns the test images the External Storage patterns pull,
// under their references in E2ERegistry, building what cacheDir does not
// hold: agnhost from k8s.io/kubernetes/test/images/agnhost of the module
// in buildDir (the cluster's pinned Kubernetes), on the busybox image
// made of Debian's busybox-static, as upstream's agnhost is a program on a
// small shell image; and the example volume populator the provisioning
// pattern deploys (populator.go).
func E2EImages(ctx context.Context, cacheDir, buildDir string, logf Logf) (map[string]v1.Image, error) {
	logf, unlock, err := openCache(cacheDir, logf)
	if err != nil {
		return nil, err
	}
	defer unlock()
	out, err := buildModuleGo(ctx, buildDir, "list", "-m", "-f", "{{.Version}} {{.Dir}}", "k8s.io/kubernetes")
	f := strings.Fields(out)
	if err != nil || len(f) != 2 {
		return nil, fmt.Errorf("finding the pinned Kubernetes source: %v %q", err, out)
	}
	k8sVersion, k8sDir := f[0], f[1]
	src, err := os.ReadFile(filepath.Join(k8sDir, "test", "utils", "image", "manifest.go"))
	if err != nil {
		return nil, fmt.Errorf("the e2e suite's image manifest: %w", err)
	}
	imgs, err := ParseE2EManifest(src)
	if err != nil {
		return nil, err
	}
	bbVersion, err := busyboxVersion()
	if err != nil {
		return nil, err
	}
	b := &builder{cache: cacheDir, logf: logf}
	var jobs []job
	for _, e := range imgs {
		key := cacheKey(e.Ref()) + "-" + sanitize(bbVersion)
		switch e.ID {
		case "Agnhost":
			key += "-k8s" + sanitize(k8sVersion)
			jobs = append(jobs, job{e.Ref(), key, func(ctx context.Context) (v1.Image, error) {
				return b.agnhost(ctx, buildDir, e, k8sVersion, bbVersion)
			}})
		case "JessieDnsutils":
			dd, err := gnuDD()
			if err != nil {
				return nil, err
			}
			key += "-" + sanitize(dd.version) + "-" + dd.hash
			jobs = append(jobs, job{e.Ref(), key, func(ctx context.Context) (v1.Image, error) {
				return b.busyboxAs(ctx, e, bbVersion, dd)
			}})
		default:
			jobs = append(jobs, job{e.Ref(), key, func(ctx context.Context) (v1.Image, error) {
				return b.busyboxAs(ctx, e, bbVersion, nil)
			}})
		}
	}
	pop, err := b.populatorJob(k8sDir)
	if err != nil {
		return nil, err
	}
	jobs = append(jobs, pop)
	return run(ctx, cacheDir, logf, jobs)
}

// busyboxAs is the busybox image under e's name (see e2eImageIDs), with
// the files of extra (GNU dd) when it is not nil.
func (b *builder) busyboxAs(ctx context.Context, e E2EImage, bbVersion string, extra *hostFiles) (v1.Image, error) {
	r, err := busyboxRoot(ctx)
	if err != nil {
		return nil, err
	}
	src := "Debian busybox-static " + bbVersion
	if e.ID != "BusyBox" {
		src += ", served as " + e.Name + ": the storage patterns run only /bin/sh and its applets in it"
	}
	if extra != nil {
		for p, data := range extra.files {
			r.file(p, 0o755, data)
		}
		src += "; with " + extra.version
	}
	b.logf("image %s: %s", e.Ref(), src)
	return image(r, v1.Config{
		Cmd:    []string{"/bin/sh"},
		Labels: map[string]string{"org.opencontainers.image.title": e.Name, "org.opencontainers.image.version": e.Tag, "vco-lab.source": src},
	}, src)
}

// agnhost builds the suite's agnhost program from the pinned Kubernetes
// module and lays it out as upstream's image: /agnhost (and agnhost-2),
// /uploads, entrypoint /agnhost pause.
func (b *builder) agnhost(ctx context.Context, buildDir string, e E2EImage, k8sVersion, bbVersion string) (v1.Image, error) {
	start := time.Now()
	dir, done, err := b.workDir("agnhost")
	if err != nil {
		return nil, err
	}
	defer done()
	b.logf("image %s: building k8s.io/kubernetes/test/images/agnhost of Kubernetes %s (minutes on a cold Go build cache)", e.Ref(), k8sVersion)
	bin := filepath.Join(dir, "agnhost")
	if _, err := buildModuleGo(ctx, buildDir, "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "k8s.io/kubernetes/test/images/agnhost"); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	if err := staticAMD64(bin, data); err != nil {
		return nil, err
	}
	r, err := busyboxRoot(ctx)
	if err != nil {
		return nil, err
	}
	r.file("/agnhost", 0o755, data)
	r.symlink("/agnhost-2", "agnhost")
	r.dir("/uploads", 0o755)
	src := "k8s.io/kubernetes/test/images/agnhost@" + k8sVersion + " on Debian busybox-static " + bbVersion
	img, err := image(r, v1.Config{
		Entrypoint: []string{"/agnhost"},
		Cmd:        []string{"pause"},
		Labels:     map[string]string{"org.opencontainers.image.title": "agnhost", "org.opencontainers.image.version": e.Tag, "vco-lab.source": src},
	}, src)
	if err == nil {
		b.logf("image %s: built in %s", e.Ref(), time.Since(start).Round(time.Second))
	}
	return img, err
}

// buildModuleGo runs the go command in the Kubernetes build module as its
// go.mod and go.sum pin it (-mod=readonly).
func buildModuleGo(ctx context.Context, dir string, args ...string) (string, error) {
	return goWith(ctx, dir, "-mod=readonly -buildvcs=false", args...)
}

// hostFiles are files of the host's Debian packages put into an image.
type hostFiles struct {
	version, hash string
	files         map[string][]byte
}

// gnuDD is GNU coreutils' dd of the host (Debian's /bin/dd) and Debian's
// dash as /bin/sh, with the C library and loader they are linked to, at
// the same paths: busybox's shell runs its own dd applet whatever the
// PATH says, so the image's shell is dash, as upstream's Debian image's
// is, and its dd is GNU's; every other command stays a busybox applet.
func gnuDD() (*hostFiles, error) {
	h := &hostFiles{files: map[string][]byte{}}
	var versions []string
	for _, pkg := range []string{"coreutils", "dash"} {
		out, err := exec.Command("dpkg-query", "-W", "-f", "${Version} ${Architecture}", pkg).Output()
		f := strings.Fields(string(out))
		if err != nil || len(f) != 2 || f[1] != "amd64" {
			return nil, fmt.Errorf("the lab's jessie-dnsutils image takes GNU dd and dash from the host's %s (amd64): dpkg-query says %q (%v)", pkg, out, err)
		}
		versions = append(versions, pkg+" "+f[0])
	}
	h.version = "GNU dd and /bin/sh of Debian " + strings.Join(versions, " and ")
	var all []byte
	for _, f := range [][2]string{{"/bin/dd", "/bin/dd"}, {"/bin/sh", "/bin/dash"},
		{"/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"}, {"/lib64/ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2"}} {
		to, from := f[0], f[1]
		data, err := os.ReadFile(from)
		if err != nil {
			return nil, fmt.Errorf("the lab's jessie-dnsutils image takes GNU dd and dash from the host: %w", err)
		}
		h.files[to] = data
		all = append(all, data...)
	}
	h.hash = shortHash(all)
	return h, nil
}
