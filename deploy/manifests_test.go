package deploy

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"sigs.k8s.io/yaml"

	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/kubeevents"
)

// volumeSnapshotClass is snapshot.storage.k8s.io/v1 VolumeSnapshotClass
// with the fields of external-snapshotter's client type, for strict
// decoding without that module.
type volumeSnapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Driver            string            `json:"driver"`
	Parameters        map[string]string `json:"parameters,omitempty"`
	DeletionPolicy    string            `json:"deletionPolicy"`
}

// addon is a decoded rendering of the bundle.
type addon struct {
	image, driver string
	apiVersions   []string // of every object, in order

	namespaces      []corev1.Namespace
	drivers         []storagev1.CSIDriver
	classes         []storagev1.StorageClass
	snapshotClasses []volumeSnapshotClass
	accounts        []corev1.ServiceAccount
	clusterRoles    []rbacv1.ClusterRole
	clusterBindings []rbacv1.ClusterRoleBinding
	roles           []rbacv1.Role
	bindings        []rbacv1.RoleBinding
	deployments     []appsv1.Deployment
	daemonSets      []appsv1.DaemonSet
	secrets         []corev1.Secret
}

// splitDocs splits a YAML stream at its "---" lines and drops documents
// that hold only comments.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		content := false
		for _, l := range strings.Split(cur.String(), "\n") {
			if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
				content = true
			}
		}
		if content {
			docs = append(docs, bytes.Clone(cur.Bytes()))
		}
		cur.Reset()
	}
	for _, l := range strings.SplitAfter(string(b), "\n") {
		if strings.TrimRight(l, "\n") == "---" {
			flush()
			continue
		}
		cur.WriteString(l)
	}
	flush()
	return docs
}

func strict[T any](t *testing.T, doc []byte, into *T) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, into); err != nil {
		t.Fatalf("strict decoding into %T: %v\n%s", *into, err, doc)
	}
}

// builtinAPIs are the API versions every cluster serves, without CRDs.
var builtinAPIs = []string{"v1", "storage.k8s.io/v1", "rbac.authorization.k8s.io/v1", "apps/v1"}

// decode renders the core part (csi.yaml) and decodes every document
// strictly into its Kubernetes type; an unknown kind fails, and so does
// a kind no cluster serves without CRDs: kubectl apply and a
// ClusterResourceSet fail on the whole file when one object's kind is
// missing.
func decode(t *testing.T, image, driver string) *addon {
	t.Helper()
	a := decodePart(t, Core, image, driver)
	if len(a.namespaces) != 1 || len(a.drivers) != 1 || len(a.classes) != 2 ||
		len(a.deployments) != 1 || len(a.daemonSets) != 1 {
		t.Fatalf("csi.yaml holds %d namespaces, %d CSIDrivers, %d StorageClasses, %d Deployments, %d DaemonSets; want 1, 1, 2, 1, 1",
			len(a.namespaces), len(a.drivers), len(a.classes), len(a.deployments), len(a.daemonSets))
	}
	if len(a.snapshotClasses) != 0 {
		t.Fatalf("csi.yaml holds %d VolumeSnapshotClasses; they belong in the snapshots part", len(a.snapshotClasses))
	}
	return a
}

// decodeSnapshots renders the opt-in snapshots part
// (csi-snapshots.yaml) and decodes it strictly.
func decodeSnapshots(t *testing.T, image, driver string) *addon {
	t.Helper()
	a := decodePart(t, Snapshots, image, driver)
	if len(a.snapshotClasses) != 1 || len(a.apiVersions) != 1 {
		t.Fatalf("csi-snapshots.yaml holds %d objects, %d of them VolumeSnapshotClasses; want the one VolumeSnapshotClass",
			len(a.apiVersions), len(a.snapshotClasses))
	}
	return a
}

// decodeEncryption renders the opt-in encryption part
// (csi-encryption.yaml) and decodes it strictly.
func decodeEncryption(t *testing.T, image, driver string) *addon {
	t.Helper()
	a := decodePart(t, Encryption, image, driver)
	if len(a.classes) != 1 || len(a.accounts) != 1 || len(a.secrets) != 1 || len(a.clusterBindings) != 1 || len(a.apiVersions) != 4 {
		t.Fatalf("csi-encryption.yaml holds %d objects: %d StorageClasses, %d ServiceAccounts, %d Secrets, %d ClusterRoleBindings; want 1 of each",
			len(a.apiVersions), len(a.classes), len(a.accounts), len(a.secrets), len(a.clusterBindings))
	}
	return a
}

func decodePart(t *testing.T, part Part, image, driver string) *addon {
	t.Helper()
	b, err := BundleOf(part)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Render(b, Values{Image: image, DriverName: driver})
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(r, []byte("${")) {
		t.Fatalf("rendered %s still holds a placeholder", part.FileName())
	}
	a := &addon{image: image, driver: driver}
	for _, doc := range splitDocs(r) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			t.Fatalf("reading kind: %v\n%s", err, doc)
		}
		a.apiVersions = append(a.apiVersions, tm.APIVersion)
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 Namespace":
			var o corev1.Namespace
			strict(t, doc, &o)
			a.namespaces = append(a.namespaces, o)
		case "storage.k8s.io/v1 CSIDriver":
			var o storagev1.CSIDriver
			strict(t, doc, &o)
			a.drivers = append(a.drivers, o)
		case "storage.k8s.io/v1 StorageClass":
			var o storagev1.StorageClass
			strict(t, doc, &o)
			a.classes = append(a.classes, o)
		case "snapshot.storage.k8s.io/v1 VolumeSnapshotClass":
			var o volumeSnapshotClass
			strict(t, doc, &o)
			a.snapshotClasses = append(a.snapshotClasses, o)
		case "v1 Secret":
			var o corev1.Secret
			strict(t, doc, &o)
			a.secrets = append(a.secrets, o)
		case "v1 ServiceAccount":
			var o corev1.ServiceAccount
			strict(t, doc, &o)
			a.accounts = append(a.accounts, o)
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			var o rbacv1.ClusterRole
			strict(t, doc, &o)
			a.clusterRoles = append(a.clusterRoles, o)
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			var o rbacv1.ClusterRoleBinding
			strict(t, doc, &o)
			a.clusterBindings = append(a.clusterBindings, o)
		case "rbac.authorization.k8s.io/v1 Role":
			var o rbacv1.Role
			strict(t, doc, &o)
			a.roles = append(a.roles, o)
		case "rbac.authorization.k8s.io/v1 RoleBinding":
			var o rbacv1.RoleBinding
			strict(t, doc, &o)
			a.bindings = append(a.bindings, o)
		case "apps/v1 Deployment":
			var o appsv1.Deployment
			strict(t, doc, &o)
			a.deployments = append(a.deployments, o)
		case "apps/v1 DaemonSet":
			var o appsv1.DaemonSet
			strict(t, doc, &o)
			a.daemonSets = append(a.daemonSets, o)
		default:
			t.Fatalf("unexpected object %s %s in %s", tm.APIVersion, tm.Kind, part.FileName())
		}
	}
	return a
}

// The driver names are deliberately unlike the default so that nothing
// can agree with them by being hard-coded.
var renderings = []Values{
	{Image: "try.whitesky.cloud/vco/csi:1.2.3", DriverName: "cloud.whitesky.csi"},
	{Image: "registry.example.test:5000/storage/vco-csi@sha256:" + strings.Repeat("ab", 32), DriverName: "test.example.csi"},
}

func forEachRendering(t *testing.T, f func(t *testing.T, a *addon)) {
	for _, v := range renderings {
		t.Run(v.DriverName, func(t *testing.T) { f(t, decode(t, v.Image, v.DriverName)) })
	}
}

func TestCommittedBundleIsCurrent(t *testing.T) {
	for _, p := range Parts() {
		want, err := BundleOf(p)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p.FileName())
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("deploy/%s differs from the concatenation of its part of deploy/manifests; run `make csi-yaml`", p.FileName())
		}
	}
}

func TestBundleCarriesOnlyTheTwoPlaceholders(t *testing.T) {
	for _, p := range Parts() {
		b, err := BundleOf(p)
		if err != nil {
			t.Fatal(err)
		}
		if refs := ForeignRefs(b); len(refs) > 0 {
			t.Errorf("%s refers to %v, which envsubst would blank", p.FileName(), refs)
		}
		want := []string{"${" + DriverNameVar + "}"}
		if p == Core {
			want = append(want, "${"+ImageVar+"}")
		}
		for _, v := range want {
			if !bytes.Contains(b, []byte(v)) {
				t.Errorf("%s lacks %s", p.FileName(), v)
			}
		}
	}
}

// TestCoreNeedsNoCRD: csi.yaml applies on a cluster without the snapshot
// CRDs (seed 001 deploys neither them nor snapshot-controller): every
// object it holds is of an API every cluster serves, so none is of
// snapshot.storage.k8s.io; the VolumeSnapshotClass is in the snapshots
// part.
func TestCoreNeedsNoCRD(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		for _, v := range a.apiVersions {
			if !slices.Contains(builtinAPIs, v) {
				t.Errorf("csi.yaml holds an object of %s, which a cluster serves only with its CRDs; kubectl apply of the file fails without them", v)
			}
		}
		s := decodeSnapshots(t, a.image, a.driver)
		if s.apiVersions[0] != "snapshot.storage.k8s.io/v1" || s.snapshotClasses[0].Name != "vco-csi" {
			t.Errorf("csi-snapshots.yaml holds %s %s, want the VolumeSnapshotClass vco-csi", s.apiVersions[0], s.snapshotClasses[0].Name)
		}
	})
}

func TestNamespaces(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		if a.namespaces[0].Name != Namespace {
			t.Errorf("namespace %q, want %q", a.namespaces[0].Name, Namespace)
		}
		type obj struct {
			kind string
			meta metav1.ObjectMeta
		}
		var namespaced, cluster []obj
		for _, o := range a.accounts {
			namespaced = append(namespaced, obj{"ServiceAccount", o.ObjectMeta})
		}
		for _, o := range a.roles {
			namespaced = append(namespaced, obj{"Role", o.ObjectMeta})
		}
		for _, o := range a.bindings {
			namespaced = append(namespaced, obj{"RoleBinding", o.ObjectMeta})
		}
		for _, o := range a.deployments {
			namespaced = append(namespaced, obj{"Deployment", o.ObjectMeta})
		}
		for _, o := range a.daemonSets {
			namespaced = append(namespaced, obj{"DaemonSet", o.ObjectMeta})
		}
		for _, o := range a.drivers {
			cluster = append(cluster, obj{"CSIDriver", o.ObjectMeta})
		}
		for _, o := range a.classes {
			cluster = append(cluster, obj{"StorageClass", o.ObjectMeta})
		}
		for _, o := range decodeSnapshots(t, a.image, a.driver).snapshotClasses {
			cluster = append(cluster, obj{"VolumeSnapshotClass", o.ObjectMeta})
		}
		for _, o := range a.clusterRoles {
			cluster = append(cluster, obj{"ClusterRole", o.ObjectMeta})
		}
		for _, o := range a.clusterBindings {
			cluster = append(cluster, obj{"ClusterRoleBinding", o.ObjectMeta})
		}
		for _, o := range namespaced {
			// Events about a Node are kept in namespace default, so the
			// node plugin's permission to post them is there
			// (TestNodePluginRBAC checks it grants nothing else).
			if (o.kind == "Role" || o.kind == "RoleBinding") && o.meta.Name == nodeEventsRole && o.meta.Namespace == kubeevents.Namespace {
				continue
			}
			if o.meta.Namespace != Namespace {
				t.Errorf("%s %s is in namespace %q, want %q", o.kind, o.meta.Name, o.meta.Namespace, Namespace)
			}
		}
		for _, o := range cluster {
			if o.meta.Namespace != "" {
				t.Errorf("cluster-scoped %s %s names namespace %q", o.kind, o.meta.Name, o.meta.Namespace)
			}
		}
	})
}

func TestCSIDriver(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.drivers[0]
		if d.Name != a.driver {
			t.Errorf("CSIDriver %q, want %q", d.Name, a.driver)
		}
		s := d.Spec
		if s.AttachRequired == nil || !*s.AttachRequired {
			t.Error("attachRequired is not true: Kubernetes would not track attachments")
		}
		if s.PodInfoOnMount == nil || !*s.PodInfoOnMount {
			t.Error("podInfoOnMount is not true")
		}
		if s.FSGroupPolicy == nil || *s.FSGroupPolicy != storagev1.FileFSGroupPolicy {
			t.Errorf("fsGroupPolicy %v, want File", s.FSGroupPolicy)
		}
		if s.StorageCapacity == nil || !*s.StorageCapacity {
			t.Error("storageCapacity is not true: the scheduler would place WaitForFirstConsumer pods in a full location")
		}
		if !slices.Equal(s.VolumeLifecycleModes, []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent}) {
			t.Errorf("volumeLifecycleModes %v, want [Persistent]", s.VolumeLifecycleModes)
		}
	})
}

// checkPluginParams runs a class's parameters through the plugin's own
// check (csi/driver ValidateParameters, what CreateVolume applies): a
// class it refuses would fail every provision, and a StorageClass's
// parameters cannot be edited in place.
func checkPluginParams(t *testing.T, class string, p map[string]string) {
	t.Helper()
	if err := driver.ValidateParameters(p); err != nil {
		t.Errorf("StorageClass %s: the plugin refuses its parameters: %v", class, err)
	}
	if _, ok := p["type"]; ok {
		t.Errorf("StorageClass %s: gives type, the older alias; the documented spelling is diskType", class)
	}
}

func TestStorageClasses(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		byName := map[string]storagev1.StorageClass{}
		var defaults []string
		for _, c := range a.classes {
			if b, _ := strconv.ParseBool(c.Parameters["encryption"]); b {
				t.Errorf("csi.yaml ships the encrypted StorageClass %s; it belongs in the encryption part, applied only with a key backend", c.Name)
			}
		}
		for _, c := range append(slices.Clone(a.classes), decodeEncryption(t, a.image, a.driver).classes...) {
			byName[c.Name] = c
			if c.Provisioner != a.driver {
				t.Errorf("StorageClass %s: provisioner %q, want the driver name %q", c.Name, c.Provisioner, a.driver)
			}
			if c.VolumeBindingMode == nil || *c.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
				t.Errorf("StorageClass %s: volumeBindingMode is not WaitForFirstConsumer; disks would be made before the node is known", c.Name)
			}
			if c.AllowVolumeExpansion == nil || !*c.AllowVolumeExpansion {
				t.Errorf("StorageClass %s: allowVolumeExpansion is not true", c.Name)
			}
			if c.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
				defaults = append(defaults, c.Name)
			}
			checkPluginParams(t, c.Name, c.Parameters)
		}
		if !slices.Equal(defaults, []string{"vco-csi"}) {
			t.Errorf("default classes %v, want [vco-csi]", defaults)
		}
		for name, want := range map[string]map[string]string{
			"vco-csi":                 {"diskType": "STANDARD"},
			"vco-csi-physical":        {"diskType": "PHYSICAL"},
			"vco-csi-encrypted-vault": {"diskType": "STANDARD", "encryption": "true"},
		} {
			c, ok := byName[name]
			if !ok {
				t.Errorf("no StorageClass %s", name)
				continue
			}
			for k, v := range want {
				if c.Parameters[k] != v {
					t.Errorf("StorageClass %s: %s=%q, want %q", name, k, c.Parameters[k], v)
				}
			}
			if name != "vco-csi-encrypted-vault" {
				if b, _ := strconv.ParseBool(c.Parameters["encryption"]); b {
					t.Errorf("StorageClass %s asks for encryption", name)
				}
			}
		}
	})
}

// TestEncryptionPart: the encryption part holds the encrypted class and
// what docs/encryption.md's recipe gives the key backend to review the
// node plugin's tokens: a ServiceAccount of its own (not the node
// plugin's, whose token has audience vault only) bound to
// system:auth-delegator, and its long-lived token Secret.
func TestEncryptionPart(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		e := decodeEncryption(t, a.image, a.driver)
		for _, v := range e.apiVersions {
			if !slices.Contains(builtinAPIs, v) {
				t.Errorf("csi-encryption.yaml holds an object of %s, which needs a CRD", v)
			}
		}
		sa, sec, b := e.accounts[0], e.secrets[0], e.clusterBindings[0]
		if sa.Namespace != Namespace || sa.Name == a.daemonSets[0].Spec.Template.Spec.ServiceAccountName {
			t.Errorf("token reviewer ServiceAccount %s/%s; want one of its own in %s", sa.Namespace, sa.Name, Namespace)
		}
		if sec.Type != corev1.SecretTypeServiceAccountToken || sec.Namespace != Namespace ||
			sec.Annotations[corev1.ServiceAccountNameKey] != sa.Name {
			t.Errorf("token reviewer Secret %s: type %s, for %q; want a service-account-token for %s", sec.Name, sec.Type,
				sec.Annotations[corev1.ServiceAccountNameKey], sa.Name)
		}
		if b.RoleRef.Kind != "ClusterRole" || b.RoleRef.Name != "system:auth-delegator" || len(b.Subjects) != 1 ||
			b.Subjects[0].Kind != "ServiceAccount" || b.Subjects[0].Name != sa.Name || b.Subjects[0].Namespace != Namespace {
			t.Errorf("ClusterRoleBinding %s: %+v to %+v; want system:auth-delegator for %s/%s", b.Name, b.RoleRef, b.Subjects, Namespace, sa.Name)
		}
		if c := e.classes[0]; c.Name != "vco-csi-encrypted-vault" || c.Parameters["encryption"] != "true" {
			t.Errorf("encryption part's class %s %v", c.Name, c.Parameters)
		}
	})
}

func TestVolumeSnapshotClass(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		c := decodeSnapshots(t, a.image, a.driver).snapshotClasses[0]
		if c.Driver != a.driver {
			t.Errorf("VolumeSnapshotClass %s: driver %q, want %q", c.Name, c.Driver, a.driver)
		}
		if c.DeletionPolicy != "Delete" && c.DeletionPolicy != "Retain" {
			t.Errorf("VolumeSnapshotClass %s: deletionPolicy %q", c.Name, c.DeletionPolicy)
		}
	})
}

// workload is a pod template with the name of what runs it.
type workload struct {
	kind, name string
	selector   *metav1.LabelSelector
	pod        corev1.PodTemplateSpec
}

func (a *addon) workloads() []workload {
	var w []workload
	for _, d := range a.deployments {
		w = append(w, workload{"Deployment", d.Name, d.Spec.Selector, d.Spec.Template})
	}
	for _, d := range a.daemonSets {
		w = append(w, workload{"DaemonSet", d.Name, d.Spec.Selector, d.Spec.Template})
	}
	return w
}

// flag returns the value of --name=value in args, and whether it is there.
func flag(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func container(t *testing.T, w workload, name string) corev1.Container {
	t.Helper()
	for _, c := range w.pod.Spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("%s %s has no container %s", w.kind, w.name, name)
	return corev1.Container{}
}

func (a *addon) plugin(t *testing.T, w workload) corev1.Container {
	t.Helper()
	var found []corev1.Container
	for _, c := range w.pod.Spec.Containers {
		if c.Image == a.image {
			found = append(found, c)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%s %s runs the plugin image in %d containers, want 1", w.kind, w.name, len(found))
	}
	return found[0]
}

// mountFor returns the mount in c whose path holds file, and its volume.
func mountFor(t *testing.T, w workload, c corev1.Container, file string) (corev1.VolumeMount, corev1.Volume) {
	t.Helper()
	var best corev1.VolumeMount
	for _, m := range c.VolumeMounts {
		if (file == m.MountPath || strings.HasPrefix(file, strings.TrimSuffix(m.MountPath, "/")+"/")) && len(m.MountPath) > len(best.MountPath) {
			best = m
		}
	}
	if best.Name == "" {
		t.Fatalf("%s %s: container %s has no volume mounted over %s", w.kind, w.name, c.Name, file)
	}
	for _, v := range w.pod.Spec.Volumes {
		if v.Name == best.Name {
			return best, v
		}
	}
	t.Fatalf("%s %s: container %s mounts volume %s, which the pod does not define", w.kind, w.name, c.Name, best.Name)
	return best, corev1.Volume{}
}

func socketPath(t *testing.T, endpoint string) string {
	t.Helper()
	p, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || !path.IsAbs(p) {
		t.Fatalf("endpoint %q is not unix:///absolute/path", endpoint)
	}
	return p
}

var pinnedSidecar = regexp.MustCompile(`^registry\.k8s\.io/sig-storage/([a-z-]+):v\d+\.\d+\.\d+$`)

// checkSidecars checks that each named sidecar runs a pinned release and
// reaches the plugin's socket through the same volume.
func checkSidecars(t *testing.T, a *addon, w workload, want []string) {
	t.Helper()
	plugin := a.plugin(t, w)
	ep, _ := flag(plugin.Args, "endpoint")
	sock := socketPath(t, ep)
	pm, _ := mountFor(t, w, plugin, sock)
	var have []string
	for _, c := range w.pod.Spec.Containers {
		if c.Name == plugin.Name {
			continue
		}
		m := pinnedSidecar.FindStringSubmatch(c.Image)
		if m == nil {
			t.Errorf("%s %s: container %s runs %q, not a pinned registry.k8s.io/sig-storage release", w.kind, w.name, c.Name, c.Image)
			continue
		}
		have = append(have, m[1])
		addr, ok := flag(c.Args, "csi-address")
		if !ok {
			t.Errorf("%s %s: %s has no --csi-address", w.kind, w.name, c.Name)
			continue
		}
		sm, _ := mountFor(t, w, c, addr)
		rel := func(m corev1.VolumeMount, p string) string {
			return strings.TrimPrefix(p, strings.TrimSuffix(m.MountPath, "/"))
		}
		if sm.Name != pm.Name || rel(sm, addr) != rel(pm, sock) {
			t.Errorf("%s %s: %s dials %s on volume %s; the plugin listens on %s on volume %s", w.kind, w.name, c.Name, addr, sm.Name, sock, pm.Name)
		}
	}
	slices.Sort(have)
	slices.Sort(want)
	if !slices.Equal(have, want) {
		t.Errorf("%s %s runs sidecars %v, want %v", w.kind, w.name, have, want)
	}
}

func TestWorkloadsAgree(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		accounts := map[string]bool{}
		for _, sa := range a.accounts {
			accounts[sa.Name] = true
		}
		for _, w := range a.workloads() {
			sel, err := metav1.LabelSelectorAsSelector(w.selector)
			if err != nil || sel.Empty() {
				t.Errorf("%s %s: selector %v: %v", w.kind, w.name, w.selector, err)
			} else if !sel.Matches(labels.Set(w.pod.Labels)) {
				t.Errorf("%s %s: selector %v does not match its pod labels %v", w.kind, w.name, w.selector, w.pod.Labels)
			}
			if !accounts[w.pod.Spec.ServiceAccountName] {
				t.Errorf("%s %s: service account %q is not in the bundle", w.kind, w.name, w.pod.Spec.ServiceAccountName)
			}
			p := a.plugin(t, w)
			if n, _ := flag(p.Args, "driver-name"); n != a.driver {
				t.Errorf("%s %s: plugin --driver-name=%q, want %q (= CSIDriver = provisioner)", w.kind, w.name, n, a.driver)
			}
			// The plugin serves its own /healthz (no livenessprobe sidecar);
			// its liveness probe asks that port.
			ep, ok := flag(p.Args, "http-endpoint")
			_, hp, _ := strings.Cut(ep, ":")
			if !ok || hp == "" {
				t.Errorf("%s %s: the plugin has no --http-endpoint=:<port> for its /healthz", w.kind, w.name)
			}
			if p.LivenessProbe == nil || p.LivenessProbe.HTTPGet == nil {
				t.Errorf("%s %s: the plugin has no HTTP liveness probe", w.kind, w.name)
			} else {
				port := p.LivenessProbe.HTTPGet.Port.String()
				for _, cp := range p.Ports {
					if cp.Name == port {
						port = strconv.Itoa(int(cp.ContainerPort))
					}
				}
				if port != hp || p.LivenessProbe.HTTPGet.Path != "/healthz" {
					t.Errorf("%s %s: the plugin's liveness probe asks %s on port %s; the plugin serves /healthz on %s", w.kind, w.name,
						p.LivenessProbe.HTTPGet.Path, port, hp)
				}
			}
			vols := map[string]bool{}
			for _, v := range w.pod.Spec.Volumes {
				vols[v.Name] = true
			}
			for _, c := range w.pod.Spec.Containers {
				for _, m := range c.VolumeMounts {
					if !vols[m.Name] {
						t.Errorf("%s %s: %s mounts undefined volume %s", w.kind, w.name, c.Name, m.Name)
					}
				}
			}
		}
	})
}

func TestController(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.deployments[0]
		w := workload{"Deployment", d.Name, d.Spec.Selector, d.Spec.Template}
		p := a.plugin(t, w)
		if m, _ := flag(p.Args, "mode"); m != "controller" {
			t.Errorf("controller plugin --mode=%q", m)
		}
		checkSidecars(t, a, w, []string{"csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter"})
		prov := container(t, w, "csi-provisioner")
		if !slices.Contains(prov.Args, "--feature-gates=Topology=true") {
			t.Errorf("csi-provisioner lacks --feature-gates=Topology=true: PVs would carry no node affinity for %s", TopologyKey)
		}
		checkSidecarsElectALeader(t, w, p)
		checkControllerFlagsFromTheSecret(t, p)
		// The token file lies in the mounted Secret.
		tf, _ := flag(p.Args, "token-file")
		_, v := mountFor(t, w, p, tf)
		if v.Secret == nil || v.Secret.SecretName != "csi-driver-secret" {
			t.Errorf("--token-file=%s is not in the Secret csi-driver-secret (volume %s)", tf, v.Name)
		}
		// Unprivileged user; group for the Secret's files.
		sc := w.pod.Spec.SecurityContext
		if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != ImageUID ||
			sc.FSGroup == nil || *sc.FSGroup != ImageUID {
			t.Errorf("controller pod does not run as the image's user %d with fsGroup %d: %+v", ImageUID, ImageUID, sc)
		}
	})
}

// checkSidecarsElectALeader: every container of the controller pod but the
// plugin runs with leader election.
func checkSidecarsElectALeader(t *testing.T, w workload, p corev1.Container) {
	t.Helper()
	for _, c := range w.pod.Spec.Containers {
		if c.Name != p.Name {
			if le, _ := flag(c.Args, "leader-election"); le != "true" {
				t.Errorf("%s runs without leader election; two controller pods would both act during a rollout", c.Name)
			}
		}
	}
}

// checkControllerFlagsFromTheSecret: url, customer and cloudspace reach
// their flags from the Secret.
func checkControllerFlagsFromTheSecret(t *testing.T, p corev1.Container) {
	t.Helper()
	fromSecret := map[string]string{}
	for _, e := range p.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name == "csi-driver-secret" {
			fromSecret[e.ValueFrom.SecretKeyRef.Key] = e.Name
		}
	}
	for f, key := range map[string]string{"portal-url": "url", "customer": "customer", "cloudspace": "cloudspace"} {
		if v, _ := flag(p.Args, f); v != "$("+fromSecret[key]+")" || fromSecret[key] == "" {
			t.Errorf("controller plugin --%s=%q; want the environment variable of Secret csi-driver-secret key %s", f, v, key)
		}
	}
}

func TestNodePlugin(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.daemonSets[0]
		w := workload{"DaemonSet", d.Name, d.Spec.Selector, d.Spec.Template}
		p := a.plugin(t, w)
		if m, _ := flag(p.Args, "mode"); m != "node" {
			t.Errorf("node plugin --mode=%q", m)
		}
		// One container: the plugin registers itself with the kubelet
		// and serves its own health (docs/csi-addon.md).
		checkSidecars(t, a, w, nil)
		checkNodePodUnprivileged(t, w.pod.Spec)
		checkNodePodNotRoot(t, w, p)
		checkNodePluginSockets(t, a, w, p)
		checkNodePluginHostDirectories(t, w, p)
	})
}

// checkNodePodUnprivileged: the node pod shares no host namespace and its
// containers are unprivileged, drop every capability and may not escalate.
func checkNodePodUnprivileged(t *testing.T, spec corev1.PodSpec) {
	t.Helper()
	if spec.HostNetwork || spec.HostPID || spec.HostIPC {
		t.Error("node pod shares a host namespace")
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		sc := c.SecurityContext
		// The init container that gives the plugin its directories may
		// chown, and nothing else (checkNodePodNotRoot).
		var add []corev1.Capability
		if c.Name == pluginDirsInit {
			add = []corev1.Capability{"CHOWN"}
		}
		switch {
		case sc == nil:
			t.Errorf("node container %s has no securityContext", c.Name)
		case sc.Privileged != nil && *sc.Privileged:
			t.Errorf("node container %s is privileged", c.Name)
		case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
			t.Errorf("node container %s allows privilege escalation", c.Name)
		case sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || !slices.Equal(sc.Capabilities.Add, add):
			t.Errorf("node container %s does not drop all capabilities (but %v): %+v", c.Name, add, sc.Capabilities)
		}
	}
}

// pluginDirsInit is the node pod's init container, the one that runs as
// root (vco-csi plugin-dirs).
const pluginDirsInit = "plugin-dirs"

// checkNodePodNotRoot: the node plugin runs as the image's user, with the
// vco-agent group for the agent's socket and fsGroup for its projected
// volumes; only the init container runs as root, with no host directory
// but the plugin's own two, and gives them to the plugin's user and group.
func checkNodePodNotRoot(t *testing.T, w workload, p corev1.Container) {
	t.Helper()
	sc := w.pod.Spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != ImageUID ||
		sc.RunAsGroup == nil || *sc.RunAsGroup != ImageUID || sc.FSGroup == nil || *sc.FSGroup != ImageUID {
		t.Fatalf("node pod does not run as the image's user and group %d with fsGroup %d: %+v", ImageUID, ImageUID, sc)
	}
	if !slices.Equal(sc.SupplementalGroups, []int64{AgentGID}) {
		t.Errorf("node pod's supplementalGroups %v, want the vco-agent group's gid [%d] only", sc.SupplementalGroups, AgentGID)
	}
	for _, c := range w.pod.Spec.Containers {
		if c := c.SecurityContext; c != nil && (c.RunAsUser != nil || c.RunAsGroup != nil || c.RunAsNonRoot != nil) {
			t.Errorf("node container overrides the pod's user: %+v", c)
		}
	}
	checkPluginDirsInit(t, w, p, *sc.RunAsUser, *sc.RunAsGroup)
}

// checkPluginDirsInit: the init container runs the plugin's image with
// plugin-dirs, gives the plugin's user and group exactly the directories
// it mounts, and those are the plugin's own mounts.
func checkPluginDirsInit(t *testing.T, w workload, p corev1.Container, uid, gid int64) {
	t.Helper()
	if len(w.pod.Spec.InitContainers) != 1 || w.pod.Spec.InitContainers[0].Name != pluginDirsInit {
		t.Fatalf("node pod's init containers %v, want %s alone", w.pod.Spec.InitContainers, pluginDirsInit)
	}
	ic := w.pod.Spec.InitContainers[0]
	if ic.Image != p.Image || len(ic.Command) > 0 || len(ic.Args) == 0 || ic.Args[0] != "plugin-dirs" {
		t.Errorf("init container %s runs %s %v %v, want the plugin's image with args plugin-dirs ...", ic.Name, ic.Image, ic.Command, ic.Args)
	}
	if o, _ := flag(ic.Args, "owner"); o != fmt.Sprintf("%d:%d", uid, gid) {
		t.Errorf("init container gives the plugin's directories to %q; the plugin runs as %d:%d", o, uid, gid)
	}
	// Each directory it is given is a volume the plugin mounts at the same
	// place, and it mounts nothing else.
	var dirs []string
	for _, a := range ic.Args[1:] {
		if !strings.HasPrefix(a, "--") {
			dirs = append(dirs, a)
		}
	}
	var mounted []string
	for _, m := range ic.VolumeMounts {
		mounted = append(mounted, m.MountPath)
		pm, _ := mountFor(t, w, p, m.MountPath)
		if pm.Name != m.Name || pm.MountPath != m.MountPath {
			t.Errorf("init container mounts %s at %s; the plugin has %s there", m.Name, m.MountPath, pm.Name)
		}
	}
	if !slices.Equal(dirs, mounted) {
		t.Errorf("init container is given %v and mounts %v", dirs, mounted)
	}
}

// covers says whether host path p, mounted, shows x: x is p or lies in it.
func covers(p, x string) bool {
	p = strings.TrimSuffix(path.Clean(p), "/")
	return x == p || strings.HasPrefix(x, p+"/")
}

// The node pod sees of the host only the plugin's own socket directories
// and the agent's socket directory: no hostPath that shows the kubelet's
// pod directories (every pod's Secret and token volumes) or its pki/
// (the kubelet's client key), nor one inside them. docs/security.md says
// exactly this.
func TestNodePodSeesNoPodDirectoryOrKubeletKey(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.daemonSets[0]
		allowed := []string{"/var/lib/kubelet/plugins/" + a.driver, "/var/lib/kubelet/plugins_registry/" + a.driver, client.DefaultSocket[:strings.LastIndexByte(client.DefaultSocket, '/')]}
		var seen []string
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.HostPath == nil {
				continue
			}
			seen = append(seen, v.HostPath.Path)
			for _, x := range []string{"/var/lib/kubelet/pods", "/var/lib/kubelet/pki"} {
				if covers(v.HostPath.Path, x) || covers(x, v.HostPath.Path) {
					t.Errorf("node pod volume %s mounts host %s, which shows %s", v.Name, v.HostPath.Path, x)
				}
			}
		}
		slices.Sort(seen)
		slices.Sort(allowed)
		if !slices.Equal(seen, allowed) {
			t.Errorf("node pod mounts host paths %v, want exactly %v", seen, allowed)
		}
	})
}

// checkNodePluginSockets: the plugin's socket is where the plugin tells
// kubelet to find it, and its registration socket lands in the kubelet's
// plugins_registry, writable.
func checkNodePluginSockets(t *testing.T, a *addon, w workload, p corev1.Container) {
	t.Helper()
	ep, _ := flag(p.Args, "endpoint")
	sock := socketPath(t, ep)
	m, v := mountFor(t, w, p, sock)
	if v.HostPath == nil {
		t.Fatalf("plugin socket volume %s is not a hostPath", v.Name)
	}
	hostSock := path.Join(v.HostPath.Path, strings.TrimPrefix(sock, m.MountPath))
	if want := "/var/lib/kubelet/plugins/" + a.driver + "/csi.sock"; hostSock != want {
		t.Errorf("plugin socket on the host is %s, want %s", hostSock, want)
	}
	if rp, _ := flag(p.Args, "kubelet-registration-path"); rp != hostSock {
		t.Errorf("the plugin tells kubelet --kubelet-registration-path=%s; it listens on host path %s", rp, hostSock)
	}
	// The kubelet watches plugins_registry and the directories in it; the
	// plugin's is its own, so that it needs no write access to the
	// kubelet's.
	rd, _ := flag(p.Args, "registration-dir")
	rm, rv := mountFor(t, w, p, path.Join(rd, a.driver+"-reg.sock"))
	if want := "/var/lib/kubelet/plugins_registry/" + a.driver; rd == "" || rv.HostPath == nil || path.Join(rv.HostPath.Path, strings.TrimPrefix(rd, rm.MountPath)) != want {
		t.Errorf("--registration-dir=%q is %+v mounted at %s, want host %s", rd, rv.VolumeSource, rm.MountPath, want)
	}
	if rm.ReadOnly {
		t.Errorf("the registration directory %s is mounted read-only; the plugin makes its socket there", rm.MountPath)
	}
}

// checkNodePluginHostDirectories: the kubelet root the plugin checks
// paths against is the host's, which it does not mount (it hands paths to
// the agent), and the agent's socket is at the path the agent package
// listens on.
func checkNodePluginHostDirectories(t *testing.T, w workload, p corev1.Container) {
	t.Helper()
	if root, _ := flag(p.Args, "kubelet-root"); root != "/var/lib/kubelet" {
		t.Errorf("--kubelet-root=%q, want the host's /var/lib/kubelet", root)
	}

	as, _ := flag(p.Args, "agent-socket")
	if as != client.DefaultSocket {
		t.Errorf("--agent-socket=%s; the agent listens on %s", as, client.DefaultSocket)
	}
	am, av := mountFor(t, w, p, as)
	if av.HostPath == nil || path.Join(av.HostPath.Path, strings.TrimPrefix(as, am.MountPath)) != as {
		t.Errorf("agent socket %s is not the host's: mount %s from %+v", as, am.MountPath, av.VolumeSource)
	}
	if am.MountPropagation == nil || *am.MountPropagation != corev1.MountPropagationHostToContainer {
		t.Errorf("agent socket directory propagation %v, want HostToContainer", am.MountPropagation)
	}
}

// secretRefs lists which containers of which workloads read which Secret
// (through a volume they mount, or an env reference).
func secretRefs(w workload) map[string][]string {
	vol := map[string][]string{}
	for _, v := range w.pod.Spec.Volumes {
		if v.Secret != nil {
			vol[v.Name] = append(vol[v.Name], v.Secret.SecretName)
		}
		if v.Projected != nil {
			for _, s := range v.Projected.Sources {
				if s.Secret != nil {
					vol[v.Name] = append(vol[v.Name], s.Secret.Name)
				}
			}
		}
	}
	out := map[string][]string{}
	all := append(slices.Clone(w.pod.Spec.InitContainers), w.pod.Spec.Containers...)
	for _, c := range all {
		who := fmt.Sprintf("%s %s/%s", w.kind, w.name, c.Name)
		for _, m := range c.VolumeMounts {
			for _, s := range vol[m.Name] {
				out[s] = append(out[s], who)
			}
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				out[e.ValueFrom.SecretKeyRef.Name] = append(out[e.ValueFrom.SecretKeyRef.Name], who)
			}
		}
		for _, e := range c.EnvFrom {
			if e.SecretRef != nil {
				out[e.SecretRef.Name] = append(out[e.SecretRef.Name], who)
			}
		}
	}
	return out
}

func TestOnlyTheControllerPluginReadsTheCloudCredential(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		readers := map[string]bool{}
		for _, w := range a.workloads() {
			for s, who := range secretRefs(w) {
				if s == "openbao-ca" && w.kind == "DaemonSet" {
					continue // the key backend's CA bundle (docs/csi-addon.md); checked in TestKeyBackendConfigReachesTheNodePlugin
				}
				if s != "csi-driver-secret" {
					t.Errorf("%v read Secret %s, which the add-on does not document", who, s)
					continue
				}
				for _, x := range who {
					readers[x] = true
				}
			}
		}
		want := "Deployment vco-csi-controller/vco-csi"
		if len(readers) != 1 || !readers[want] {
			t.Errorf("csi-driver-secret is read by %v, want only %s", readers, want)
		}
	})
}

func TestKeyBackendConfigReachesTheNodePlugin(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.daemonSets[0]
		w := workload{"DaemonSet", d.Name, d.Spec.Selector, d.Spec.Template}
		p := a.plugin(t, w)
		if kd, _ := flag(p.Args, "key-backend-dir"); kd != KeyBackendDir {
			t.Errorf("node plugin --key-backend-dir=%q; the key backend volume is mounted at %s", kd, KeyBackendDir)
		}
		checkReadinessProbeAsksHealthAddr(t, p)
		checkKeyBackendVolume(t, w, p)
		checkControllerMountsNoKeyBackend(t, a)
	})
}

// checkReadinessProbeAsksHealthAddr: a key-backend problem shows as not
// ready: the probe asks the address the plugin serves /readyz on.
func checkReadinessProbeAsksHealthAddr(t *testing.T, p corev1.Container) {
	t.Helper()
	ha, _ := flag(p.Args, "health-addr")
	rp := p.ReadinessProbe
	if rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Path != "/readyz" {
		t.Errorf("node plugin readinessProbe %+v; want GET /readyz", rp)
		return
	}
	port := -1
	for _, cp := range p.Ports {
		if cp.Name == rp.HTTPGet.Port.StrVal || cp.ContainerPort == rp.HTTPGet.Port.IntVal {
			port = int(cp.ContainerPort)
		}
	}
	if ha != fmt.Sprintf(":%d", port) {
		t.Errorf("node plugin --health-addr=%q; the readiness probe asks port %d", ha, port)
	}
}

// checkKeyBackendVolume: the key backend directory is a projected volume
// of the optional ConfigMaps, the optional openbao-ca Secret's CA keys and
// a service account token.
func checkKeyBackendVolume(t *testing.T, w workload, p corev1.Container) {
	t.Helper()
	m, v := mountFor(t, w, p, KeyBackendDir+"/token")
	if m.MountPath != KeyBackendDir || v.Projected == nil {
		t.Fatalf("%s is not a projected volume mount: %+v", KeyBackendDir, v.VolumeSource)
	}
	got := map[string]bool{}
	for _, s := range v.Projected.Sources {
		switch {
		case s.ConfigMap != nil:
			if s.ConfigMap.Optional == nil || !*s.ConfigMap.Optional {
				t.Errorf("ConfigMap %s is required: clusters without encrypted volumes would have no node plugin", s.ConfigMap.Name)
			}
			got[s.ConfigMap.Name] = true
		case s.Secret != nil:
			checkCASecretProjection(t, s.Secret)
			got["Secret openbao-ca"] = true
		case s.ServiceAccountToken != nil:
			if s.ServiceAccountToken.Audience == "" || s.ServiceAccountToken.Path != "token" {
				t.Errorf("key backend token: %+v", s.ServiceAccountToken)
			}
			got["token"] = true
		}
	}
	for _, want := range []string{"csi-key-backend-config", "openbao-ca", "Secret openbao-ca", "token"} {
		if !got[want] {
			t.Errorf("the node plugin's key backend volume lacks %s", want)
		}
	}
}

// checkCASecretProjection: the one Secret of the key backend volume is the
// optional openbao-ca, and only its CA bundle keys, under ca/secret/.
func checkCASecretProjection(t *testing.T, s *corev1.SecretProjection) {
	t.Helper()
	if s.Name != "openbao-ca" || s.Optional == nil || !*s.Optional || len(s.Items) == 0 {
		t.Errorf("the node plugin's key backend volume projects Secret %s (optional %v, items %v); want only the optional openbao-ca's CA keys",
			s.Name, s.Optional, s.Items)
	}
	for _, it := range s.Items {
		if !slices.Contains([]string{"ca.crt", "ca.pem", "ca-bundle.crt"}, it.Key) || it.Path != "ca/secret/"+it.Key {
			t.Errorf("Secret openbao-ca key %s projected to %s; want only CA bundle keys, under ca/secret/", it.Key, it.Path)
		}
	}
}

// checkControllerMountsNoKeyBackend: the controller has no use for the key
// backend's ConfigMaps or projected volumes.
func checkControllerMountsNoKeyBackend(t *testing.T, a *addon) {
	t.Helper()
	for _, w := range a.workloads() {
		if w.kind == "Deployment" {
			for _, v := range w.pod.Spec.Volumes {
				if v.ConfigMap != nil || v.Projected != nil {
					t.Errorf("the controller mounts %s; it has no use for the key backend", v.Name)
				}
			}
		}
	}
}

// granted reports whether the rules give verb on group/resource.
func granted(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	for _, r := range rules {
		if (slices.Contains(r.APIGroups, group) || slices.Contains(r.APIGroups, "*")) &&
			(slices.Contains(r.Resources, resource) || slices.Contains(r.Resources, "*")) &&
			(slices.Contains(r.Verbs, verb) || slices.Contains(r.Verbs, "*")) {
			return true
		}
	}
	return false
}

// controllerRules gathers the rules bound to the controller's account:
// those of its ClusterRoles, and those of its Roles in their namespace.
func controllerRules(t *testing.T, a *addon) (cluster, local []rbacv1.PolicyRule) {
	t.Helper()
	sa := a.deployments[0].Spec.Template.Spec.ServiceAccountName
	isSA := func(subjects []rbacv1.Subject) bool {
		for _, s := range subjects {
			if s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == Namespace {
				return true
			}
		}
		return false
	}
	for _, b := range a.clusterBindings {
		if !isSA(b.Subjects) {
			continue
		}
		i := slices.IndexFunc(a.clusterRoles, func(r rbacv1.ClusterRole) bool { return r.Name == b.RoleRef.Name })
		if b.RoleRef.Kind != "ClusterRole" || i < 0 {
			t.Errorf("ClusterRoleBinding %s refers to %s %s, not in the bundle", b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			continue
		}
		cluster = append(cluster, a.clusterRoles[i].Rules...)
	}
	for _, b := range a.bindings {
		if !isSA(b.Subjects) {
			continue
		}
		i := slices.IndexFunc(a.roles, func(r rbacv1.Role) bool { return r.Name == b.RoleRef.Name && r.Namespace == b.Namespace })
		if b.RoleRef.Kind != "Role" || i < 0 {
			t.Errorf("RoleBinding %s refers to %s %s, not in the bundle", b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			continue
		}
		local = append(local, a.roles[i].Rules...)
	}
	return cluster, local
}

func TestControllerRBAC(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		cluster, local := controllerRules(t, a)
		checkSidecarPermissions(t, cluster)
		checkStorageCapacity(t, a, local)
		for _, verb := range []string{"get", "create", "update"} {
			if !granted(local, "coordination.k8s.io", "leases", verb) {
				t.Errorf("leader election needs %s on leases in %s", verb, Namespace)
			}
		}
		if granted(cluster, "", "secrets", "get") || granted(local, "", "secrets", "get") {
			t.Error("the controller may read Secrets through the API; it only needs its mounted one")
		}
	})
}

// checkSidecarPermissions: the controller's ClusterRoles grant what the
// sidecars' own deployment examples ask for.
func checkSidecarPermissions(t *testing.T, cluster []rbacv1.PolicyRule) {
	t.Helper()
	need := map[string][][3]string{
		"csi-provisioner": {
			{"", "persistentvolumes", "create"}, {"", "persistentvolumes", "delete"}, {"", "persistentvolumes", "watch"},
			{"", "persistentvolumeclaims", "watch"}, {"", "persistentvolumeclaims", "update"},
			{"storage.k8s.io", "storageclasses", "list"}, {"storage.k8s.io", "csinodes", "get"},
			{"", "nodes", "get"}, {"", "events", "create"}, {"snapshot.storage.k8s.io", "volumesnapshots", "get"},
		},
		"csi-attacher": {
			{"", "persistentvolumes", "patch"}, {"storage.k8s.io", "volumeattachments", "patch"},
			{"storage.k8s.io", "volumeattachments/status", "patch"}, {"storage.k8s.io", "csinodes", "watch"},
		},
		"csi-resizer": {
			{"", "persistentvolumes", "patch"}, {"", "persistentvolumeclaims/status", "patch"}, {"", "pods", "list"},
		},
		"csi-snapshotter": {
			{"snapshot.storage.k8s.io", "volumesnapshotclasses", "list"},
			{"snapshot.storage.k8s.io", "volumesnapshotcontents", "update"},
			{"snapshot.storage.k8s.io", "volumesnapshotcontents/status", "patch"},
		},
	}
	for sidecar, perms := range need {
		for _, p := range perms {
			if !granted(cluster, p[0], p[1], p[2]) {
				t.Errorf("%s needs %s on %s.%s; the controller's ClusterRole does not grant it", sidecar, p[2], p[1], p[0])
			}
		}
	}
}

// checkStorageCapacity: with --enable-capacity the provisioner keeps
// CSIStorageCapacity objects in its namespace, owned by the Deployment it
// walks up to from its pod.
func checkStorageCapacity(t *testing.T, a *addon, local []rbacv1.PolicyRule) {
	t.Helper()
	for _, p := range [][3]string{
		{"storage.k8s.io", "csistoragecapacities", "list"}, {"storage.k8s.io", "csistoragecapacities", "watch"},
		{"storage.k8s.io", "csistoragecapacities", "create"}, {"storage.k8s.io", "csistoragecapacities", "update"},
		{"storage.k8s.io", "csistoragecapacities", "delete"}, {"", "pods", "get"}, {"apps", "replicasets", "get"},
	} {
		if !granted(local, p[0], p[1], p[2]) {
			t.Errorf("csi-provisioner --enable-capacity needs %s on %s.%s in %s", p[2], p[1], p[0], Namespace)
		}
	}
	prov := slices.IndexFunc(a.deployments[0].Spec.Template.Spec.Containers, func(c corev1.Container) bool { return c.Name == "csi-provisioner" })
	if prov < 0 {
		t.Fatal("no csi-provisioner container")
	}
	pc := a.deployments[0].Spec.Template.Spec.Containers[prov]
	if !slices.Contains(pc.Args, "--enable-capacity") {
		t.Error("csi-provisioner runs without --enable-capacity: no CSIStorageCapacity is published")
	}
	env := fieldRefEnv(pc)
	if env["NAMESPACE"] != "metadata.namespace" || env["POD_NAME"] != "metadata.name" {
		t.Errorf("csi-provisioner with --enable-capacity needs NAMESPACE and POD_NAME from the downward API; has %v", env)
	}
}

// fieldRefEnv maps the container's environment variables taken from the
// downward API to their field paths.
func fieldRefEnv(c corev1.Container) map[string]string {
	env := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			env[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	return env
}

// nodeEventsRole is the node plugin's ClusterRole for its Events.
const nodeEventsRole = "vco-csi-node-events"

// The node plugin posts the agent's events as Events about its Node
// (csi/kubeevents), in the namespace the code posts them in, and about the
// volume's claim and pods, in theirs: its account may create, get and
// patch Events and get PersistentVolumeClaims (for the claim's uid) in
// every namespace, through one ClusterRole, and nothing else; the
// DaemonSet gives it the API token and CA where the code reads them, the
// node's name, and a file for what it knows of its volumes in its own
// directory on the host.
func TestNodePluginRBAC(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.daemonSets[0]
		rules := nodeRules(t, a, d.Spec.Template.Spec.ServiceAccountName)
		checkNodeRulesExactly(t, rules)

		w := workload{"DaemonSet", d.Name, d.Spec.Selector, d.Spec.Template}
		p := a.plugin(t, w)
		if v, ok := flag(p.Args, "kube-events"); ok && v != "true" {
			t.Errorf("--kube-events=%s", v)
		}
		if _, ok := flag(p.Args, "node-name"); ok {
			t.Error("--node-name is set; the plugin takes it from NODE_NAME")
		}
		// What the plugin knows of its volumes' claims and pods must
		// survive its restart: a file in a directory of the host it may
		// write.
		if v, ok := flag(p.Args, "kube-events-state"); !ok || !strings.HasPrefix(v, "/") {
			t.Errorf("--kube-events-state=%q", v)
		} else if m, vol := mountFor(t, w, p, v); m.ReadOnly || vol.HostPath == nil {
			t.Errorf("%s is on %s (%+v), not a writable host directory", v, m.MountPath, vol.VolumeSource)
		}
		env := fieldRefEnv(p)
		if env["NODE_NAME"] != "spec.nodeName" {
			t.Errorf("NODE_NAME comes from %q, want spec.nodeName", env["NODE_NAME"])
		}
		checkAPICredentialsProjected(t, w, p)
	})
}

// nodeRules gathers the rules bound to the node account sa: through no
// RoleBinding, and one ClusterRoleBinding to nodeEventsRole, which
// aggregates nothing.
func nodeRules(t *testing.T, a *addon, sa string) []rbacv1.PolicyRule {
	t.Helper()
	isSA := func(s rbacv1.Subject) bool {
		return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == Namespace
	}
	for _, b := range a.bindings {
		if slices.ContainsFunc(b.Subjects, isSA) {
			t.Errorf("RoleBinding %s/%s gives the node account %s %s; its one grant is the ClusterRole %s", b.Namespace, b.Name, b.RoleRef.Kind, b.RoleRef.Name, nodeEventsRole)
		}
	}
	var rules []rbacv1.PolicyRule
	bound := 0
	for _, b := range a.clusterBindings {
		if !slices.ContainsFunc(b.Subjects, isSA) {
			continue
		}
		bound++
		if b.RoleRef.Kind != "ClusterRole" || b.RoleRef.Name != nodeEventsRole {
			t.Errorf("ClusterRoleBinding %s gives the node account %s %s", b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			continue
		}
		i := slices.IndexFunc(a.clusterRoles, func(r rbacv1.ClusterRole) bool { return r.Name == b.RoleRef.Name })
		if i < 0 {
			t.Fatalf("ClusterRoleBinding %s refers to ClusterRole %s, not in the bundle", b.Name, b.RoleRef.Name)
		}
		if a.clusterRoles[i].AggregationRule != nil {
			t.Errorf("ClusterRole %s aggregates other roles", b.RoleRef.Name)
		}
		rules = append(rules, a.clusterRoles[i].Rules...)
	}
	if bound != 1 {
		t.Errorf("%d ClusterRoleBindings bind the node account, want 1", bound)
	}
	return rules
}

// checkNodeRulesExactly: exactly these permissions: each needed, none more.
func checkNodeRulesExactly(t *testing.T, rules []rbacv1.PolicyRule) {
	t.Helper()
	want := map[[2]string][]string{
		{"", "events"}:                 {"create", "get", "patch"},
		{"", "persistentvolumeclaims"}: {"get"},
	}
	for k, verbs := range want {
		for _, verb := range verbs {
			if !granted(rules, k[0], k[1], verb) {
				t.Errorf("the node account may not %s %s; csi/kubeevents needs it", verb, k[1])
			}
		}
	}
	for _, r := range rules {
		if len(r.ResourceNames) > 0 || len(r.NonResourceURLs) > 0 {
			t.Errorf("rule %+v names resources or URLs; the plugin's requests name any claim and Event", r)
		}
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, verb := range r.Verbs {
					if !slices.Contains(want[[2]string{g, res}], verb) {
						t.Errorf("the node account is granted %s on %q in group %q, which csi/kubeevents does not use", verb, res, g)
					}
				}
			}
		}
	}
}

// checkAPICredentialsProjected: the API token (audience: the API server)
// and kube-root-ca.crt's ca.crt are projected where csi/kubeevents reads
// them.
func checkAPICredentialsProjected(t *testing.T, w workload, p corev1.Container) {
	t.Helper()
	var token, ca bool
	for _, f := range []string{"token", "ca.crt"} {
		m, v := mountFor(t, w, p, path.Join(kubeevents.ServiceAccountDir, f))
		if m.MountPath != kubeevents.ServiceAccountDir || v.Projected == nil {
			t.Errorf("%s/%s comes from %s (%+v)", kubeevents.ServiceAccountDir, f, m.MountPath, v.VolumeSource)
			continue
		}
		for _, src := range v.Projected.Sources {
			if st := src.ServiceAccountToken; st != nil && st.Path == f && st.Audience == "" {
				token = true
			}
			if cm := src.ConfigMap; cm != nil && cm.Name == "kube-root-ca.crt" &&
				slices.Contains(cm.Items, corev1.KeyToPath{Key: "ca.crt", Path: f}) {
				ca = true
			}
		}
	}
	if !token || !ca {
		t.Errorf("the API token (audience: the API server) projected: %v; kube-root-ca.crt's ca.crt: %v", token, ca)
	}
}

// The node plugin must run only where vco-agent runs: it tolerates every
// taint (disks attach to tainted nodes too), so without a node selector on
// the agent's label it lands on nodes with no agent and waits there forever
// on a hostPath. The label must be the one install.md
// tells the node image to set, and the controller must not need it.
func TestNodePluginOnlyWhereTheAgentRuns(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		d := a.daemonSets[0]
		if got := d.Spec.Template.Spec.NodeSelector[AgentNodeLabel]; got != "true" {
			t.Errorf("node DaemonSet nodeSelector %v lacks %s: \"true\"", d.Spec.Template.Spec.NodeSelector, AgentNodeLabel)
		}
		if aff := d.Spec.Template.Spec.Affinity; aff != nil && aff.NodeAffinity != nil {
			t.Errorf("node DaemonSet has a node affinity besides its selector: %+v", aff.NodeAffinity)
		}
		for _, dep := range a.deployments {
			if _, ok := dep.Spec.Template.Spec.NodeSelector[AgentNodeLabel]; ok {
				t.Errorf("Deployment %s selects on %s; the controller needs no agent", dep.Name, AgentNodeLabel)
			}
		}
	})
	doc, err := os.ReadFile("../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		AgentNodeLabel + "=true",         // kubelet --node-labels and kubectl label
		"node-labels: " + AgentNodeLabel, // the CAPI kubeletExtraArgs form
		"kubectl label node",             // nodes that already run
	} {
		if !strings.Contains(string(doc), want) {
			t.Errorf("docs/install.md does not show %q", want)
		}
	}
}

// nodeTermMatches evaluates a node selector term's match expressions on
// a node's labels.
func nodeTermMatches(t *testing.T, term corev1.NodeSelectorTerm, node labels.Set) bool {
	t.Helper()
	sel := labels.NewSelector()
	for _, e := range term.MatchExpressions {
		op, ok := map[corev1.NodeSelectorOperator]selection.Operator{corev1.NodeSelectorOpIn: selection.In, corev1.NodeSelectorOpNotIn: selection.NotIn,
			corev1.NodeSelectorOpExists: selection.Exists, corev1.NodeSelectorOpDoesNotExist: selection.DoesNotExist}[e.Operator]
		if !ok {
			t.Fatalf("node selector operator %s: this test knows In, NotIn, Exists and DoesNotExist", e.Operator)
		}
		r, err := labels.NewRequirement(e.Key, op, e.Values)
		if err != nil {
			t.Fatalf("node selector requirement %+v: %v", e, err)
		}
		sel = sel.Add(*r)
	}
	return len(term.MatchFields) == 0 && sel.Matches(node)
}

// The controller needs no agent, and its pod holds the cloud credential:
// it prefers the nodes the node plugin's DaemonSet does not select (a
// cluster's control plane), and is not bound to them, so that a cluster
// whose every node runs the agent still runs it.
func TestControllerPrefersNodesWithoutTheAgent(t *testing.T) {
	forEachRendering(t, func(t *testing.T, a *addon) {
		spec := a.deployments[0].Spec.Template.Spec
		agentNode := labels.Set{"kubernetes.io/os": "linux", AgentNodeLabel: "true"}
		for k, v := range a.daemonSets[0].Spec.Template.Spec.NodeSelector {
			if agentNode[k] != v {
				t.Fatalf("the node DaemonSet selects %s=%s, which this test's agent node lacks", k, v)
			}
		}
		other := labels.Set{"kubernetes.io/os": "linux", "node-role.kubernetes.io/control-plane": ""}
		if spec.Affinity == nil || spec.Affinity.NodeAffinity == nil {
			t.Fatal("the controller has no node affinity")
		}
		na := spec.Affinity.NodeAffinity
		if na.RequiredDuringSchedulingIgnoredDuringExecution != nil {
			t.Errorf("the controller requires %+v: a cluster of agent nodes only could not run it", na.RequiredDuringSchedulingIgnoredDuringExecution)
		}
		prefer := map[string]int32{}
		for _, pt := range na.PreferredDuringSchedulingIgnoredDuringExecution {
			for name, node := range map[string]labels.Set{"agent": agentNode, "other": other} {
				if nodeTermMatches(t, pt.Preference, node) {
					prefer[name] += pt.Weight
				}
			}
		}
		if prefer["other"] <= prefer["agent"] {
			t.Errorf("the controller's preferences weigh a node without the agent %d, one with it %d", prefer["other"], prefer["agent"])
		}
		if !slices.ContainsFunc(spec.Tolerations, func(tl corev1.Toleration) bool {
			return tl.Key == "node-role.kubernetes.io/control-plane" && tl.Effect == corev1.TaintEffectNoSchedule
		}) {
			t.Error("the controller does not tolerate the control plane's taint, where it prefers to run")
		}
	})
}

// The opt-in monitoring file's alerts must watch series the agent and the
// plugin really export: every vco_* name in an alert's expression is one
// that agent/volume, agent/watchdog, agent/daemon or csi/metrics defines,
// and the PodMonitor scrapes ports the add-on's pods name.
func TestMonitoringWatchesRealSeries(t *testing.T) {
	defined := definedSeries(t)
	if !defined["vco_agent_fences_total"] || !defined["vco_agent_host_watchdog_unsafe"] || !defined["vco_csi_api_requests_total"] {
		t.Fatalf("the series definitions were not read: %v", defined)
	}
	b, err := os.ReadFile("monitoring/vco-csi-monitoring.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var ports []string
	for _, w := range decode(t, renderings[0].Image, renderings[0].DriverName).workloads() {
		for _, c := range w.pod.Spec.Containers {
			for _, p := range c.Ports {
				ports = append(ports, p.Name)
			}
		}
	}
	alerts := 0
	for _, doc := range splitDocs(b) {
		alerts += checkMonitoringDoc(t, doc, defined, ports)
	}
	if alerts < 5 {
		t.Errorf("%d alerts, want the fencing and API alerts", alerts)
	}
}

// definedSeries reads the vco_* series that agent/volume, agent/watchdog,
// agent/daemon and csi/metrics define.
func definedSeries(t *testing.T) map[string]bool {
	t.Helper()
	defined := map[string]bool{}
	nameRe := regexp.MustCompile(`Namespace: "(vco_[a-z]+)", Name: "([a-z_]+)"`)
	descRe := regexp.MustCompile(`NewDesc\("(vco_[a-z_]+)"`)
	prefixRe := regexp.MustCompile(`return prometheus.NewDesc\("(vco_[a-z_]+)"\+name`)
	shortRe := regexp.MustCompile(`= desc\("([a-z_]+)"`)
	// agent/volume names its namespace once and builds counters through
	// counterOpts/counterVec.
	nsRe := regexp.MustCompile(`metricNamespace = "(vco_[a-z]+)"`)
	nsNameRe := regexp.MustCompile(`Namespace: metricNamespace, Name: "([a-z_]+)"`)
	counterRe := regexp.MustCompile(`counter(?:Opts|Vec)\("([a-z_]+)"`)
	for _, f := range []string{"../agent/volume/metrics.go", "../agent/watchdog/metrics.go", "../agent/daemon/daemon.go", "../csi/metrics/metrics.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range nameRe.FindAllSubmatch(b, -1) {
			defined[string(m[1])+"_"+string(m[2])] = true
		}
		for _, m := range descRe.FindAllSubmatch(b, -1) {
			defined[string(m[1])] = true
		}
		if ns := nsRe.FindSubmatch(b); ns != nil {
			for _, re := range []*regexp.Regexp{nsNameRe, counterRe} {
				for _, m := range re.FindAllSubmatch(b, -1) {
					defined[string(ns[1])+"_"+string(m[1])] = true
				}
			}
		}
		if p := prefixRe.FindSubmatch(b); p != nil {
			for _, m := range shortRe.FindAllSubmatch(b, -1) {
				defined[string(p[1])+string(m[1])] = true
			}
		}
	}
	return defined
}

var usedSeries = regexp.MustCompile(`vco_[a-z_]+`)

// checkMonitoringDoc checks one document of the monitoring file: the
// PodMonitor scrapes ports the add-on's pods name, and every alert watches
// series that are defined. It returns the number of alerts in it.
func checkMonitoringDoc(t *testing.T, doc []byte, defined map[string]bool, ports []string) int {
	t.Helper()
	var o struct {
		Kind string `json:"kind"`
		Spec struct {
			Endpoints []struct {
				Port string `json:"port"`
			} `json:"podMetricsEndpoints"`
			Groups []struct {
				Rules []struct {
					Alert string `json:"alert"`
					Expr  string `json:"expr"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(doc, &o); err != nil {
		t.Fatal(err)
	}
	for _, e := range o.Spec.Endpoints {
		if !slices.Contains(ports, e.Port) {
			t.Errorf("the PodMonitor scrapes port %q, which no container of the add-on names (%v)", e.Port, ports)
		}
	}
	alerts := 0
	for _, g := range o.Spec.Groups {
		for _, r := range g.Rules {
			alerts++
			for _, n := range usedSeries.FindAllString(r.Expr, -1) {
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					n = strings.TrimSuffix(n, s)
				}
				if !defined[n] {
					t.Errorf("alert %s watches %s, which nothing exports", r.Alert, n)
				}
			}
		}
	}
	return alerts
}
