package k8s

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/k8s/images"
)

// InstallSnapshots installs external-snapshotter's CRDs and
// snapshot-controller as docs/csi-addon.md tells operators, and applies
// the add-on's snapshots part the release way (envsubst over
// deploy/csi-snapshots.yaml).
func (c *Cluster) InstallSnapshots(ctx context.Context) (string, error) {
	f, err := images.Snapshotter(ctx, filepath.Join(c.Opts.Lab.CacheDir, "k8s-images"))
	if err != nil {
		return "", err
	}
	for _, crd := range f.CRDs {
		if _, err := c.Kubectl(ctx, "apply", "-f", crd); err != nil {
			return "", err
		}
	}
	for _, crd := range []string{"volumesnapshots", "volumesnapshotcontents", "volumesnapshotclasses"} {
		if _, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+crd+".snapshot.storage.k8s.io"); err != nil {
			return "", err
		}
	}
	for _, m := range f.Controller {
		if _, err := c.Kubectl(ctx, "apply", "-f", m); err != nil {
			return "", err
		}
	}
	// The upstream Deployment names the release's image; the lab
	// serves the one it built from the same release under that name.
	if _, err := c.Kubectl(ctx, "-n", "kube-system", "set", "image", "deployment/snapshot-controller", "snapshot-controller="+f.Image); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deployment/snapshot-controller", "--timeout=5m"); err != nil {
		return "", c.PodsState(ctx, err)
	}
	rendered, err := Envsubst(ctx, "deploy/csi-snapshots.yaml")
	if err != nil {
		return "", err
	}
	out, err := c.KubectlInput(ctx, strings.NewReader(rendered), "apply", "-f", "-")
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%d CRDs, snapshot-controller %s; %s", len(f.CRDs), f.Image, strings.TrimSpace(out)), nil
}
