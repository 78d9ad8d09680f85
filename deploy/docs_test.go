package deploy

import (
	"bytes"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const addonDoc = "../docs/csi-addon.md"

var yamlBlock = regexp.MustCompile("(?s)```yaml\n(.*?)```")

// docExamples are the YAML examples of docs/csi-addon.md, by kind.
type docExamples struct {
	secrets     []corev1.Secret
	configMaps  map[string]corev1.ConfigMap
	keyBackends []corev1.ConfigMap
	classes     []storagev1.StorageClass
}

// readDocExamples decodes every YAML example of the page strictly; an
// example of a kind no check reads fails.
func readDocExamples(t *testing.T, doc []byte) docExamples {
	t.Helper()
	ex := docExamples{configMaps: map[string]corev1.ConfigMap{}}
	for _, m := range yamlBlock.FindAllSubmatch(doc, -1) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(m[1], &tm); err != nil {
			t.Fatalf("example in %s: %v\n%s", addonDoc, err, m[1])
		}
		switch tm.Kind {
		case "Secret":
			var s corev1.Secret
			strict(t, m[1], &s)
			ex.secrets = append(ex.secrets, s)
		case "ConfigMap":
			var c corev1.ConfigMap
			strict(t, m[1], &c)
			ex.configMaps[c.Name] = c
			if c.Name == "csi-key-backend-config" {
				ex.keyBackends = append(ex.keyBackends, c)
			}
		case "StorageClass":
			var c storagev1.StorageClass
			strict(t, m[1], &c)
			ex.classes = append(ex.classes, c)
		default:
			t.Errorf("example of kind %q in %s has no check", tm.Kind, addonDoc)
		}
	}
	return ex
}

// TestDocumentedFormats decodes the examples of docs/csi-addon.md
// strictly and checks them against what the manifests read.
func TestDocumentedFormats(t *testing.T) {
	doc, err := os.ReadFile(addonDoc)
	if err != nil {
		t.Fatal(err)
	}
	a := decode(t, renderings[0].Image, renderings[0].DriverName)
	ex := readDocExamples(t, doc)
	checkDocSecret(t, a, doc, ex.secrets)
	checkDocKeyBackends(t, doc, ex.keyBackends)
	checkDocCA(t, a, ex.configMaps)
	checkDocClass(t, ex.classes)
}

// checkDocSecret: the Secret holds every key the controller reads from it.
func checkDocSecret(t *testing.T, a *addon, doc []byte, secrets []corev1.Secret) {
	t.Helper()
	if len(secrets) != 1 || secrets[0].Name != "csi-driver-secret" || secrets[0].Namespace != Namespace {
		t.Fatalf("want one example Secret csi-driver-secret in %s, have %d", Namespace, len(secrets))
	}
	d := a.deployments[0]
	w := workload{"Deployment", d.Name, d.Spec.Selector, d.Spec.Template}
	p := a.plugin(t, w)
	var read []string
	for _, e := range p.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			read = append(read, e.ValueFrom.SecretKeyRef.Key)
		}
	}
	tf, _ := flag(p.Args, "token-file")
	read = append(read, path.Base(tf))
	for _, k := range append(read, "cloudspace") {
		if _, ok := secrets[0].StringData[k]; !ok {
			t.Errorf("example Secret lacks key %q", k)
		}
		if !strings.Contains(string(doc), "| `"+k+"` |") {
			t.Errorf("%s does not document the Secret key %q", addonDoc, k)
		}
	}
	if u := secrets[0].StringData["url"]; strings.HasSuffix(u, "/") || strings.Count(u, "/") != 2 {
		t.Errorf("example url %q is not scheme://host, which --portal-url=$(VCO_PORTAL_URL) needs", u)
	}
}

// checkDocKeyBackends: the key backend has documented keys, none
// shadowing a projected file. The seed's form first, then our older names.
func checkDocKeyBackends(t *testing.T, doc []byte, keyBackends []corev1.ConfigMap) {
	t.Helper()
	if len(keyBackends) != 2 || keyBackends[0].Data["transitMount"] == "" || keyBackends[1].Data["transit_mount"] == "" {
		t.Fatalf("want two example ConfigMaps csi-key-backend-config, the seed's names (transitMount) then ours (transit_mount); have %d", len(keyBackends))
	}
	for _, kb := range keyBackends {
		for _, k := range []string{"address", "role"} {
			if kb.Data[k] == "" {
				t.Errorf("example csi-key-backend-config lacks required key %q", k)
			}
		}
		for k := range kb.Data {
			if k == "token" || k == "ca" {
				t.Errorf("csi-key-backend-config key %q collides with a file of the projected volume", k)
			}
			if !strings.Contains(string(doc), "| `"+k+"` |") {
				t.Errorf("%s does not document the key-backend key %q", addonDoc, k)
			}
		}
	}
}

// checkDocCA: the CA key is the one the DaemonSet projects.
func checkDocCA(t *testing.T, a *addon, configMaps map[string]corev1.ConfigMap) {
	t.Helper()
	ca, ok := configMaps["openbao-ca"]
	if !ok {
		t.Fatal("no example ConfigMap openbao-ca")
	}
	projected := projectedConfigMapKeys(a.daemonSets[0].Spec.Template.Spec.Volumes, "openbao-ca")
	for k := range ca.Data {
		if !slices.Contains(projected, k) {
			t.Errorf("openbao-ca key %q is not projected into the node plugin (projected: %v)", k, projected)
		}
	}
	if !strings.Contains(ca.Data["ca.crt"], "BEGIN CERTIFICATE") {
		t.Error("example openbao-ca holds no PEM certificate under ca.crt")
	}
}

// projectedConfigMapKeys lists the keys of ConfigMap name that the
// projected volumes among vols project.
func projectedConfigMapKeys(vols []corev1.Volume, name string) []string {
	var keys []string
	for _, v := range vols {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ConfigMap != nil && s.ConfigMap.Name == name {
				for _, it := range s.ConfigMap.Items {
					keys = append(keys, it.Key)
				}
			}
		}
	}
	return keys
}

// checkDocClass: the pinned class names the topology key.
func checkDocClass(t *testing.T, classes []storagev1.StorageClass) {
	t.Helper()
	if len(classes) != 1 {
		t.Fatalf("want one example StorageClass, have %d", len(classes))
	}
	c := classes[0]
	checkPluginParams(t, c.Name, c.Parameters)
	if len(c.AllowedTopologies) == 0 || len(c.AllowedTopologies[0].MatchLabelExpressions) == 0 ||
		c.AllowedTopologies[0].MatchLabelExpressions[0].Key != TopologyKey {
		t.Errorf("example class %s does not pin %s: %+v", c.Name, TopologyKey, c.AllowedTopologies)
	}
}

// TestDocumentedSidecarReleases keeps the page's table of sidecar images
// equal to the images the manifests run.
func TestDocumentedSidecarReleases(t *testing.T) {
	doc, err := os.ReadFile(addonDoc)
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("\\| `(registry\\.k8s\\.io/sig-storage/[^`]+)` \\|").FindAllSubmatch(doc, -1) {
		documented[string(m[1])] = true
	}
	a := decode(t, renderings[0].Image, renderings[0].DriverName)
	used := map[string]bool{}
	for _, w := range a.workloads() {
		for _, c := range w.pod.Spec.Containers {
			if c.Image != a.image {
				used[c.Image] = true
			}
		}
	}
	for img := range used {
		if !documented[img] {
			t.Errorf("the manifests run %s; %s does not list it", img, addonDoc)
		}
	}
	for img := range documented {
		if !used[img] {
			t.Errorf("%s lists %s, which no manifest runs", addonDoc, img)
		}
	}
}

// TestCompatibilityMatrixNamesTheShippedSidecars: every sidecar row of
// docs/diagnosis.md's compatibility matrix that says "shipped" names the
// release the manifests run, and every sidecar the manifests run has such
// a row; a sidecar the add-on does not run is not called shipped.
func TestCompatibilityMatrixNamesTheShippedSidecars(t *testing.T) {
	doc, err := os.ReadFile("../docs/diagnosis.md")
	if err != nil {
		t.Fatal(err)
	}
	a := decode(t, renderings[0].Image, renderings[0].DriverName)
	used := map[string]string{} // image name -> tag
	for _, w := range a.workloads() {
		for _, c := range w.pod.Spec.Containers {
			if name, tag, ok := strings.Cut(strings.TrimPrefix(c.Image, "registry.k8s.io/sig-storage/"), ":"); ok && c.Image != a.image {
				used[name] = tag
			}
		}
	}
	rows := regexp.MustCompile(`(?m)^\| (external-[a-z]+|node-driver-registrar|livenessprobe) \| (\S+) \| ([^|]*)\|$`).FindAllSubmatch(doc, -1)
	listed := map[string]bool{}
	for _, r := range rows {
		part, version, status := string(r[1]), string(r[2]), strings.TrimSpace(string(r[3]))
		image := strings.Replace(part, "external-", "csi-", 1)
		tag, runs := used[image]
		switch {
		case strings.HasPrefix(status, "shipped") && !runs:
			t.Errorf("docs/diagnosis.md calls %s %s shipped; no manifest runs %s", part, version, image)
		case runs && version != tag:
			t.Errorf("docs/diagnosis.md gives %s as %s; the manifests run %s:%s", part, version, image, tag)
		case runs && !strings.HasPrefix(status, "shipped"):
			t.Errorf("docs/diagnosis.md does not call %s shipped (%q); the manifests run it", part, status)
		}
		listed[image] = true
	}
	for image := range used {
		if !listed[image] {
			t.Errorf("the manifests run %s; docs/diagnosis.md's compatibility matrix has no row for it", image)
		}
	}
}

// TestDocsShowTheSeedForms: the operator pages show the forms the seed's
// operators use, and those forms work: install.md's `make csi-addon
// VCO_CSI_IMAGE=... | kubectl apply -f -`, storage.md's class of physical
// disks (the plugin accepts its parameters, and the add-on ships the
// same class), encryption.md's csi-key-backend-config with the seed's key
// names and its CA in openbao-ca.
func TestDocsShowTheSeedForms(t *testing.T) {
	read := func(p string) []byte {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if !regexp.MustCompile(`(?m)^make csi-addon VCO_CSI_IMAGE=\S+ \| kubectl apply -f -$`).Match(read("../docs/install.md")) {
		t.Error("docs/install.md does not show `make csi-addon VCO_CSI_IMAGE=... | kubectl apply -f -`")
	}
	var physical []storagev1.StorageClass
	for _, m := range yamlBlock.FindAllSubmatch(read("../docs/storage.md"), -1) {
		var c storagev1.StorageClass
		if err := yaml.UnmarshalStrict(m[1], &c); err == nil && c.Kind == "StorageClass" && c.Parameters["diskType"] == "PHYSICAL" {
			physical = append(physical, c)
		}
	}
	if len(physical) != 1 {
		t.Fatalf("docs/storage.md has %d StorageClass examples with diskType: PHYSICAL, want one", len(physical))
	}
	c := physical[0]
	checkPluginParams(t, c.Name, c.Parameters)
	a := decode(t, renderings[0].Image, renderings[0].DriverName)
	var shipped *storagev1.StorageClass
	for i := range a.classes {
		if a.classes[i].Name == c.Name {
			shipped = &a.classes[i]
		}
	}
	if shipped == nil || shipped.Provisioner != c.Provisioner || shipped.Parameters["diskType"] != "PHYSICAL" {
		t.Errorf("docs/storage.md's class %s (provisioner %s) is not the add-on's (%+v)", c.Name, c.Provisioner, shipped)
	}
	enc := read("../docs/encryption.md")
	for _, w := range []string{"name: csi-key-backend-config", "transitMount:", "k8sAuthPath:", "role:", "caRef: openbao-ca", "address:"} {
		if !bytes.Contains(enc, []byte(w)) {
			t.Errorf("docs/encryption.md does not show %q of the seed's key-backend ConfigMap", w)
		}
	}
}
