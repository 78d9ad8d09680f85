package k8s

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
)

// The add-on's names, as deploy/manifests give them.
const (
	AddonNamespace = "csi-driver"
	ControllerName = "vco-csi-controller"
	NodeName       = "vco-csi-node"
)

// repoRoot is the source tree (srctree.Root).
func repoRoot() string { return srctree.Root() }

// The two ways seed 001 gives operators to apply the add-on's core bundle
// (Options.Addon).
const (
	// AddonMake: `make csi-addon VCO_CSI_IMAGE=<image> | kubectl apply -f -`.
	AddonMake = "make"
	// AddonRelease: `envsubst '$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME' <
	// csi.yaml | kubectl apply -f -`, the release's file.
	AddonRelease = "release"
)

// InstallAddon does what seed 001 tells an operator: the Secret
// csi-driver-secret (here pointing at the simulator the workers reach on
// HostInGuest), then the core bundle, applied the way Options.Addon
// names, with the controller given --insecure-allow-http (InsecureController);
// and waits until the controller is available, the node plugin runs on
// every worker and each worker's CSINode lists the driver.
func (c *Cluster) InstallAddon(ctx context.Context) (string, error) {
	secret := fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n---\n", AddonNamespace) + CredentialManifest()
	if _, err := c.KubectlInput(ctx, strings.NewReader(secret), "apply", "-f", "-"); err != nil {
		return "", err
	}
	bundle, how, err := c.CoreBundle(ctx)
	if err != nil {
		return "", err
	}
	if bundle, err = InsecureController(bundle); err != nil {
		return "", err
	}
	out, err := c.KubectlInput(ctx, bytes.NewReader(bundle), "apply", "-f", "-")
	if err != nil {
		return out, err
	}
	applied := strings.Count(out, "\n")
	for _, r := range []string{"deployment/" + ControllerName, "daemonset/" + NodeName} {
		if _, err := c.Kubectl(ctx, "-n", AddonNamespace, "rollout", "status", r, "--timeout=10m"); err != nil {
			return out, c.PodsState(ctx, err)
		}
	}
	nodes, err := c.Nodes(ctx)
	if err != nil {
		return out, err
	}
	for _, n := range nodes {
		if err := WaitFor(ctx, 3*time.Minute, "CSINode "+n+" lists "+simlab.DriverName, func() (bool, string, error) {
			got, err := c.Kubectl(ctx, "get", "csinode", n, "-o", "jsonpath={.spec.drivers[*].name}")
			return err == nil && strings.Contains(" "+got+" ", " "+simlab.DriverName+" "), got, nil
		}); err != nil {
			return out, c.PodsState(ctx, err)
		}
	}
	return fmt.Sprintf("%d objects applied from %s; controller available, node plugin on %d workers, CSINodes list %s",
		applied, how, len(nodes), simlab.DriverName), nil
}

// controllerMode is the controller container's --mode argument in the
// core bundle, with its indentation.
var controllerMode = regexp.MustCompile(`(?m)^([ \t]*- )--mode=controller\n`)

// insecureController adds --insecure-allow-http to the controller's
// arguments in bundle. The Secret's url is the simulator's plain http
// address at HostInGuest, which the controller refuses otherwise; the
// simulator serves no TLS, and HostInGuest is QEMU's user network, whose
// forward ends at the host's 127.0.0.1, so the JWT does not travel on a
// real network.
func InsecureController(bundle []byte) ([]byte, error) {
	if n := len(controllerMode.FindAll(bundle, -1)); n != 1 {
		return nil, fmt.Errorf("the core bundle has %d controller arguments --mode=controller, want 1, to add %s after", n, cleartext.Option)
	}
	return controllerMode.ReplaceAll(bundle, []byte("${0}${1}"+cleartext.Option+"\n")), nil
}

// CoreBundle renders the add-on's core bundle the way c.Opts.Addon names,
// and says how.
func (c *Cluster) CoreBundle(ctx context.Context) (bundle []byte, how string, err error) {
	var cmd *exec.Cmd
	switch c.Opts.Addon {
	case "", AddonMake:
		how = "make csi-addon VCO_CSI_IMAGE=" + Image
		cmd = exec.CommandContext(ctx, "make", "-s", "-C", repoRoot(), "csi-addon", "VCO_CSI_IMAGE="+Image,
			"ADDON_DIR="+filepath.Join(c.Env.Lab.Dir(), "addon"))
	case AddonRelease:
		how = "envsubst '$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME' < deploy/csi.yaml"
		f, err := os.Open(filepath.Join(repoRoot(), "deploy", "csi.yaml"))
		if err != nil {
			return nil, "", err
		}
		defer f.Close()
		cmd = exec.CommandContext(ctx, "envsubst", "$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME")
		cmd.Stdin = f
		cmd.Env = append(os.Environ(), "VCO_CSI_IMAGE="+Image, "VCO_CSI_DRIVER_NAME="+simlab.DriverName)
	default:
		return nil, "", fmt.Errorf("the add-on's core bundle: unknown way %q (want %s or %s)", c.Opts.Addon, AddonMake, AddonRelease)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if bundle, err = cmd.Output(); err != nil {
		return nil, "", fmt.Errorf("%s: %w: %s", how, err, stderr.String())
	}
	return bundle, how, nil
}

// Nodes lists the cluster's node names.
func (c *Cluster) Nodes(ctx context.Context) ([]string, error) {
	out, err := c.Kubectl(ctx, "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
	return strings.Fields(out), err
}

// PodsState adds the add-on's pods and their recent events to err.
func (c *Cluster) PodsState(ctx context.Context, err error) error {
	pods, _ := c.Kubectl(ctx, "-n", AddonNamespace, "get", "pods", "-o", "wide")
	ev, _ := c.Kubectl(ctx, "-n", AddonNamespace, "get", "events", "--sort-by=.lastTimestamp")
	return fmt.Errorf("%w\npods:\n%s\nevents:\n%s", err, pods, lab.LastLines(ev, 25))
}

// CredentialManifest is the Secret csi-driver-secret that InstallAddon
// applies, as a manifest for a ClusterResourceSet's Secret.
func CredentialManifest() string {
	return fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata:
  name: csi-driver-secret
  namespace: %s
type: Opaque
stringData:
  url: http://%s:%d
  customer: %s
  cloudspace: cs-%s
  jwt: %s
`, AddonNamespace, HostInGuest, GuestCloudPort, simlab.Customer, simlab.Location, simlab.Token)
}

// Envsubst renders a release file of the repository as the release
// instructions do: envsubst '$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME'.
func Envsubst(ctx context.Context, file string) (string, error) {
	f, err := os.Open(repoRoot() + "/" + file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	cmd := exec.CommandContext(ctx, "envsubst", "$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME")
	cmd.Stdin = f
	cmd.Env = append(os.Environ(), "VCO_CSI_IMAGE="+Image, "VCO_CSI_DRIVER_NAME="+simlab.DriverName)
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("envsubst < %s: %w", file, err)
	}
	return string(out), nil
}
