package story

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

// K14's checks of what an operator must know about a ClusterResourceSet:
// the ConfigMap's size limit, what Reconcile does to a hand edit, how an
// upgrade flows.

// k14Limit shows the API server's limit on a ConfigMap's values, on the
// management cluster: exactly ConfigMapLimit bytes are taken, one more
// refused.
func (c cluster) k14Limit(ctx context.Context) (string, error) {
	cm := func(name string, n int) string {
		return fmt.Sprintf("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: %s, namespace: %s}\ndata:\n  k: %s\n", name, MgmtNamespace, strings.Repeat("a", n))
	}
	if _, err := c.KubectlInput(ctx, strings.NewReader(cm("k14-limit", ConfigMapLimit)), "create", "-f", "-"); err != nil {
		return "", fmt.Errorf("a ConfigMap of exactly %d bytes: %w", ConfigMapLimit, err)
	}
	if _, err := c.Kubectl(ctx, "-n", MgmtNamespace, "delete", "configmap", "k14-limit"); err != nil {
		return "", err
	}
	_, refused := c.KubectlInput(ctx, strings.NewReader(cm("k14-over", ConfigMapLimit+1)), "create", "-f", "-")
	if refused == nil {
		return "", fmt.Errorf("the API server took a ConfigMap of %d bytes", ConfigMapLimit+1)
	}
	if !strings.Contains(refused.Error(), "Too long") {
		return "", fmt.Errorf("a ConfigMap of %d bytes refused for another reason: %w", ConfigMapLimit+1, refused)
	}
	bundle, err := crsBundle()
	if err != nil {
		return "", err
	}
	msg := refused.Error()
	if i := strings.Index(msg, "is invalid: "); i >= 0 {
		msg = msg[i+len("is invalid: "):]
	}
	return fmt.Sprintf("%d bytes taken; %d refused (%q); the rendered add-on is %d bytes, %.1f%% of it",
		ConfigMapLimit, ConfigMapLimit+1, msg, len(bundle), 100*float64(len(bundle))/ConfigMapLimit), nil
}

// credentialRevision is the label K14 adds to csi-driver-secret's
// manifest to change it.
const credentialRevision = "vco.whitesky.cloud/credential-revision"

// k14HandEdit scales the controller to none and labels it by hand, then
// changes the credential's manifest in its resource-set Secret, and waits
// until the set has applied the Secret again: in that same pass the
// add-on's ConfigMap, unchanged, is not applied, and the hand edit stays.
func (c cluster) k14HandEdit(ctx context.Context) (string, error) {
	ctl := "deployment/" + k8s.ControllerName
	if _, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "scale", ctl, "--replicas=0"); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "label", ctl, "hand-edited=k14"); err != nil {
		return "", err
	}
	ns := "  namespace: " + k8s.AddonNamespace + "\n"
	manifest := k8s.CredentialManifest()
	if strings.Count(manifest, ns) != 1 {
		return "", fmt.Errorf("csi-driver-secret's manifest has no single %q line", strings.TrimSpace(ns))
	}
	manifest = strings.Replace(manifest, ns, ns+"  labels: {"+credentialRevision+": \"2\"}\n", 1)
	if err := c.replaceFromFile(ctx, []string{"secret", "generic", CredentialSecret, "--type=" + ResourceSetSecretType}, CredentialKey, manifest); err != nil {
		return "", err
	}
	start := time.Now()
	if err := k8s.WaitFor(ctx, 3*time.Minute, "csi-driver-secret applied again with "+credentialRevision+"=2", func() (bool, string, error) {
		got, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "secret", "csi-driver-secret", "-o", "jsonpath={.metadata.labels}")
		return err == nil && strings.Contains(got, `"`+credentialRevision+`":"2"`), got, nil
	}); err != nil {
		return "", c.withManagerLog(err)
	}
	took := time.Since(start).Round(time.Second)
	replicas, label, err := c.controllerEdit(ctx)
	if err != nil {
		return "", err
	}
	if replicas != "0" || label != "k14" {
		return "", fmt.Errorf("after the set applied csi-driver-secret again, %s has replicas %s and label hand-edited=%q: the hand edit was undone", k8s.ControllerName, replicas, label)
	}
	return fmt.Sprintf("csi-driver-secret applied again %s after its manifest changed; %s still has replicas 0 and hand-edited=k14: Reconcile applies a resource again only when its content changes, and does not watch the workload cluster", took, k8s.ControllerName), nil
}

// controllerEdit reads the controller Deployment's replicas and its
// hand-edited label.
func (c cluster) controllerEdit(ctx context.Context) (replicas, label string, err error) {
	got, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "deployment", k8s.ControllerName, "-o", `jsonpath={.spec.replicas} {.metadata.labels.hand-edited}`)
	if err != nil {
		return "", "", err
	}
	f := strings.Fields(got)
	if len(f) == 0 {
		return "", "", fmt.Errorf("%s: no replicas in %q", k8s.ControllerName, got)
	}
	if len(f) > 1 {
		label = f[1]
	}
	return f[0], label, nil
}

// replaceFromFile replaces a management cluster object made by kubectl
// create (args: what to create and its name) from content under key.
func (c cluster) replaceFromFile(ctx context.Context, args []string, key, content string) error {
	f := filepath.Join(c.Env.Lab.Dir(), "capi", key)
	if err := os.WriteFile(f, []byte(content), 0o600); err != nil {
		return err
	}
	create := append(append([]string{"-n", MgmtNamespace, "create"}, args...), "--from-file="+key+"="+f, "--dry-run=client", "-o", "yaml")
	obj, err := c.Kubectl(ctx, create...)
	if err != nil {
		return err
	}
	_, err = c.KubectlInput(ctx, strings.NewReader(obj), "replace", "-f", "-")
	return err
}

// k14Upgrade replaces the add-on's ConfigMap with the bundle at revision
// 2 (withRevision) and ApplyOnce's source with revision 2 of its object,
// and waits until the workloads have rolled.
func (c cluster) k14Upgrade(ctx context.Context) (string, error) {
	bundle, err := crsBundle()
	if err != nil {
		return "", err
	}
	if bundle, err = withRevision(bundle, "2"); err != nil {
		return "", err
	}
	start := time.Now()
	if err := c.putAddonConfigMap(ctx, bundle, "replace"); err != nil {
		return "", err
	}
	if _, err := c.KubectlInput(ctx, strings.NewReader(onceSource("2")), "apply", "-f", "-"); err != nil {
		return "", err
	}
	for _, r := range []string{"deployment/" + k8s.ControllerName, "daemonset/" + k8s.NodeName} {
		if err := k8s.WaitFor(ctx, 3*time.Minute, r+" at revision 2", func() (bool, string, error) {
			got, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", r, "-o", `jsonpath={.spec.template.metadata.annotations}`)
			return err == nil && strings.Contains(got, `"`+RevisionAnnotation+`":"2"`), got, nil
		}); err != nil {
			return "", c.withManagerLog(err)
		}
	}
	applied := time.Since(start).Round(time.Second)
	for _, r := range []string{"deployment/" + k8s.ControllerName, "daemonset/" + k8s.NodeName} {
		if _, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "rollout", "status", r, "--timeout=10m"); err != nil {
			return "", c.PodsState(ctx, err)
		}
	}
	if err := c.waitCSINodes(ctx); err != nil {
		return "", err
	}
	rolled := time.Since(start).Round(time.Second)
	return c.k14AfterUpgrade(ctx, applied, rolled)
}

// k14AfterUpgrade checks what the upgrade did to the hand edit and to
// ApplyOnce's object.
func (c cluster) k14AfterUpgrade(ctx context.Context, applied, rolled time.Duration) (string, error) {
	replicas, label, err := c.controllerEdit(ctx)
	if err != nil {
		return "", err
	}
	if replicas != "1" || label != "" {
		return "", fmt.Errorf("after the upgrade %s has replicas %s and hand-edited=%q, want the add-on's 1 and no such label", k8s.ControllerName, replicas, label)
	}
	once, err := c.Kubectl(ctx, "-n", "default", "get", "configmap", OnceObject, "-o", "jsonpath={.data.revision}")
	if err != nil {
		return "", err
	}
	if once != "1" {
		return "", fmt.Errorf("ApplyOnce's %s is at revision %q after its source changed, want 1", OnceObject, once)
	}
	return fmt.Sprintf("applied %s after the ConfigMap changed, workloads rolled and registered after %s; %s back to replicas 1 without the hand label (the set's patch makes each object what the add-on says); ApplyOnce's %s still at revision 1",
		applied, rolled, k8s.ControllerName, OnceObject), nil
}

// k14Volume provisions a claim on the delivered, upgraded driver and
// waits for its writer.
func (s *story) k14Volume(ctx context.Context) (string, error) {
	p, err := s.startWriter(ctx, "k14", pvc("k14", "1Gi"))
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%s Ready on %s", p.Name, p.Node), nil
}

// k14Cleanup deletes the writer and its claim.
func (s *story) k14Cleanup(ctx context.Context) (string, error) {
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "deployment", "k14", "--wait=true"); err != nil {
		return "", err
	}
	_, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "k14", "--wait=true", "--timeout=5m")
	return "deleted", err
}
