package k8s

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/capi"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// K14's management cluster is the lab's own control plane: Cluster API's
// CRDs installed with kubectl, its core manager run as a lab process on
// the control plane's host (as kube-controller-manager is), and a Cluster
// whose kubeconfig Secret points back at the same API server, so the lab
// cluster is its own workload cluster.

// StartCAPI installs the release's CRDs and starts the core manager with
// a client certificate of its own and its webhook server on a
// certificate of the lab's CA; it returns once the manager is ready.
func (c *Cluster) StartCAPI(ctx context.Context, m capi.Manager) (string, error) {
	crds, err := m.CRDs()
	if err != nil {
		return "", err
	}
	for _, f := range crds {
		// Server-side: the largest CRDs are over the 256 KiB of
		// annotations a client-side apply would add a copy to.
		if _, err := c.Kubectl(ctx, "apply", "--server-side", "-f", f); err != nil {
			return "", err
		}
	}
	if _, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/clusters.cluster.x-k8s.io", "crd/clusterresourcesets.addons.cluster.x-k8s.io",
		"crd/clusterresourcesetbindings.addons.cluster.x-k8s.io"); err != nil {
		return "", err
	}
	p := c.cp.pki
	if err := p.issue("capi-manager", "capi-manager", []string{"system:masters"}); err != nil {
		return "", err
	}
	if err := p.issue("capi-webhook", "capi-webhook", nil, "127.0.0.1", "localhost"); err != nil {
		return "", err
	}
	kc, err := p.kubeconfig("capi-manager", c.apiServer())
	if err != nil {
		return "", err
	}
	dir := filepath.Join(c.Env.Lab.Dir(), "capi")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	kcPath := filepath.Join(dir, "manager.kubeconfig")
	if err := os.WriteFile(kcPath, []byte(kc), 0o600); err != nil {
		return "", err
	}
	health, err := c.spawnManager(m, dir, kcPath)
	if err != nil {
		return "", err
	}
	logPath := filepath.Join(dir, "manager.log")
	if err := WaitFor(ctx, 2*time.Minute, "Cluster API's manager ready on "+health, func() (bool, string, error) {
		return managerReady(ctx, health)
	}); err != nil {
		b, _ := os.ReadFile(logPath)
		return "", fmt.Errorf("%w\nmanager's log:\n%s", err, lab.LastLines(string(b), 30))
	}
	return fmt.Sprintf("Cluster API %s: %d CRDs applied server-side; core manager %s ready (webhooks on a lab certificate, log %s)",
		capi.Version, len(crds), m.Bin, logPath), nil
}

// spawnManager starts the manager as the lab process capi-manager and
// returns its health endpoint's address.
func (c *Cluster) spawnManager(m capi.Manager, dir, kubeconfig string) (string, error) {
	var ports [2]int
	for i := range ports {
		p, err := lab.FreePort()
		if err != nil {
			return "", err
		}
		ports[i] = p
	}
	health := "127.0.0.1:" + strconv.Itoa(ports[0])
	logf, err := os.Create(filepath.Join(dir, "manager.log"))
	if err != nil {
		return "", err
	}
	defer logf.Close()
	cmd := exec.Command(m.Bin, "--kubeconfig", kubeconfig,
		"--health-addr", health, "--diagnostics-address", "0",
		"--webhook-port", strconv.Itoa(ports[1]), "--webhook-cert-dir", filepath.Dir(c.cp.pki.path("ca.crt")),
		"--webhook-cert-name", "capi-webhook.crt", "--webhook-key-name", "capi-webhook.key")
	cmd.Stdout, cmd.Stderr = logf, logf
	if _, err := c.Env.Lab.Spawn("capi-manager", cmd); err != nil {
		return "", fmt.Errorf("starting Cluster API's manager: %w", err)
	}
	return health, nil
}

// managerReady asks the manager's /readyz.
func managerReady(ctx context.Context, addr string) (bool, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/readyz", nil)
	if err != nil {
		return false, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false, err.Error(), nil
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK, resp.Status, nil
}

// apiServer is the API server's URL on the host.
func (c *Cluster) apiServer() string { return "https://127.0.0.1:" + strconv.Itoa(c.cp.apiPort) }

// WorkloadKubeconfigSecret is the Secret <name>-kubeconfig in namespace
// that Cluster API
// reads a workload cluster's kubeconfig from (key value, type
// cluster.x-k8s.io/secret), here a client certificate of its own for the
// lab's API server.
func (c *Cluster) WorkloadKubeconfigSecret(name, namespace string) (string, error) {
	const user = "capi-workload-lab"
	if err := c.cp.pki.issue(user, user, []string{"system:masters"}); err != nil {
		return "", err
	}
	kc, err := c.cp.pki.kubeconfig(user, c.apiServer())
	if err != nil {
		return "", err
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata:
  name: %[1]s-kubeconfig
  namespace: %[2]s
  labels: {cluster.x-k8s.io/cluster-name: %[1]s}
type: cluster.x-k8s.io/secret
data:
  value: %[3]s
`, name, namespace, base64.StdEncoding.EncodeToString([]byte(kc))), nil
}
