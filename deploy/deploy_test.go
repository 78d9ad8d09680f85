package deploy

import (
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

const (
	testImage  = "registry.whitesky.cloud/vco/vco-csi:v1.2.3"
	testDriver = "cloud.whitesky.csi"
)

// volumeSnapshotClass mirrors snapshot.storage.k8s.io/v1 VolumeSnapshotClass
// (its Go types live in a separate client module) so it decodes strictly too.
type volumeSnapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Driver            string            `json:"driver"`
	DeletionPolicy    string            `json:"deletionPolicy"`
	Parameters        map[string]string `json:"parameters,omitempty"`
}

type objects struct {
	namespaces    []corev1.Namespace
	accounts      []corev1.ServiceAccount
	drivers       []storagev1.CSIDriver
	classes       []storagev1.StorageClass
	snapClasses   []volumeSnapshotClass
	clusterRoles  []rbacv1.ClusterRole
	clusterBinds  []rbacv1.ClusterRoleBinding
	roles         []rbacv1.Role
	roleBinds     []rbacv1.RoleBinding
	deployments   []appsv1.Deployment
	daemonSets    []appsv1.DaemonSet
	namespacedAll []metav1.ObjectMeta
}

func strict[T any](t *testing.T, doc string, into *[]T) T {
	t.Helper()
	var v T
	if err := yaml.UnmarshalStrict([]byte(doc), &v); err != nil {
		t.Fatalf("strict decode: %v\n%s", err, doc)
	}
	*into = append(*into, v)
	return v
}

// decode splits the stream and decodes every document strictly into its
// API type; an unknown kind or field fails the test.
func decode(t *testing.T, stream string) objects {
	t.Helper()
	var o objects
	for _, doc := range strings.Split(stream, "\n---\n") {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatal(err)
		}
		if tm.Kind == "" {
			if strings.TrimSpace(stripComments(doc)) != "" {
				t.Fatalf("document without kind:\n%s", doc)
			}
			continue
		}
		var meta metav1.ObjectMeta
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 Namespace":
			meta = strict(t, doc, &o.namespaces).ObjectMeta
		case "v1 ServiceAccount":
			v := strict(t, doc, &o.accounts)
			meta = v.ObjectMeta
			o.namespacedAll = append(o.namespacedAll, meta)
		case "storage.k8s.io/v1 CSIDriver":
			meta = strict(t, doc, &o.drivers).ObjectMeta
		case "storage.k8s.io/v1 StorageClass":
			meta = strict(t, doc, &o.classes).ObjectMeta
		case "snapshot.storage.k8s.io/v1 VolumeSnapshotClass":
			meta = strict(t, doc, &o.snapClasses).ObjectMeta
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			meta = strict(t, doc, &o.clusterRoles).ObjectMeta
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			meta = strict(t, doc, &o.clusterBinds).ObjectMeta
		case "rbac.authorization.k8s.io/v1 Role":
			meta = strict(t, doc, &o.roles).ObjectMeta
			o.namespacedAll = append(o.namespacedAll, meta)
		case "rbac.authorization.k8s.io/v1 RoleBinding":
			meta = strict(t, doc, &o.roleBinds).ObjectMeta
			o.namespacedAll = append(o.namespacedAll, meta)
		case "apps/v1 Deployment":
			meta = strict(t, doc, &o.deployments).ObjectMeta
			o.namespacedAll = append(o.namespacedAll, meta)
		case "apps/v1 DaemonSet":
			meta = strict(t, doc, &o.daemonSets).ObjectMeta
			o.namespacedAll = append(o.namespacedAll, meta)
		default:
			t.Fatalf("unexpected kind %s %s", tm.APIVersion, tm.Kind)
		}
		if meta.Labels["app.kubernetes.io/part-of"] != "vco-csi" {
			t.Errorf("%s %s lacks the label app.kubernetes.io/part-of=vco-csi", tm.Kind, meta.Name)
		}
	}
	return o
}

func stripComments(doc string) string {
	var out []string
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func rendered(t *testing.T) objects {
	t.Helper()
	out, err := Render(testImage)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "${") {
		t.Fatalf("placeholders left after rendering")
	}
	return decode(t, out)
}

func TestRenderDerivesTheDriverName(t *testing.T) {
	for image, want := range map[string]string{
		"registry.whitesky.cloud/vco/vco-csi:v1":        "cloud.whitesky.csi",
		"registry.whitesky.cloud:5000/vco-csi@sha256:0": "cloud.whitesky.csi",
		"Reg.Example.COM/a/b/c:v2":                      "com.example.csi",
	} {
		out, err := Render(image)
		if err != nil {
			t.Fatalf("Render(%q): %v", image, err)
		}
		o := decode(t, out)
		if len(o.drivers) != 1 || o.drivers[0].Name != want {
			t.Errorf("Render(%q) names the driver %v, want %s", image, o.drivers, want)
		}
		if !strings.Contains(out, "image: "+image+"\n") {
			t.Errorf("Render(%q) does not use the image as given", image)
		}
	}
}

func TestRenderRefusesHostlessImages(t *testing.T) {
	for _, img := range []string{"vco-csi:v1", "vco/vco-csi:v1", "10.0.0.1:5000/vco-csi:v1", "localhost/vco-csi"} {
		if _, err := Render(img); err == nil {
			t.Errorf("Render(%q): want an error", img)
		}
	}
}

// The release artifact is meant for envsubst: envsubst with the two
// variables must give exactly what Render gives.
func TestBundleIsEnvsubstCompatible(t *testing.T) {
	bundle, err := Bundle()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("envsubst", "${VCO_CSI_IMAGE} ${VCO_CSI_DRIVER_NAME}")
	cmd.Env = []string{"VCO_CSI_IMAGE=" + testImage, "VCO_CSI_DRIVER_NAME=" + testDriver}
	cmd.Stdin = strings.NewReader(bundle)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	want, err := Render(testImage)
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != want {
		t.Fatal("envsubst output differs from Render")
	}
	// Anything else that looks like a variable would be eaten by envsubst.
	rest := strings.NewReplacer(ImagePlaceholder, "", DriverNamePlaceholder, "").Replace(bundle)
	if strings.Contains(rest, "${") {
		t.Fatal("the bundle holds a ${...} other than the two placeholders")
	}
}

func TestManifests(t *testing.T) {
	o := rendered(t)
	if got := driver.NameFromPortal("registry.whitesky.cloud"); got != testDriver {
		t.Fatalf("the plugin derives %s from the test image's host, the test expects %s", got, testDriver)
	}

	if len(o.namespaces) != 1 || o.namespaces[0].Name != Namespace {
		t.Errorf("namespaces %v", o.namespaces)
	}
	for _, m := range o.namespacedAll {
		if m.Namespace != Namespace {
			t.Errorf("%s is in namespace %q, want %s", m.Name, m.Namespace, Namespace)
		}
	}

	// CSIDriver.
	if len(o.drivers) != 1 {
		t.Fatalf("%d CSIDrivers", len(o.drivers))
	}
	d := o.drivers[0]
	if d.Name != testDriver || d.Spec.AttachRequired == nil || !*d.Spec.AttachRequired ||
		d.Spec.PodInfoOnMount == nil || !*d.Spec.PodInfoOnMount ||
		d.Spec.FSGroupPolicy == nil || *d.Spec.FSGroupPolicy != storagev1.FileFSGroupPolicy {
		t.Errorf("CSIDriver %+v", d)
	}

	// StorageClasses.
	classes := map[string]storagev1.StorageClass{}
	for _, c := range o.classes {
		classes[c.Name] = c
		if c.Provisioner != testDriver {
			t.Errorf("StorageClass %s provisioner %s, want %s", c.Name, c.Provisioner, testDriver)
		}
		if c.VolumeBindingMode == nil || *c.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
			t.Errorf("StorageClass %s is not WaitForFirstConsumer", c.Name)
		}
		if c.AllowVolumeExpansion == nil || !*c.AllowVolumeExpansion {
			t.Errorf("StorageClass %s does not allow expansion", c.Name)
		}
		isDefault := c.Annotations["storageclass.kubernetes.io/is-default-class"] == "true"
		if isDefault != (c.Name == "vco-csi") {
			t.Errorf("StorageClass %s default=%v; only vco-csi is the default", c.Name, isDefault)
		}
	}
	for _, n := range []string{"vco-csi", "vco-csi-physical", "vco-csi-encrypted-vault"} {
		if _, ok := classes[n]; !ok {
			t.Errorf("no StorageClass %s", n)
		}
	}
	if classes["vco-csi-physical"].Parameters["type"] != "physical" || classes["vco-csi-encrypted-vault"].Parameters["encryption"] != "true" {
		t.Errorf("class parameters: physical %v, encrypted %v", classes["vco-csi-physical"].Parameters, classes["vco-csi-encrypted-vault"].Parameters)
	}
	if len(o.snapClasses) != 1 || o.snapClasses[0].Driver != testDriver || o.snapClasses[0].DeletionPolicy != "Delete" {
		t.Errorf("VolumeSnapshotClass %+v", o.snapClasses)
	}

	// Workloads.
	if len(o.deployments) != 1 || len(o.daemonSets) != 1 {
		t.Fatalf("%d Deployments, %d DaemonSets", len(o.deployments), len(o.daemonSets))
	}
	ctrl, node := o.deployments[0], o.daemonSets[0]
	checkSelector(t, "controller", ctrl.Spec.Selector, ctrl.Spec.Template.Labels)
	checkSelector(t, "node", node.Spec.Selector, node.Spec.Template.Labels)
	checkAccount(t, o, ctrl.Spec.Template.Spec.ServiceAccountName)
	checkAccount(t, o, node.Spec.Template.Spec.ServiceAccountName)
	checkControllerRBAC(t, o, ctrl.Spec.Template.Spec.ServiceAccountName)

	cs := containers(ctrl.Spec.Template.Spec)
	for _, want := range []string{"vco-csi", "csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter", "liveness-probe"} {
		if _, ok := cs[want]; !ok {
			t.Errorf("controller lacks container %s", want)
		}
	}
	if !slices.Contains(cs["csi-provisioner"].Args, "--feature-gates=Topology=true") {
		t.Errorf("external-provisioner args %v lack --feature-gates=Topology=true", cs["csi-provisioner"].Args)
	}
	checkPlugin(t, "controller", cs["vco-csi"], "controller")
	checkSocketShared(t, "controller", ctrl.Spec.Template.Spec)
	checkLiveness(t, "controller", cs)

	ns := containers(node.Spec.Template.Spec)
	checkPlugin(t, "node", ns["vco-csi"], "node")
	checkSocketShared(t, "node", node.Spec.Template.Spec)
	checkLiveness(t, "node", ns)
	for _, c := range node.Spec.Template.Spec.Containers {
		if sc := c.SecurityContext; sc == nil || (sc.Privileged != nil && *sc.Privileged) || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("node container %s may be privileged or escalate", c.Name)
		}
		if sc := c.SecurityContext; sc != nil && (sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0) {
			t.Errorf("node container %s keeps capabilities", c.Name)
		}
	}
	vols := volumes(node.Spec.Template.Spec)
	if hp := vols["kubelet-dir"].HostPath; hp == nil || hp.Path != "/var/lib/kubelet" {
		t.Errorf("kubelet-dir volume %+v", vols["kubelet-dir"])
	}
	if hp := vols["agent-dir"].HostPath; hp == nil || hp.Path != "/run/vco-agent" {
		t.Errorf("agent-dir volume %+v", vols["agent-dir"])
	}
	if hp := vols["plugin-dir"].HostPath; hp == nil || hp.Path != "/var/lib/kubelet/plugins/"+testDriver {
		t.Errorf("plugin-dir volume %+v", vols["plugin-dir"])
	}
	plugin := ns["vco-csi"]
	kubeletMount := mount(plugin, "kubelet-dir")
	if kubeletMount == nil || kubeletMount.MountPath != "/var/lib/kubelet" ||
		kubeletMount.MountPropagation == nil || *kubeletMount.MountPropagation != corev1.MountPropagationHostToContainer {
		t.Errorf("node plugin's kubelet mount %+v: want /var/lib/kubelet with HostToContainer", kubeletMount)
	}
	agentMount := mount(plugin, "agent-dir")
	if agentMount == nil || !slices.Contains(plugin.Args, "--agent-socket="+agentMount.MountPath+"/agent.sock") {
		t.Errorf("node plugin's agent socket argument %v does not lie in its agent-dir mount %+v", plugin.Args, agentMount)
	}
	if !slices.Contains(plugin.Args, "--kubelet-root="+kubeletMount.MountPath) {
		t.Errorf("node plugin's --kubelet-root does not match its kubelet mount")
	}
	reg := ns["node-driver-registrar"]
	if !slices.Contains(reg.Args, "--kubelet-registration-path="+vols["plugin-dir"].HostPath.Path+"/csi.sock") {
		t.Errorf("registrar args %v do not name the plugin-dir socket", reg.Args)
	}

	// Only the controller reads the cloud credential.
	if !usesSecret(ctrl.Spec.Template.Spec, "csi-driver-secret") {
		t.Error("the controller does not read csi-driver-secret")
	}
	if usesSecret(node.Spec.Template.Spec, "csi-driver-secret") {
		t.Error("the node plugin must not see csi-driver-secret")
	}
	for _, cm := range []string{"csi-key-backend-config", "openbao-ca"} {
		found := false
		for _, v := range node.Spec.Template.Spec.Volumes {
			if v.ConfigMap != nil && v.ConfigMap.Name == cm {
				found = true
			}
		}
		if !found {
			t.Errorf("node plugin does not mount ConfigMap %s", cm)
		}
	}
}

func checkSelector(t *testing.T, what string, sel *metav1.LabelSelector, labels map[string]string) {
	t.Helper()
	if sel == nil || len(sel.MatchLabels) == 0 {
		t.Errorf("%s has no selector", what)
		return
	}
	for k, v := range sel.MatchLabels {
		if labels[k] != v {
			t.Errorf("%s selector %s=%s does not match its pod labels %v", what, k, v, labels)
		}
	}
}

func checkAccount(t *testing.T, o objects, name string) {
	t.Helper()
	if !slices.ContainsFunc(o.accounts, func(a corev1.ServiceAccount) bool { return a.Name == name }) {
		t.Errorf("ServiceAccount %s is not defined", name)
	}
}

func checkControllerRBAC(t *testing.T, o objects, account string) {
	t.Helper()
	bound := func(subjects []rbacv1.Subject) bool {
		return slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == account && s.Namespace == Namespace
		})
	}
	for _, b := range o.clusterBinds {
		if !bound(b.Subjects) {
			t.Errorf("ClusterRoleBinding %s does not bind %s", b.Name, account)
		}
		if !slices.ContainsFunc(o.clusterRoles, func(r rbacv1.ClusterRole) bool { return r.Name == b.RoleRef.Name }) {
			t.Errorf("ClusterRoleBinding %s refers to an undefined ClusterRole %s", b.Name, b.RoleRef.Name)
		}
	}
	for _, b := range o.roleBinds {
		if !bound(b.Subjects) {
			t.Errorf("RoleBinding %s does not bind %s", b.Name, account)
		}
		if !slices.ContainsFunc(o.roles, func(r rbacv1.Role) bool { return r.Name == b.RoleRef.Name }) {
			t.Errorf("RoleBinding %s refers to an undefined Role %s", b.Name, b.RoleRef.Name)
		}
	}
	allowed := func(group, resource, verb string) bool {
		for _, r := range o.clusterRoles {
			for _, rule := range r.Rules {
				if slices.Contains(rule.APIGroups, group) && slices.Contains(rule.Resources, resource) && slices.Contains(rule.Verbs, verb) {
					return true
				}
			}
		}
		return false
	}
	for _, need := range [][3]string{
		{"", "persistentvolumes", "create"}, {"", "persistentvolumes", "delete"},
		{"storage.k8s.io", "volumeattachments", "patch"}, {"storage.k8s.io", "volumeattachments/status", "patch"},
		{"", "persistentvolumeclaims/status", "patch"}, {"snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"},
		{"storage.k8s.io", "csinodes", "get"},
	} {
		if !allowed(need[0], need[1], need[2]) {
			t.Errorf("the controller may not %s %s.%s", need[2], need[1], need[0])
		}
	}
}

func containers(spec corev1.PodSpec) map[string]corev1.Container {
	m := map[string]corev1.Container{}
	for _, c := range spec.Containers {
		m[c.Name] = c
	}
	return m
}

func volumes(spec corev1.PodSpec) map[string]corev1.Volume {
	m := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		m[v.Name] = v
	}
	return m
}

func mount(c corev1.Container, volume string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].Name == volume {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

func checkPlugin(t *testing.T, what string, c corev1.Container, mode string) {
	t.Helper()
	if c.Image != testImage {
		t.Errorf("%s plugin image %q, want %q", what, c.Image, testImage)
	}
	for _, want := range []string{"--mode=" + mode, "--driver-name=" + testDriver, "--endpoint=unix:///csi/csi.sock"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("%s plugin args %v lack %s", what, c.Args, want)
		}
	}
}

// Every sidecar talks to the plugin through the same socket directory.
func checkSocketShared(t *testing.T, what string, spec corev1.PodSpec) {
	t.Helper()
	pluginMount := mount(containers(spec)["vco-csi"], spec.Containers[0].VolumeMounts[0].Name)
	if pluginMount == nil || pluginMount.MountPath != "/csi" {
		t.Fatalf("%s plugin does not mount its socket directory at /csi", what)
	}
	for _, c := range spec.Containers {
		if c.Name == "vco-csi" {
			continue
		}
		m := mount(c, pluginMount.Name)
		if m == nil || !slices.Contains(c.Args, "--csi-address="+m.MountPath+"/csi.sock") {
			t.Errorf("%s sidecar %s does not reach the plugin socket (args %v)", what, c.Name, c.Args)
		}
	}
}

// The plugin's liveness probe asks the livenessprobe sidecar's port.
func checkLiveness(t *testing.T, what string, cs map[string]corev1.Container) {
	t.Helper()
	plugin, probe := cs["vco-csi"], cs["liveness-probe"]
	if plugin.LivenessProbe == nil || plugin.LivenessProbe.HTTPGet == nil || len(plugin.Ports) != 1 {
		t.Fatalf("%s plugin has no HTTP liveness probe on one port", what)
	}
	port := plugin.Ports[0]
	if plugin.LivenessProbe.HTTPGet.Port.String() != port.Name {
		t.Errorf("%s liveness probe port %s is not the plugin's %s", what, plugin.LivenessProbe.HTTPGet.Port.String(), port.Name)
	}
	if !slices.Contains(probe.Args, "--http-endpoint=:"+strconv.Itoa(int(port.ContainerPort))) {
		t.Errorf("%s livenessprobe args %v do not serve port %d", what, probe.Args, port.ContainerPort)
	}
}

func usesSecret(spec corev1.PodSpec, name string) bool {
	for _, v := range spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == name {
			return true
		}
	}
	for _, c := range append(spec.Containers, spec.InitContainers...) {
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name == name {
				return true
			}
		}
		for _, ef := range c.EnvFrom {
			if ef.SecretRef != nil && ef.SecretRef.Name == name {
				return true
			}
		}
	}
	return false
}
