package k8s

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// TestInsecureControllerAddsTheOptionToTheControllerOnly: in the release
// bundle, the lab's edit gives the controller's vco-csi container
// --insecure-allow-http after --mode=controller and changes nothing else.
func TestInsecureControllerAddsTheOptionToTheControllerOnly(t *testing.T) {
	in, err := os.ReadFile(filepath.Join(repoRoot(), "deploy", "csi.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := InsecureController(in)
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, doc := range bytes.Split(out, []byte("\n---\n")) {
		var d appsv1.Deployment
		if yaml.Unmarshal(doc, &d) != nil || d.Kind != "Deployment" {
			continue
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			i := slices.Index(c.Args, "--insecure-allow-http")
			switch {
			case d.Name == ControllerName && c.Name == "vco-csi":
				found++
				if i < 1 || c.Args[i-1] != "--mode=controller" {
					t.Errorf("controller args %q, want --insecure-allow-http after --mode=controller", c.Args)
				}
			case i >= 0:
				t.Errorf("%s container %s got the option too", d.Name, c.Name)
			}
		}
	}
	if found != 1 {
		t.Fatalf("%d controller vco-csi containers in the bundle, want 1", found)
	}
	if got := bytes.ReplaceAll(out, []byte("            - --insecure-allow-http\n"), nil); !bytes.Equal(got, in) {
		t.Error("the edit changed more than the one argument")
	}
	if _, err := InsecureController(bytes.ReplaceAll(in, []byte("--mode=controller"), []byte("--mode=all"))); err == nil {
		t.Error("a bundle without the controller's --mode=controller was edited")
	}
}
