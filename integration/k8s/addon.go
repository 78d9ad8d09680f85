package k8s

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// The add-on's names, as deploy/manifests give them.
const (
	AddonNamespace = "csi-driver"
	ControllerName = "vco-csi-controller"
	NodeName       = "vco-csi-node"
)

// repoRoot is the source tree: this file's when it was compiled without
// -trimpath (go test), else the nearest directory at or above the
// working directory that holds integration/k8s/build (make runs vco-lab
// from the repository's root).
func repoRoot() string {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		return filepath.Join(filepath.Dir(file), "..", "..")
	}
	dir, err := os.Getwd()
	if err != nil {
		return "."
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "integration", "k8s", "build", "go.mod")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}

// InstallAddon does what seed 001 tells an operator: the Secret
// csi-driver-secret (here pointing at the simulator the workers reach on
// HostInGuest), then `make csi-addon VCO_CSI_IMAGE=<image> | kubectl
// apply -f -`; and waits until the controller is available, the node
// plugin runs on every worker and each worker's CSINode lists the driver.
func (c *Cluster) InstallAddon(ctx context.Context) (string, error) {
	secret := fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: %[1]s
---
apiVersion: v1
kind: Secret
metadata:
  name: csi-driver-secret
  namespace: %[1]s
type: Opaque
stringData:
  url: http://%[2]s:%[3]d
  customer: %[4]s
  cloudspace: cs-%[5]s
  jwt: %[6]s
`, AddonNamespace, HostInGuest, GuestCloudPort, simlab.Customer, simlab.Location, simlab.Token)
	if _, err := c.KubectlInput(ctx, strings.NewReader(secret), "apply", "-f", "-"); err != nil {
		return "", err
	}
	make := exec.CommandContext(ctx, "make", "-s", "-C", repoRoot(), "csi-addon", "VCO_CSI_IMAGE="+Image,
		"ADDON_DIR="+filepath.Join(c.Env.Lab.Dir(), "addon"))
	var stderr bytes.Buffer
	make.Stderr = &stderr
	bundle, err := make.Output()
	if err != nil {
		return "", fmt.Errorf("make csi-addon: %w: %s", err, stderr.String())
	}
	out, err := c.KubectlInput(ctx, bytes.NewReader(bundle), "apply", "-f", "-")
	if err != nil {
		return out, err
	}
	applied := strings.Count(out, "\n")
	for _, r := range []string{"deployment/" + ControllerName, "daemonset/" + NodeName} {
		if _, err := c.Kubectl(ctx, "-n", AddonNamespace, "rollout", "status", r, "--timeout=10m"); err != nil {
			return out, c.podsState(ctx, err)
		}
	}
	nodes, err := c.Nodes(ctx)
	if err != nil {
		return out, err
	}
	for _, n := range nodes {
		if err := waitFor(ctx, 3*time.Minute, "CSINode "+n+" lists "+simlab.DriverName, func() (bool, string, error) {
			got, err := c.Kubectl(ctx, "get", "csinode", n, "-o", "jsonpath={.spec.drivers[*].name}")
			return err == nil && strings.Contains(" "+got+" ", " "+simlab.DriverName+" "), got, nil
		}); err != nil {
			return out, c.podsState(ctx, err)
		}
	}
	return fmt.Sprintf("%d objects applied from make csi-addon; controller available, node plugin on %d workers, CSINodes list %s",
		applied, len(nodes), simlab.DriverName), nil
}

// Nodes lists the cluster's node names.
func (c *Cluster) Nodes(ctx context.Context) ([]string, error) {
	out, err := c.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
	return strings.Fields(out), err
}

// podsState adds the add-on's pods and their recent events to err.
func (c *Cluster) podsState(ctx context.Context, err error) error {
	pods, _ := c.Kubectl(ctx, "-n", AddonNamespace, "get", "pods", "-o", "wide")
	ev, _ := c.Kubectl(ctx, "-n", AddonNamespace, "get", "events", "--sort-by=.lastTimestamp")
	return fmt.Errorf("%w\npods:\n%s\nevents:\n%s", err, pods, lab.LastLines(ev, 25))
}
