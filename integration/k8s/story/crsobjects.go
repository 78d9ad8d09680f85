package story

import (
	"fmt"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

// crsObjects are K14's Cluster, its ClusterResourceSets and their
// resources (besides the add-on's ConfigMap, created from its file). The
// Cluster has no infrastructure or control plane reference: Cluster API's
// Cluster controller then marks its infrastructure provisioned itself,
// which is all the ClusterCache waits for before it connects. Its spec
// must hold something (the CRD asks for one property at least): the
// services' range, which is the lab cluster's.
func crsObjects(onceRev string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata:
  name: %[3]s
  namespace: %[1]s
type: %[4]s
stringData:
  %[5]s: |
%[6]s---
apiVersion: addons.cluster.x-k8s.io/v1beta2
kind: ClusterResourceSet
metadata:
  name: %[7]s
  namespace: %[1]s
spec:
  strategy: Reconcile
  clusterSelector:
    matchLabels: {%[2]s: vco}
  resources:
    - {kind: ConfigMap, name: %[8]s}
    - {kind: Secret, name: %[3]s}
---
%[9]s---
apiVersion: addons.cluster.x-k8s.io/v1beta2
kind: ClusterResourceSet
metadata:
  name: %[10]s
  namespace: %[1]s
spec:
  strategy: ApplyOnce
  clusterSelector:
    matchLabels: {%[2]s: vco}
  resources:
    - {kind: ConfigMap, name: %[10]s}
---
apiVersion: cluster.x-k8s.io/v1beta2
kind: Cluster
metadata:
  name: %[11]s
  namespace: %[1]s
  labels: {%[2]s: vco}
spec:
  clusterNetwork:
    services: {cidrBlocks: [%[12]q]}
`, MgmtNamespace, CSILabel, CredentialSecret, ResourceSetSecretType, CredentialKey,
		indent(k8s.CredentialManifest(), "    "), AddonCRS, AddonConfigMap, onceSource(onceRev), OnceCRS, CRSClusterName, k8s.ServiceCIDR)
}

// onceSource is the ConfigMap OnceCRS applies: it holds OnceObject with
// data revision rev.
func onceSource(rev string) string {
	inner := fmt.Sprintf("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: %s, namespace: default}\ndata: {revision: %q}\n", OnceObject, rev)
	return fmt.Sprintf(`apiVersion: v1
kind: ConfigMap
metadata:
  name: %s
  namespace: %s
data:
  once.yaml: |
%s`, OnceCRS, MgmtNamespace, indent(inner, "    "))
}

// indent prefixes every non-empty line of s.
func indent(s, prefix string) string {
	lines := strings.SplitAfter(s, "\n")
	var b strings.Builder
	for _, l := range lines {
		if strings.TrimSpace(l) != "" {
			b.WriteString(prefix + l)
		}
	}
	return b.String()
}
