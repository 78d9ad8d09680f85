package ociimage

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

var created = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// goBuild compiles a package of this module statically for arch.
func goBuild(t *testing.T, pkg, arch, version string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "vco-csi-"+arch)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X main.version="+version, "-o", out, pkg)
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s for %s: %v\n%s", pkg, arch, err, b)
	}
	return out
}

// untar unpacks an archive of regular files and directories into dir.
func untar(t *testing.T, archive, dir string) {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			var data []byte
			if data, err = io.ReadAll(tr); err == nil {
				err = os.WriteFile(p, data, 0o644)
			}
		default:
			t.Fatalf("%s: unexpected entry type %c in the layout archive", h.Name, h.Typeflag)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// rootfsFiles reads the flattened filesystem of an image.
func rootfsFiles(t *testing.T, img v1.Image) map[string]*tar.Header {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	files := map[string]*tar.Header{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		files[strings.TrimPrefix(h.Name, "/")] = h
	}
}

func readFile(t *testing.T, img v1.Image, name string) []byte {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s not in the image: %v", name, err)
		}
		if strings.TrimPrefix(h.Name, "/") == name {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
	}
}

func TestArchiveReadsBack(t *testing.T) {
	const version = "0.0.0-test"
	bin := goBuild(t, "./cmd/vco-csi", "amd64", version)
	archive := filepath.Join(t.TempDir(), "vco-csi-"+version+".oci.tar")
	o := Options{Version: version, Binaries: map[string]string{"amd64": bin},
		CABundle: writeTemp(t, "ca.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"),
		Created:  created, Source: "https://example.test/vco-storage"}
	if err := WriteArchive(o, archive); err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	untar(t, archive, dir)
	img := theOneImage(t, dir, version)
	checkImageConfig(t, img, version)
	want, _ := os.ReadFile(bin)
	checkImageFiles(t, img, version, want)

	// The same inputs give the same bytes.
	again := filepath.Join(t.TempDir(), "again.oci.tar")
	if err := WriteArchive(o, again); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(archive)
	b, _ := os.ReadFile(again)
	if !bytes.Equal(a, b) {
		t.Error("two builds from the same inputs differ")
	}

	t.Run("skopeo", func(t *testing.T) { inspectWithSkopeo(t, archive, version, "amd64") })
	t.Run("umoci", func(t *testing.T) { unpackWithUmoci(t, dir, version, want) })
}

// theOneImage reads the OCI layout in dir: its index lists one linux/amd64
// OCI image manifest named version, which it returns.
func theOneImage(t *testing.T, dir, version string) v1.Image {
	t.Helper()
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatalf("not an OCI layout: %v", err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 {
		t.Fatalf("index.json lists %d manifests, want 1", len(im.Manifests))
	}
	d := im.Manifests[0]
	if d.Annotations[RefNameAnnotation] != version || d.Platform == nil || d.Platform.Architecture != "amd64" || d.Platform.OS != "linux" {
		t.Errorf("index entry %+v: want ref name %s, linux/amd64", d, version)
	}
	img, err := idx.Image(d.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if mt, _ := img.MediaType(); mt != "application/vnd.oci.image.manifest.v1+json" {
		t.Errorf("manifest media type %s, want an OCI manifest", mt)
	}
	return img
}

// checkImageConfig: the image runs the plugin as the nonroot user, with
// the platform, creation time and version label of the build.
func checkImageConfig(t *testing.T, img v1.Image, version string) {
	t.Helper()
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != "65532:65532" {
		t.Errorf("config user %q, want 65532:65532", cf.Config.User)
	}
	if len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != BinaryPath || len(cf.Config.Cmd) != 0 {
		t.Errorf("entrypoint %q cmd %q, want [%s] and no cmd", cf.Config.Entrypoint, cf.Config.Cmd, BinaryPath)
	}
	if cf.OS != "linux" || cf.Architecture != "amd64" || !cf.Created.Time.Equal(created) {
		t.Errorf("config %s/%s created %v", cf.OS, cf.Architecture, cf.Created)
	}
	if cf.Config.Labels["org.opencontainers.image.version"] != version {
		t.Errorf("labels %v", cf.Config.Labels)
	}
}

// checkImageFiles: the image holds the binary built (want) as a root-owned
// executable, the nonroot user and the CA bundle; the binary as the image
// holds it runs.
func checkImageFiles(t *testing.T, img v1.Image, version string, want []byte) {
	t.Helper()
	files := rootfsFiles(t, img)
	h := files[strings.TrimPrefix(BinaryPath, "/")]
	if h == nil || h.Typeflag != tar.TypeReg || h.Mode&0o111 != 0o111 || h.Uid != 0 {
		t.Fatalf("%s in the image: %+v; want a root-owned executable file", BinaryPath, h)
	}
	got := readFile(t, img, strings.TrimPrefix(BinaryPath, "/"))
	if !bytes.Equal(got, want) {
		t.Errorf("%s in the image differs from the binary built", BinaryPath)
	}
	if p := string(readFile(t, img, "etc/passwd")); !strings.Contains(p, "nonroot:x:65532:65532:") {
		t.Errorf("/etc/passwd lacks the nonroot user:\n%s", p)
	}
	if files[strings.TrimPrefix(CABundlePath, "/")] == nil {
		t.Errorf("no CA bundle at %s", CABundlePath)
	}
	// The binary as the image holds it runs.
	exe := filepath.Join(t.TempDir(), "vco-csi")
	if err := os.WriteFile(exe, got, os.FileMode(h.Mode)&0o777); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(exe, "--version").Output(); err != nil || strings.TrimSpace(string(out)) != version {
		t.Errorf("vco-csi --version from the image: %q, %v; want %s", out, err, version)
	}
}

func TestMultiArchIndex(t *testing.T) {
	const version = "0.0.0-multi"
	o := Options{Version: version, Created: created, Binaries: map[string]string{
		"amd64": goBuild(t, "./cmd/vco-csi", "amd64", version),
		"arm64": goBuild(t, "./cmd/vco-csi", "arm64", version),
	}}
	archive := filepath.Join(t.TempDir(), "multi.oci.tar")
	if err := WriteArchive(o, archive); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	untar(t, archive, dir)
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, _ := idx.IndexManifest()
	if len(im.Manifests) != 1 || im.Manifests[0].Annotations[RefNameAnnotation] != version {
		t.Fatalf("index.json: %+v; want one image index named %s", im.Manifests, version)
	}
	inner, err := idx.ImageIndex(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := inner.IndexManifest()
	var archs []string
	for _, d := range m.Manifests {
		img, err := inner.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, _ := img.ConfigFile()
		if d.Platform == nil || d.Platform.Architecture != cf.Architecture {
			t.Errorf("index says %v, config says %s", d.Platform, cf.Architecture)
		}
		archs = append(archs, cf.Architecture)
	}
	if strings.Join(archs, ",") != "amd64,arm64" {
		t.Errorf("architectures %v, want amd64,arm64", archs)
	}
	t.Run("skopeo", func(t *testing.T) { inspectWithSkopeo(t, archive, version, "arm64") })
}

func TestRefusesWrongBinaries(t *testing.T) {
	static := goBuild(t, "./cmd/vco-csi", "amd64", "x")
	for name, tc := range map[string]struct {
		bins map[string]string
		want string
	}{
		"dynamic":   {map[string]string{"amd64": "/bin/true"}, "dynamically linked"},
		"wrongarch": {map[string]string{"arm64": static}, "not arm64"},
		"notelf":    {map[string]string{"amd64": writeTemp(t, "script", "#!/bin/sh\n")}, "not an ELF"},
	} {
		_, _, err := Build(Options{Version: "x", Binaries: tc.bins, Created: created})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, tc.want)
		}
	}
}

func writeTemp(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// tool finds an OCI tool; under `make test-deploy` (VCO_DEPLOY_REQUIRE_TOOLS
// set) a missing one fails, as `make deps` installs it.
func tool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("VCO_DEPLOY_REQUIRE_TOOLS") != "" {
			t.Fatalf("%s is not installed; run make deps", name)
		}
		t.Skipf("%s is not installed (make deps installs it)", name)
	}
	return p
}

func inspectWithSkopeo(t *testing.T, archive, version, arch string) {
	skopeo := tool(t, "skopeo")
	cmd := exec.Command(skopeo, "--override-os", "linux", "--override-arch", arch, "inspect", "--config", "oci-archive:"+archive+":"+version)
	cmd.Env = append(os.Environ(), "TMPDIR="+t.TempDir())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("skopeo inspect: %v\n%s", err, exitStderr(err))
	}
	var cf v1.ConfigFile
	if err := json.Unmarshal(out, &cf); err != nil {
		t.Fatalf("skopeo's config: %v\n%s", err, out)
	}
	if cf.Config.User != "65532:65532" || len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != BinaryPath || cf.Architecture != arch {
		t.Errorf("skopeo reads user %q entrypoint %q arch %s", cf.Config.User, cf.Config.Entrypoint, cf.Architecture)
	}
}

func unpackWithUmoci(t *testing.T, layoutDir, version string, binary []byte) {
	umoci := tool(t, "umoci")
	bundle := filepath.Join(t.TempDir(), "bundle")
	if out, err := exec.Command(umoci, "unpack", "--rootless", "--image", layoutDir+":"+version, bundle).CombinedOutput(); err != nil {
		t.Fatalf("umoci unpack: %v\n%s", err, out)
	}
	raw, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var spec struct {
		Process struct {
			User struct{ UID, GID uint32 } `json:"user"`
			Args []string                  `json:"args"`
		} `json:"process"`
	}
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	if spec.Process.User.UID != UID || spec.Process.User.GID != GID || len(spec.Process.Args) == 0 || spec.Process.Args[0] != BinaryPath {
		t.Errorf("umoci's runtime config: user %+v args %q", spec.Process.User, spec.Process.Args)
	}
	p := filepath.Join(bundle, "rootfs", BinaryPath)
	st, err := os.Stat(p)
	if err != nil || st.Mode()&0o111 == 0 {
		t.Fatalf("unpacked %s: %v %v", BinaryPath, st, err)
	}
	if got, _ := os.ReadFile(p); !bytes.Equal(got, binary) {
		t.Errorf("unpacked %s differs from the binary built", BinaryPath)
	}
}

func exitStderr(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(ee.Stderr)
	}
	return ""
}
