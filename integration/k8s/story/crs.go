package story

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/capi"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// k14: the add-on delivered by a ClusterResourceSet, as seed 001 has
// CAPVCO deliver it. The lab's control plane is the management cluster
// too (Cluster API's CRDs, its core manager as a lab process) and its
// Cluster object's kubeconfig Secret points back at the lab's API server.
// The story's setup applied the add-on with kubectl; K14 deletes it
// first, so that the driver that comes up afterwards is the one the
// ClusterResourceSet applied and nothing else.
func (s *story) k14(ctx context.Context) error {
	const sc = "K14"
	steps := []struct {
		name string
		f    func(context.Context) (string, error)
	}{
		{"delete the add-on the setup applied (its objects, the namespace " + k8s.AddonNamespace + " with csi-driver-secret): no driver in the cluster", s.c.removeAddon},
		{"management cluster on the lab's control plane: Cluster API's CRDs applied with kubectl, its core manager built from source started on the host", s.c.k14Manager},
		{"the add-on as CAPVCO wraps it: ConfigMap " + AddonConfigMap + " of csi.yaml rendered, Secret " + CredentialSecret + " of type " + ResourceSetSecretType + ", ClusterResourceSets " + AddonCRS + " (Reconcile) and " + OnceCRS + " (ApplyOnce), Cluster " + CRSClusterName + " labelled " + CSILabel + ": vco with its kubeconfig Secret", s.c.k14Wrap},
		{"the ClusterResourceSet alone brings the driver up: controller available, node plugin on every worker, CSINodes list the driver, no kubectl among the objects' managers", s.c.k14Delivered},
		{"a ConfigMap holds 1 MiB: the rendered add-on's share of it; the API server takes a value of exactly 1 MiB and refuses one byte more", s.c.k14Limit},
		{"Reconcile and a hand edit: the controller scaled to 0 and labelled by hand, then csi-driver-secret's manifest changed in " + CredentialSecret + ": the Secret is applied again, the hand edit stays", s.c.k14HandEdit},
		{"an upgrade through the ConfigMap (the pod templates' " + RevisionAnnotation + " 2) and ApplyOnce's source changed: the workloads roll, the hand edit is overwritten, ApplyOnce's object stays", s.c.k14Upgrade},
		{"a claim and its writer on the driver the set delivered and upgraded: Ready", s.k14Volume},
		{"the writer and its claim deleted", s.k14Cleanup},
	}
	for _, st := range steps {
		if err := s.step(sc, "cluster", st.name, func() (string, error) { return st.f(ctx) }); err != nil {
			return err
		}
	}
	return nil
}

// removeAddon deletes what InstallAddon applied and waits until the
// namespace, the CSIDriver and the add-on's pods are gone. It records,
// without judging, what the CSINodes still list: the kubelet drops a
// driver when its registration socket goes.
func (c cluster) removeAddon(ctx context.Context) (string, error) {
	bundle, _, err := c.CoreBundle(ctx)
	if err != nil {
		return "", err
	}
	if bundle, err = k8s.InsecureController(bundle); err != nil {
		return "", err
	}
	out, err := c.KubectlInput(ctx, bytes.NewReader(bundle), "delete", "--ignore-not-found", "--wait=true", "--timeout=5m", "-f", "-")
	if err != nil {
		return out, err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, "namespace "+k8s.AddonNamespace+" and CSIDriver "+simlab.DriverName+" gone", func() (bool, string, error) {
		got, err := c.Kubectl(ctx, "get", "namespace/"+k8s.AddonNamespace, "csidriver/"+simlab.DriverName, "--ignore-not-found", "-o", "name")
		return err == nil && strings.TrimSpace(got) == "", got, nil
	}); err != nil {
		return "", err
	}
	csinodes, _ := c.Kubectl(ctx, "get", "csinode", "-o", `jsonpath={range .items[*]}{.metadata.name}: [{.spec.drivers[*].name}] {end}`)
	return fmt.Sprintf("%d objects deleted; namespace, Secret, CSIDriver and pods gone; CSINodes now: %s",
		strings.Count(out, "\n"), strings.TrimSpace(csinodes)), nil
}

// k14Manager builds (or takes from the cache) Cluster API's core manager
// and starts it (StartCAPI).
func (c cluster) k14Manager(ctx context.Context) (string, error) {
	start := time.Now()
	m, err := capi.Build(ctx, lab.DefaultCacheDir(), c.Opts.Log)
	if err != nil {
		return "", err
	}
	built := time.Since(start).Round(time.Second)
	got, err := c.StartCAPI(ctx, m)
	return fmt.Sprintf("%s (build or cache: %s)", got, built), err
}

// k14Wrap creates K14's objects on the management cluster: the add-on's
// ConfigMap with kubectl create from the rendered file (not a
// client-side apply, which would store a second copy in an annotation),
// the workload cluster's kubeconfig Secret, then crsObjects.
func (c cluster) k14Wrap(ctx context.Context) (string, error) {
	bundle, err := crsBundle()
	if err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "create", "namespace", MgmtNamespace); err != nil {
		return "", err
	}
	if err := c.putAddonConfigMap(ctx, bundle, "create"); err != nil {
		return "", err
	}
	kc, err := c.WorkloadKubeconfigSecret(CRSClusterName, MgmtNamespace)
	if err != nil {
		return "", err
	}
	if _, err := c.KubectlInput(ctx, strings.NewReader(kc+"---\n"+crsObjects("1")), "apply", "-f", "-"); err != nil {
		return "", err
	}
	stored, err := c.Kubectl(ctx, "-n", MgmtNamespace, "get", "configmap", AddonConfigMap, "-o", "json")
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("csi.yaml rendered by deploy.Render: %d bytes (%.1f%% of the %d a ConfigMap may hold); the stored ConfigMap is %d bytes of JSON",
		len(bundle), 100*float64(len(bundle))/ConfigMapLimit, ConfigMapLimit, len(stored)), nil
}

// putAddonConfigMap writes bundle as the add-on's ConfigMap with kubectl
// verb (create, or replace for an upgrade).
func (c cluster) putAddonConfigMap(ctx context.Context, bundle []byte, verb string) error {
	f := filepath.Join(c.Env.Lab.Dir(), "capi", AddonKey)
	if err := os.WriteFile(f, bundle, 0o644); err != nil {
		return err
	}
	cm, err := c.Kubectl(ctx, "-n", MgmtNamespace, "create", "configmap", AddonConfigMap, "--from-file="+AddonKey+"="+f, "--dry-run=client", "-o", "yaml")
	if err != nil {
		return err
	}
	_, err = c.KubectlInput(ctx, strings.NewReader(cm), verb, "-f", "-")
	return err
}

// k14Delivered waits for the Cluster's infrastructure to count as
// provisioned, for the binding to record both of the set's resources
// applied, and for the driver to run, and names who wrote the objects.
func (c cluster) k14Delivered(ctx context.Context) (string, error) {
	start := time.Now()
	if err := k8s.WaitFor(ctx, 3*time.Minute, "Cluster "+CRSClusterName+"'s infrastructure provisioned", func() (bool, string, error) {
		got, err := c.Kubectl(ctx, "-n", MgmtNamespace, "get", "cluster", CRSClusterName, "-o", "jsonpath={.status.initialization.infrastructureProvisioned}")
		return err == nil && got == "true", got, nil
	}); err != nil {
		return "", c.withManagerLog(err)
	}
	if err := c.waitApplied(ctx, AddonCRS, 2); err != nil {
		return "", err
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
	managers, err := c.managersOf(ctx)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("binding applied after %s, driver running after %s; objects written by %s", applied, time.Since(start).Round(time.Second), managers), nil
}

// waitApplied waits until the Cluster's ClusterResourceSetBinding records
// n resources of the set crs applied.
func (c cluster) waitApplied(ctx context.Context, crs string, n int) error {
	path := fmt.Sprintf(`jsonpath={.spec.bindings[?(@.clusterResourceSetName=="%s")].resources[*].applied}`, crs)
	err := k8s.WaitFor(ctx, 5*time.Minute, fmt.Sprintf("%d resources of %s applied to %s", n, crs, CRSClusterName), func() (bool, string, error) {
		got, err := c.Kubectl(ctx, "-n", MgmtNamespace, "get", "clusterresourcesetbinding", CRSClusterName, "--ignore-not-found", "-o", path)
		return err == nil && strings.Count(got, "true") == n, got, nil
	})
	return c.withManagerLog(err)
}

// waitCSINodes waits until every worker's CSINode lists the driver.
func (c cluster) waitCSINodes(ctx context.Context) error {
	nodes, err := c.Nodes(ctx)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		if err := k8s.WaitFor(ctx, 3*time.Minute, "CSINode "+n+" lists "+simlab.DriverName, func() (bool, string, error) {
			got, err := c.Kubectl(ctx, "get", "csinode", n, "-o", "jsonpath={.spec.drivers[*].name}")
			return err == nil && strings.Contains(" "+got+" ", " "+simlab.DriverName+" "), got, nil
		}); err != nil {
			return c.PodsState(ctx, err)
		}
	}
	return nil
}

// managersOf lists the field managers of the add-on's workloads and
// Secret, and fails if kubectl is one of them.
func (c cluster) managersOf(ctx context.Context) (string, error) {
	seen := map[string]bool{}
	var names []string
	for _, o := range []string{"deployment/" + k8s.ControllerName, "daemonset/" + k8s.NodeName, "secret/csi-driver-secret"} {
		got, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", o, "-o", "jsonpath={.metadata.managedFields[*].manager}")
		if err != nil {
			return "", err
		}
		for _, m := range strings.Fields(got) {
			if strings.HasPrefix(m, "kubectl") {
				return "", fmt.Errorf("%s was written by %s", o, m)
			}
			if !seen[m] {
				seen[m] = true
				names = append(names, m)
			}
		}
	}
	return strings.Join(names, ", "), nil
}

// withManagerLog adds the end of the manager's log to err.
func (c cluster) withManagerLog(err error) error {
	if err == nil {
		return nil
	}
	b, _ := os.ReadFile(filepath.Join(c.Env.Lab.Dir(), "capi", "manager.log"))
	return fmt.Errorf("%w\nCluster API manager's log:\n%s", err, lab.LastLines(string(b), 25))
}
