package story

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/whitesky-cloud/vco-storage/deploy"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
)

// The add-on as CAPVCO wraps it for a ClusterResourceSet (K14), on the
// management cluster, in MgmtNamespace.
const (
	// MgmtNamespace holds K14's Cluster API objects.
	MgmtNamespace = "vco-lab-mgmt"
	// CRSClusterName is K14's Cluster: the lab's cluster itself.
	CRSClusterName = "lab"
	// CSILabel is the label CAPVCO's ClusterResourceSet selects
	// clusters by.
	CSILabel = "capvco.infrastructure.cluster.x-k8s.io/csi"
	// AddonConfigMap holds csi.yaml, rendered, under AddonKey.
	AddonConfigMap = "vco-csi-addon"
	AddonKey       = "csi.yaml"
	// CredentialSecret holds the Secret csi-driver-secret's manifest,
	// under CredentialKey, in a Secret of type ResourceSetSecretType.
	CredentialSecret = "vco-csi-driver-secret"
	CredentialKey    = "csi-driver-secret.yaml"
	// ResourceSetSecretType is the only Secret type a ClusterResourceSet
	// applies.
	ResourceSetSecretType = "addons.cluster.x-k8s.io/resource-set"
	// AddonCRS delivers the add-on with strategy Reconcile; OnceCRS
	// delivers OnceObject with ApplyOnce.
	AddonCRS = "vco-csi"
	OnceCRS  = "k14-once"
	// OnceObject is ApplyOnce's ConfigMap in the workload cluster's
	// namespace default.
	OnceObject = "k14-delivered-once"
	// ConfigMapLimit is the most a ConfigMap's values may hold together
	// (the API server's validation: 1 MiB).
	ConfigMapLimit = 1 << 20
	// RevisionAnnotation is the pod-template annotation K14's upgrade
	// changes in the add-on.
	RevisionAnnotation = "vco.whitesky.cloud/addon-revision"
)

// crsBundle is csi.yaml rendered as CAPVCO renders it (deploy.Render,
// what envsubst restricted to the two placeholders does) with the lab's
// one edit (insecureController).
func crsBundle() ([]byte, error) {
	tmpl, err := os.ReadFile(filepath.Join(srctree.Root(), "deploy", "csi.yaml"))
	if err != nil {
		return nil, err
	}
	out, err := deploy.Render(tmpl, deploy.Values{Image: k8s.Image, DriverName: simlab.DriverName})
	if err != nil {
		return nil, err
	}
	return k8s.InsecureController(out)
}

// withRevision sets RevisionAnnotation to rev on the pod template of every
// Deployment and DaemonSet of bundle (a YAML stream of documents
// separated by "---" lines) and leaves the other documents as they are.
// It is K14's upgrade of the add-on: a change each workload's pods roll
// for. It refuses a bundle with no such workload.
func withRevision(bundle []byte, rev string) ([]byte, error) {
	docs := bytes.Split(bundle, []byte("\n---\n"))
	n := 0
	for i, doc := range docs {
		var obj map[string]any
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			return nil, fmt.Errorf("document %d of the add-on: %w", i+1, err)
		}
		if k := obj["kind"]; k != "Deployment" && k != "DaemonSet" {
			continue
		}
		tmpl, ok := dig(obj, "spec", "template", "metadata")
		if !ok {
			return nil, fmt.Errorf("document %d of the add-on: a %s without spec.template.metadata", i+1, obj["kind"])
		}
		ann, _ := tmpl["annotations"].(map[string]any)
		if ann == nil {
			ann = map[string]any{}
		}
		ann[RevisionAnnotation] = rev
		tmpl["annotations"] = ann
		out, err := yaml.Marshal(obj)
		if err != nil {
			return nil, err
		}
		if !bytes.HasSuffix(doc, []byte("\n")) {
			out = bytes.TrimSuffix(out, []byte("\n"))
		}
		docs[i] = out
		n++
	}
	if n == 0 {
		return nil, fmt.Errorf("the add-on has no Deployment or DaemonSet to annotate")
	}
	return bytes.Join(docs, []byte("\n---\n")), nil
}

// dig follows keys through nested maps to a map.
func dig(m map[string]any, keys ...string) (map[string]any, bool) {
	for _, k := range keys {
		next, ok := m[k].(map[string]any)
		if !ok {
			return nil, false
		}
		m = next
	}
	return m, true
}
