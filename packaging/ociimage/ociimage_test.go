package ociimage

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// buildArchive writes an image from stand-in binaries (the image only
// carries them; their content does not matter here).
func buildArchive(t *testing.T) (string, time.Time) {
	t.Helper()
	dir := t.TempDir()
	bins := map[string]string{}
	for _, a := range []string{"amd64", "arm64"} {
		p := filepath.Join(dir, a)
		if err := os.WriteFile(p, []byte("stand-in vco-csi for "+a), 0o755); err != nil {
			t.Fatal(err)
		}
		bins[a] = p
	}
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, []byte("-----BEGIN CERTIFICATE-----\nstand-in\n-----END CERTIFICATE-----\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	idx, err := Build(Options{Version: "v1.2.3", Binaries: bins, CACerts: ca, Created: created, Source: "https://example.invalid/vco"})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "vco-csi-v1.2.3.oci.tar")
	if err := WriteArchive(idx, "v1.2.3", out, created); err != nil {
		t.Fatal(err)
	}
	return out, created
}

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
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, h.Name)
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestArchiveLayout(t *testing.T) {
	archive, created := buildArchive(t)
	dir := t.TempDir()
	untar(t, archive, dir)

	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	topManifest, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(topManifest.Manifests) != 1 || topManifest.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" {
		t.Fatalf("layout index.json: %+v", topManifest.Manifests)
	}
	idx, err := top.ImageIndex(topManifest.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if im.MediaType != "application/vnd.oci.image.index.v1+json" {
		t.Errorf("index media type %s", im.MediaType)
	}
	var arches []string
	for _, d := range im.Manifests {
		arches = append(arches, d.Platform.OS+"/"+d.Platform.Architecture)
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		checkImage(t, img, d.Platform.Architecture, created)
	}
	if !slices.Equal(arches, []string{"linux/amd64", "linux/arm64"}) {
		t.Errorf("platforms %v", arches)
	}
}

func checkImage(t *testing.T, img v1.Image, arch string, created time.Time) {
	t.Helper()
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Architecture != arch || cf.OS != "linux" {
		t.Errorf("%s: config platform %s/%s", arch, cf.OS, cf.Architecture)
	}
	if cf.Config.User != "65532:65532" {
		t.Errorf("%s: user %q, want the unprivileged 65532:65532", arch, cf.Config.User)
	}
	if !slices.Equal(cf.Config.Entrypoint, []string{"/usr/bin/vco-csi"}) {
		t.Errorf("%s: entrypoint %v", arch, cf.Config.Entrypoint)
	}
	if !cf.Created.Time.Equal(created) || cf.Config.Labels["org.opencontainers.image.version"] != "v1.2.3" {
		t.Errorf("%s: created %v labels %v", arch, cf.Created, cf.Config.Labels)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("%s: layers %d, %v", arch, len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	files := map[string]*tar.Header{}
	contents := map[string][]byte{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = h
		contents[h.Name], _ = io.ReadAll(tr)
	}
	bin := files["usr/bin/vco-csi"]
	if bin == nil || bin.Mode != 0o755 || string(contents["usr/bin/vco-csi"]) != "stand-in vco-csi for "+arch {
		t.Errorf("%s: usr/bin/vco-csi %+v", arch, bin)
	}
	if !bytes.Contains(contents["etc/passwd"], []byte("nonroot:x:65532:65532:")) {
		t.Errorf("%s: /etc/passwd lacks the nonroot user:\n%s", arch, contents["etc/passwd"])
	}
	if files["etc/ssl/certs/ca-certificates.crt"] == nil || files["tmp/"] == nil || files["tmp/"].Mode != 0o1777 {
		t.Errorf("%s: CA bundle or /tmp missing or wrong", arch)
	}
}

// Any OCI tool must load the archive: skopeo reads it per platform.
func TestArchiveLoadsWithSkopeo(t *testing.T) {
	archive, _ := buildArchive(t)
	for _, arch := range []string{"amd64", "arm64"} {
		out, err := exec.Command("skopeo", "inspect", "--override-os", "linux", "--override-arch", arch, "--config", "oci-archive:"+archive+":v1.2.3").Output()
		if err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				t.Fatalf("skopeo inspect %s: %v\n%s", arch, err, ee.Stderr)
			}
			t.Fatalf("skopeo inspect %s: %v", arch, err)
		}
		var cf v1.ConfigFile
		if err := json.Unmarshal(out, &cf); err != nil {
			t.Fatalf("%s: %v\n%s", arch, err, out)
		}
		if cf.Architecture != arch || cf.Config.User != "65532:65532" {
			t.Errorf("skopeo sees %s as %s user %s", arch, cf.Architecture, cf.Config.User)
		}
	}
}

func TestBuildErrors(t *testing.T) {
	if _, err := Build(Options{Version: "v1", CACerts: "/nonexistent"}); err == nil {
		t.Error("no binaries: want an error")
	}
	_, err := Build(Options{Version: "v1", Binaries: map[string]string{"amd64": "/nonexistent/vco-csi"}, CACerts: "/etc/hostname"})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("amd64 binary")) {
		t.Errorf("missing binary: got %v", err)
	}
}
