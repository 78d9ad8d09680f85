package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

// runMake runs the repository's Makefile as an operator would, with the
// files going to a temporary directory, and returns stdout and stderr.
func runMake(t *testing.T, dir string, args ...string) (stdout, stderr []byte, err error) {
	t.Helper()
	mk, lerr := exec.LookPath("make")
	if lerr != nil {
		if os.Getenv("VCO_DEPLOY_REQUIRE_TOOLS") != "" {
			t.Fatal("make is not installed")
		}
		t.Skip("make is not installed")
	}
	cmd := exec.Command(mk, args...)
	cmd.Dir = dir
	// Not a sub-make of whatever runs the tests: a sub-make prints
	// "Entering directory" lines on stdout.
	for _, e := range os.Environ() {
		if k, _, _ := strings.Cut(e, "="); k != "MAKEFLAGS" && k != "MAKELEVEL" && k != "MFLAGS" {
			cmd.Env = append(cmd.Env, e)
		}
	}
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.Bytes(), e.Bytes(), err
}

// kinds parses a multi-document YAML stream and lists "apiVersion kind
// name" of each object; it fails on anything that is not a Kubernetes
// object, such as a line make echoed.
func kinds(t *testing.T, stream []byte) []string {
	t.Helper()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(stream)))
	var out []string
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("stdout is not a YAML stream: %v", err)
		}
		var o struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &o); err != nil {
			t.Fatalf("stdout holds a document that is not YAML: %v\n%s", err, doc)
		}
		if o.APIVersion == "" && o.Kind == "" && strings.TrimSpace(stripComments(doc)) == "" {
			continue // comments only
		}
		if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
			t.Fatalf("stdout holds a document that is not a Kubernetes object:\n%s", doc)
		}
		out = append(out, o.APIVersion+" "+o.Kind+" "+o.Metadata.Name)
	}
}

func stripComments(doc []byte) string {
	var b strings.Builder
	for _, l := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// TestMakeCSIAddonPrintsTheAddon: `make csi-addon VCO_CSI_IMAGE=... |
// kubectl apply -f -` installs the add-on, so stdout carries exactly the
// rendered add-on (the file it keeps) and nothing else; the snapshots part
// joins it only with VCO_CSI_SNAPSHOTS=1.
func TestMakeCSIAddonPrintsTheAddon(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	out := filepath.Join(tmp, "dist")
	image := "registry.try.whitesky.cloud/vco/csi:1.0"
	vars := []string{"VCO_CSI_IMAGE=" + image, "ADDON_DIR=" + out, "BIN=" + filepath.Join(tmp, "bin")}
	wantCore, wantSnaps, files := addonParts(t, image)

	for _, c := range []struct {
		name string
		args []string
		want []byte
	}{
		{"make", append([]string{"csi-addon"}, vars...), wantCore},
		{"make -s -C", append([]string{"-s", "-C", root, "csi-addon"}, vars...), wantCore},
		{"snapshots", append([]string{"csi-addon", "VCO_CSI_SNAPSHOTS=1"}, vars...), append(bytes.Clone(wantCore), wantSnaps...)},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := root
			if slices.Contains(c.args, "-C") {
				dir = tmp
			}
			stdout, stderr, err := runMake(t, dir, c.args...)
			if err != nil {
				t.Fatalf("make %q: %v\n%s", c.args, err, stderr)
			}
			if !bytes.Equal(stdout, c.want) {
				t.Fatalf("make %q: stdout is not the rendered add-on; it begins\n%s", c.args, head(stdout))
			}
			for name, want := range files {
				got, err := os.ReadFile(filepath.Join(out, name))
				if err != nil || !bytes.Equal(got, want) {
					t.Errorf("make %q kept %s (%v) different from the part it should hold", c.args, name, err)
				}
			}
			objs := kinds(t, stdout)
			snapshotObjs := countSnapshotObjects(objs)
			if wantSnapshots := c.name == "snapshots"; wantSnapshots != (snapshotObjs == 1) || snapshotObjs > 1 {
				t.Errorf("make %q printed %d snapshot.storage.k8s.io objects (%v)", c.args, snapshotObjs, objs)
			}
			if !bytes.Contains(stderr, []byte(filepath.Join(out, "csi-addon.yaml"))) {
				t.Errorf("make %q: stderr does not say where the add-on was kept:\n%s", c.args, stderr)
			}
		})
	}

	for _, args := range [][]string{
		{"csi-addon", "ADDON_DIR=" + out},
		{"csi-addon", "VCO_CSI_SNAPSHOTS=maybe", "VCO_CSI_IMAGE=" + image, "ADDON_DIR=" + out},
	} {
		stdout, stderr, err := runMake(t, root, args...)
		if err == nil || len(stdout) != 0 || !bytes.Contains(stderr, []byte("make csi-addon:")) {
			t.Errorf("make %q: %v, stdout %q, stderr %q; want a failure explained on stderr and nothing on stdout", args, err, head(stdout), stderr)
		}
	}
}

// TestMakeCSIAddonTakesTheAgentGID: VCO_AGENT_GID gives the node pod the
// nodes' vco-agent gid where it is not the packages' 573, and only that
// changes; a value that is not a gid fails, said on stderr, with nothing
// on stdout.
func TestMakeCSIAddonTakesTheAgentGID(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	image := "registry.try.whitesky.cloud/vco/csi:1.0"
	vars := []string{"VCO_CSI_IMAGE=" + image, "ADDON_DIR=" + filepath.Join(tmp, "dist"), "BIN=" + filepath.Join(tmp, "bin")}
	core, err := deploy.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	want, err := deploy.Render(core, deploy.Values{Image: image, DriverName: "cloud.whitesky.try.csi", AgentGID: 4242})
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr, err := runMake(t, root, append([]string{"csi-addon", "VCO_AGENT_GID=4242"}, vars...)...)
	if err != nil || !bytes.Equal(stdout, want) || !bytes.Contains(stdout, []byte("supplementalGroups: [4242]")) {
		t.Fatalf("make csi-addon VCO_AGENT_GID=4242: %v, stdout begins\n%s\nstderr %s", err, head(stdout), stderr)
	}
	def, _, _ := addonParts(t, image)
	if d := diffLines(def, stdout); len(d) != 2 || !strings.Contains(d[0], "supplementalGroups: [573]") {
		t.Errorf("VCO_AGENT_GID=4242 changed %q; want the node pod's supplementalGroups alone", d)
	}
	for _, bad := range []string{"0", "vco-agent", "-5"} {
		stdout, stderr, err := runMake(t, root, append([]string{"csi-addon", "VCO_AGENT_GID=" + bad}, vars...)...)
		if err == nil || len(stdout) != 0 || !bytes.Contains(stderr, []byte("VCO_AGENT_GID")) {
			t.Errorf("make csi-addon VCO_AGENT_GID=%s: %v, stdout %q, stderr %q; want a failure naming VCO_AGENT_GID", bad, err, head(stdout), stderr)
		}
	}
}

// diffLines lists the lines of a and b that differ, in pairs, where both
// have as many lines.
func diffLines(a, b []byte) []string {
	al, bl := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	if len(al) != len(bl) {
		return []string{"line counts differ"}
	}
	var out []string
	for i := range al {
		if al[i] != bl[i] {
			out = append(out, al[i], bl[i])
		}
	}
	return out
}

// addonParts renders the add-on's parts as make csi-addon should with
// image: the core add-on, the snapshots part, and the files it keeps in
// ADDON_DIR (the parts as bundled and as rendered) by name.
func addonParts(t *testing.T, image string) (wantCore, wantSnaps []byte, files map[string][]byte) {
	t.Helper()
	core, err := deploy.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	snaps, err := deploy.BundleOf(deploy.Snapshots)
	if err != nil {
		t.Fatal(err)
	}
	values := deploy.Values{Image: image, DriverName: "cloud.whitesky.try.csi"}
	wantCore, err = deploy.Render(core, values)
	if err != nil {
		t.Fatal(err)
	}
	wantSnaps, err = deploy.Render(snaps, values)
	if err != nil {
		t.Fatal(err)
	}
	files = map[string][]byte{"csi.yaml": core, "csi-snapshots.yaml": snaps,
		"csi-addon.yaml": wantCore, "csi-snapshots-addon.yaml": wantSnaps}
	return wantCore, wantSnaps, files
}

// countSnapshotObjects counts the snapshot.storage.k8s.io objects of objs
// (as kinds lists them).
func countSnapshotObjects(objs []string) int {
	n := 0
	for _, o := range objs {
		if strings.HasPrefix(o, "snapshot.storage.k8s.io/") {
			n++
		}
	}
	return n
}

func head(b []byte) string {
	if len(b) > 400 {
		b = b[:400]
	}
	return string(b)
}
