package images

import (
	"archive/tar"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// manifestSample is an excerpt of test/utils/image/manifest.go of
// Kubernetes v1.34.2, as ParseE2EManifest reads it.
const manifestSample = `
func initImageConfigs(list RegistryList) (map[ImageID]Config, map[ImageID]Config) {
	configs := map[ImageID]Config{}
	configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.56"}
	configs[AgnhostPrivate] = Config{list.PrivateRegistry, "agnhost", "2.6"}
	configs[BusyBox] = Config{list.PromoterE2eRegistry, "busybox", "1.37.0-1"}
	configs[Httpd] = Config{list.PromoterE2eRegistry, "httpd", "2.4.38-4"}
	configs[JessieDnsutils] = Config{list.PromoterE2eRegistry, "jessie-dnsutils", "1.7"}
	configs[Nginx] = Config{list.PromoterE2eRegistry, "nginx", "1.14-4"}
	configs[NginxNew] = Config{list.PromoterE2eRegistry, "nginx", "1.15-4"}
	configs[Pause] = Config{list.GcRegistry, "pause", "3.10.1"}
`

func TestParseE2EManifest(t *testing.T) {
	got, err := ParseE2EManifest([]byte(manifestSample))
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, e := range got {
		refs = append(refs, e.Ref())
	}
	want := "registry.k8s.io/e2e-test-images/busybox:1.37.0-1 registry.k8s.io/e2e-test-images/agnhost:2.56 " +
		"registry.k8s.io/e2e-test-images/nginx:1.14-4 registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"
	if strings.Join(refs, " ") != want {
		t.Errorf("images %v, want %s", refs, want)
	}
	// A manifest that moved an image elsewhere is refused, not guessed at.
	moved := strings.Replace(manifestSample, `configs[Nginx] = Config{list.PromoterE2eRegistry`, `configs[Nginx] = Config{list.DockerLibraryRegistry`, 1)
	if _, err := ParseE2EManifest([]byte(moved)); err == nil || !strings.Contains(err.Error(), "Nginx") {
		t.Errorf("a manifest without Nginx in the promoter registry: %v, want an error naming it", err)
	}
}

func TestRepoListPointsAtTheLabRegistry(t *testing.T) {
	got := RepoList("10.0.2.100:5000")
	for _, line := range []string{"promoterE2eRegistry: 10.0.2.100:5000/e2e-test-images", "gcRegistry: 10.0.2.100:5000"} {
		if !strings.Contains(got, line+"\n") {
			t.Errorf("repo list %q lacks %q", got, line)
		}
	}
}

// The stand-in images carry the suite's names and a shell; served from
// the registry under the path the repo list points the suite at.
func TestBusyboxStandInsThroughTheRegistry(t *testing.T) {
	if _, err := os.Stat(BusyboxPath); err != nil {
		t.Skipf("busybox-static is not installed (%v)", err)
	}
	bbVersion, err := busyboxVersion()
	if err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	b := &builder{cache: cache, logf: t.Logf}
	imgs, err := ParseE2EManifest([]byte(manifestSample))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var jobs []job
	for _, e := range imgs {
		if e.ID == "Agnhost" {
			continue
		}
		var extra *hostFiles
		if e.ID == "JessieDnsutils" {
			if extra, err = gnuDD(); err != nil {
				t.Fatal(err)
			}
		}
		jobs = append(jobs, job{e.Ref(), cacheKey(e.Ref()), func(ctx context.Context) (v1.Image, error) { return b.busyboxAs(ctx, e, bbVersion, extra) }})
	}
	built, err := run(ctx, cache, t.Logf, jobs)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := Serve(ctx, "127.0.0.1:0", built)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	for _, ref := range []string{"e2e-test-images/nginx:1.14-4", "e2e-test-images/jessie-dnsutils:1.7", "e2e-test-images/busybox:1.37.0-1"} {
		checkStandIn(t, reg, ref)
	}
}

// The populator's reference comes from the suite's own Deployment, so the
// lab serves what the pinned suite applies; a Deployment that names no
// hello-populator image is refused, not guessed at.
func TestParsePopulatorManifest(t *testing.T) {
	src := `    spec:
      containers:
        - name: hello
          image: registry.k8s.io/sig-storage/hello-populator:v1.0.1
          args:
            - --image-name=registry.k8s.io/sig-storage/hello-populator:v1.0.1
`
	ref, tag, err := ParsePopulatorManifest([]byte(src))
	if err != nil || ref != "registry.k8s.io/sig-storage/hello-populator:v1.0.1" || tag != "v1.0.1" {
		t.Errorf("ParsePopulatorManifest = %q, %q, %v; want the Deployment's image and tag v1.0.1", ref, tag, err)
	}
	moved := strings.Replace(src, "image: registry.k8s.io/sig-storage/", "image: example.org/", 1)
	if _, _, err := ParsePopulatorManifest([]byte(moved)); err == nil || !strings.Contains(err.Error(), "hello-populator") {
		t.Errorf("a Deployment with the image elsewhere: %v, want an error naming hello-populator", err)
	}
}

// checkStandIn pulls ref from reg and checks it is the stand-in the suite
// needs: titled by its name, a shell and the commands the patterns run;
// GNU dd (with its loader) in jessie-dnsutils only.
func checkStandIn(t *testing.T, reg *Registry, ref string) {
	t.Helper()
	dst, err := reg.Ref("registry.k8s.io/" + ref)
	if err != nil {
		t.Fatal(err)
	}
	if dst.String() != reg.Host+"/"+ref {
		t.Errorf("served as %s, want %s/%s", dst, reg.Host, ref)
	}
	img, err := remote.Image(dst)
	if err != nil {
		t.Fatalf("pulling %s: %v", dst, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if title := cf.Config.Labels["org.opencontainers.image.title"]; !strings.HasPrefix(ref, "e2e-test-images/"+title+":") {
		t.Errorf("%s is titled %q", ref, title)
	}
	fs := files(t, img)
	for _, p := range []string{"/bin/sh", "/bin/dd", "/usr/bin/sha256sum", "/bin/sleep"} {
		if fs[p] == nil {
			t.Errorf("%s has no %s", ref, p)
		}
	}
	// The concurrent-access pods write with oflag=nocache, which
	// only GNU dd takes: jessie-dnsutils has it, with its loader.
	gnu := strings.Contains(ref, "jessie-dnsutils")
	if dd := fs["/bin/dd"]; dd != nil && (dd.Typeflag == tar.TypeReg) != gnu {
		t.Errorf("%s: /bin/dd is a regular file %v, want %v (GNU dd only in jessie-dnsutils)", ref, dd.Typeflag == tar.TypeReg, gnu)
	}
	if gnu && fs["/lib64/ld-linux-x86-64.so.2"] == nil {
		t.Errorf("%s has GNU dd without its loader", ref)
	}
}
