package story

import (
	"bytes"
	"testing"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// TestCRSBundleFitsAConfigMap: the rendered add-on CAPVCO puts in one
// ConfigMap stays under the 1 MiB the API server lets a ConfigMap's
// values hold, and under the 256 KiB of annotations a client-side
// kubectl apply of that ConfigMap adds a copy of it to; the margin is
// logged (docs/csi-addon.md quotes it).
func TestCRSBundleFitsAConfigMap(t *testing.T) {
	b, err := crsBundle()
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("${")) {
		t.Fatal("the rendered add-on still holds a placeholder")
	}
	const annotationLimit = 256 << 10
	if len(b) >= annotationLimit {
		t.Errorf("the rendered add-on is %d bytes: a client-side kubectl apply of its ConfigMap would exceed the %d bytes of annotations", len(b), annotationLimit)
	}
	if len(b) >= ConfigMapLimit {
		t.Errorf("the rendered add-on is %d bytes, over the %d a ConfigMap may hold", len(b), ConfigMapLimit)
	}
	t.Logf("rendered csi.yaml: %d bytes, %.1f%% of a ConfigMap's %d, %.1f%% of the annotations' %d",
		len(b), 100*float64(len(b))/ConfigMapLimit, ConfigMapLimit, 100*float64(len(b))/annotationLimit, annotationLimit)
}

// TestWithRevisionAnnotatesTheWorkloadsOnly: the upgrade K14 delivers
// sets the revision on the controller's and the node plugin's pod
// templates and leaves every other document byte for byte.
func TestWithRevisionAnnotatesTheWorkloadsOnly(t *testing.T) {
	in, err := crsBundle()
	if err != nil {
		t.Fatal(err)
	}
	out, err := withRevision(in, "2")
	if err != nil {
		t.Fatal(err)
	}
	ind, outd := bytes.Split(in, []byte("\n---\n")), bytes.Split(out, []byte("\n---\n"))
	if len(ind) != len(outd) {
		t.Fatalf("%d documents became %d", len(ind), len(outd))
	}
	seen := map[string]bool{}
	for i := range ind {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal(ind[i], &meta); err != nil {
			t.Fatal(err)
		}
		switch meta.Kind {
		case "Deployment", "DaemonSet":
			var before, after appsv1.Deployment // the template sits at the same path in both kinds
			if yaml.Unmarshal(ind[i], &before) != nil || yaml.Unmarshal(outd[i], &after) != nil {
				t.Fatalf("document %d does not parse", i+1)
			}
			if got := after.Spec.Template.Annotations[RevisionAnnotation]; got != "2" {
				t.Errorf("%s %s: revision %q, want 2", meta.Kind, after.Name, got)
			}
			delete(after.Spec.Template.Annotations, RevisionAnnotation)
			if len(after.Spec.Template.Annotations) == 0 {
				after.Spec.Template.Annotations = nil
			}
			b1, _ := yaml.Marshal(before)
			b2, _ := yaml.Marshal(after)
			if !bytes.Equal(b1, b2) {
				t.Errorf("%s %s changed beyond the annotation", meta.Kind, after.Name)
			}
			seen[after.Name] = true
		default:
			if !bytes.Equal(ind[i], outd[i]) {
				t.Errorf("document %d (%s) changed", i+1, meta.Kind)
			}
		}
	}
	if !seen[k8s.ControllerName] || !seen[k8s.NodeName] || len(seen) != 2 {
		t.Errorf("annotated %v, want %s and %s", seen, k8s.ControllerName, k8s.NodeName)
	}
	if !bytes.HasSuffix(out, []byte("\n")) {
		t.Error("the upgraded add-on lost its final newline")
	}
	if _, err := withRevision([]byte("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n"), "2"); err == nil {
		t.Error("a bundle without workloads was accepted")
	}
}
