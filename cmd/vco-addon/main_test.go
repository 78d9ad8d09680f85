package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

func TestRenderDerivesOrTakesTheDriverName(t *testing.T) {
	tmpl, err := deploy.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		name string
	}{
		{[]string{"-image", "registry.try.whitesky.cloud/vco/csi:1.0"}, "cloud.whitesky.try.csi"},
		{[]string{"-image", "registry.try.whitesky.cloud/vco/csi:1.0", "-driver-name", "cloud.whitesky.csi"}, "cloud.whitesky.csi"},
		{[]string{"-image", "localhost:5000/vco/csi:1.0", "-driver-name", "cloud.whitesky.csi"}, "cloud.whitesky.csi"},
	} {
		out := filepath.Join(t.TempDir(), "addon.yaml")
		if err := runRender(append(tc.args, "-o", out)); err != nil {
			t.Fatalf("render %q: %v", tc.args, err)
		}
		got, _ := os.ReadFile(out)
		want, err := deploy.Render(tmpl, deploy.Values{Image: tc.args[1], DriverName: tc.name})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("render %q is not the bundle rendered for driver %s", tc.args, tc.name)
		}
	}
	err = runRender([]string{"-image", "localhost:5000/vco/csi:1.0", "-o", filepath.Join(t.TempDir(), "x")})
	if err == nil || !strings.Contains(err.Error(), "VCO_CSI_DRIVER_NAME") {
		t.Errorf("render for an image on localhost: %v; want an error asking for VCO_CSI_DRIVER_NAME", err)
	}
}

func TestCreationTime(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "1764417600")
	if got, err := creationTime(""); err != nil || got.Unix() != 1764417600 {
		t.Errorf("from SOURCE_DATE_EPOCH: %v, %v", got, err)
	}
	if got, err := creationTime("2026-11-29T12:00:00+01:00"); err != nil || got.Format("15:04Z07:00") != "11:00Z" {
		t.Errorf("from -created: %v, %v", got, err)
	}
	t.Setenv("SOURCE_DATE_EPOCH", "yesterday")
	if _, err := creationTime(""); err == nil {
		t.Error("accepted SOURCE_DATE_EPOCH=yesterday")
	}
}

// TestParts: -part picks csi.yaml, the opt-in csi-snapshots.yaml, or both
// in that order; only the snapshots part holds the VolumeSnapshotClass.
func TestParts(t *testing.T) {
	core, err := deploy.BundleOf(deploy.Core)
	if err != nil {
		t.Fatal(err)
	}
	snaps, err := deploy.BundleOf(deploy.Snapshots)
	if err != nil {
		t.Fatal(err)
	}
	enc, err := deploy.BundleOf(deploy.Encryption)
	if err != nil {
		t.Fatal(err)
	}
	image := "try.whitesky.cloud/vco/csi:1.0"
	v := deploy.Values{Image: image, DriverName: "cloud.whitesky.csi"}
	for part, tmpl := range map[string][]byte{"": core, "core": core, "snapshots": snaps, "encryption": enc,
		"core,encryption": append(bytes.Clone(core), enc...), "all": append(append(bytes.Clone(core), snaps...), enc...)} {
		var flags []string
		if part != "" {
			flags = []string{"-part", part}
		}
		dir := t.TempDir()
		if err := runBundle(append(flags, "-o", filepath.Join(dir, "b.yaml"))); err != nil {
			t.Fatalf("bundle -part %q: %v", part, err)
		}
		if got, _ := os.ReadFile(filepath.Join(dir, "b.yaml")); !bytes.Equal(got, tmpl) {
			t.Errorf("bundle -part %q is not the part's file", part)
		}
		if err := runRender(append(flags, "-image", image, "-o", filepath.Join(dir, "r.yaml"))); err != nil {
			t.Fatalf("render -part %q: %v", part, err)
		}
		want, err := deploy.Render(tmpl, v)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(filepath.Join(dir, "r.yaml"))
		if !bytes.Equal(got, want) {
			t.Errorf("render -part %q is not the part rendered", part)
		}
		if has, want := bytes.Contains(got, []byte("kind: VolumeSnapshotClass")), part == "snapshots" || part == "all"; has != want {
			t.Errorf("render -part %q: holds a VolumeSnapshotClass: %v, want %v", part, has, want)
		}
		if has, want := bytes.Contains(got, []byte(`encryption: "true"`)), strings.Contains(part, "encryption") || part == "all"; has != want {
			t.Errorf("render -part %q: holds the encrypted class: %v, want %v", part, has, want)
		}
	}
	for _, err := range []error{
		runBundle([]string{"-part", "snapshot", "-o", filepath.Join(t.TempDir(), "x")}),
		runRender([]string{"-part", "snapshot", "-image", image, "-o", filepath.Join(t.TempDir(), "x")}),
		runBundle([]string{"-part", "core,snapshot", "-o", filepath.Join(t.TempDir(), "x")}),
	} {
		if err == nil || !strings.Contains(err.Error(), "snapshots") {
			t.Errorf("-part snapshot: %v; want an error naming the parts", err)
		}
	}
}

// make image writes dist/vco-csi-<tag>.oci.tar tagged as the packages are
// versioned (v1.2.3-4-gabc1234: image 1.2.3-git4.abc1234, package
// 1.2.3+git4.abc1234); it used to take the raw git describe. And the
// commands docs/install.md gives name the file and tag make image writes.
func TestImageTaggedAsThePackages(t *testing.T) {
	dir := t.TempDir()
	// A static amd64 ELF stands in for vco-csi.
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\n\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "vco-csi")
	build := exec.Command("go", "build", "-o", bin, src)
	build.Dir = dir
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building a stand-in: %v\n%s", err, b)
	}
	out := filepath.Join(dir, "dist")
	if err := os.Mkdir(out, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := runImage([]string{"-binary", "amd64=" + bin, "-ca-bundle", "", "-version", "v1.2.3-4-gabc1234", "-out-dir", out}); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(out, "vco-csi-1.2.3-git4.abc1234.oci.tar")
	b, err := exec.Command("tar", "-xOf", archive, "index.json").Output()
	if err != nil {
		t.Fatalf("%s: %v", archive, err)
	}
	var idx struct {
		Manifests []struct {
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	if len(idx.Manifests) != 1 || idx.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "1.2.3-git4.abc1234" {
		t.Errorf("index.json does not tag the image 1.2.3-git4.abc1234: %s", b)
	}

	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	skopeo := regexp.MustCompile(`skopeo copy oci-archive:dist/vco-csi-([^ ]+)\.oci\.tar:(\S+) docker://\S+:(\S+)`)
	m := skopeo.FindStringSubmatch(string(doc))
	if m == nil {
		t.Fatal("docs/install.md has no skopeo copy oci-archive:dist/vco-csi-TAG.oci.tar:TAG docker://...:TAG line")
	}
	if m[1] != m[2] || m[2] != m[3] {
		t.Errorf("docs/install.md copies file tag %s, ref %s, to tag %s: they must be one tag", m[1], m[2], m[3])
	}
	pkg := regexp.MustCompile(`vco-agent_` + regexp.QuoteMeta(m[1]) + `-1_amd64\.deb`)
	if !pkg.Match(doc) {
		t.Errorf("docs/install.md does not show the package vco-agent_%s-1_amd64.deb of the image it deploys", m[1])
	}
}
