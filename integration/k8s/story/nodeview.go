package story

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"path"
	"regexp"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// neighbour is a pod on the node plugin's node with a Secret volume and
// the ServiceAccount token Kubernetes projects into every pod.
func neighbour(node, secret string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata:
  name: k1-neighbour
stringData:
  secret: %[2]s
---
apiVersion: v1
kind: Pod
metadata:
  name: k1-neighbour
  labels: {app: k1-neighbour}
spec:
  nodeName: %[1]s
  terminationGracePeriodSeconds: 2
  containers:
    - name: sleeper
      image: %[3]s
      command: ["sleep", "1000000"]
      volumeMounts:
        - {name: secret, mountPath: /secret, readOnly: true}
  volumes:
    - name: secret
      secret: {secretName: k1-neighbour}
`, node, secret, WorkloadImage)
}

// nodeSecrets lists, as the node's root sees them, what the node plugin
// must not read: the neighbour's Secret and token volumes and the
// kubelet's keys (its client credentials, here in its kubeconfig, and the
// files of its pki/). Each is checked to be there and readable by root,
// so that a refusal later means the container, not the file's absence.
func nodeSecrets(ctx context.Context, g *lab.Guest, uid string) ([]string, error) {
	pod := "/var/lib/kubelet/pods/" + uid + "/volumes"
	out, err := g.MustSh(ctx, fmt.Sprintf(`set -e
ls -d %[1]s/kubernetes.io~secret/secret/secret %[1]s/kubernetes.io~projected/kube-api-access-*/token /etc/kubernetes/kubelet.kubeconfig
find /var/lib/kubelet/pki -type f`, pod))
	if err != nil {
		return nil, err
	}
	files := strings.Fields(out)
	for _, f := range files {
		if _, err := g.MustSh(ctx, "head -c 1 "+f+" >/dev/null"); err != nil {
			return nil, fmt.Errorf("root on %s cannot read %s either: %w", g.Name, f, err)
		}
	}
	if len(files) < 4 {
		return nil, fmt.Errorf("on %s, found only %v of the neighbour's Secret and token and the kubelet's keys", g.Name, files)
	}
	return files, nil
}

// refused matches what busybox says when a file is not there or not
// readable.
var refused = regexp.MustCompile(`No such file or directory|Permission denied`)

// k1NodeView proves what the node plugin's container can see (docs/
// security.md, "The node container"): from inside the running container
// on node, as the container's own user, it tries to read a neighbour pod's
// Secret and ServiceAccount token volumes and the kubelet's keys, by
// their host paths and through /proc/1/root, and each is refused.
func (s *story) k1NodeView(ctx context.Context, node string) (string, error) {
	c := s.c
	g := c.Env.Lab.Guest(node)
	if g == nil {
		return "", fmt.Errorf("%s is not a lab worker", node)
	}
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	secret := "k1-neighbour-" + hex.EncodeToString(b)
	if err := s.apply(ctx, neighbour(node, secret)); err != nil {
		return "", err
	}
	defer func() {
		ctx := context.WithoutCancel(ctx)
		c.Kubectl(ctx, "-n", Namespace, "delete", "pod,secret", "k1-neighbour", "--wait=false")
	}()
	ps, err := s.waitPods(ctx, "app=k1-neighbour", 5*time.Minute, "pod k1-neighbour Ready", allReady(1))
	if err != nil {
		return "", err
	}
	files, err := nodeSecrets(ctx, g, ps[0].UID)
	if err != nil {
		return "", err
	}
	plugin, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", "app.kubernetes.io/name="+k8s.NodeName,
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[0].metadata.name}")
	if err != nil || plugin == "" {
		return "", fmt.Errorf("no node plugin pod on %s: %v", node, err)
	}
	driver, err := c.Kubectl(ctx, "get", "storageclass", "vco-csi", "-o", "jsonpath={.provisioner}")
	if err != nil {
		return "", err
	}
	// The plugin's socket directory, /csi in its container; named busybox,
	// as busybox takes its applet from the next argument only then.
	bb := path.Join("/var/lib/kubelet/plugins", driver, "busybox")
	if _, err := g.MustSh(ctx, fmt.Sprintf("cp %s %s && chmod 0755 %s", k8s.GuestBusybox, bb, bb)); err != nil {
		return "", err
	}
	defer g.MustSh(context.WithoutCancel(ctx), "rm -f "+bb)
	run := func(args ...string) (string, error) {
		out, err := c.Kubectl(ctx, append([]string{"-n", k8s.AddonNamespace, "exec", plugin, "-c", "vco-csi", "--", "/csi/busybox"}, args...)...)
		if err != nil {
			return out + err.Error(), err
		}
		return out, nil
	}
	id, err := run("id")
	if err != nil || !strings.Contains(id, "uid=65532") || !strings.Contains(id, "573") {
		return "", fmt.Errorf("the node plugin's container runs as %q (%v), want uid 65532 with the vco-agent gid 573", strings.TrimSpace(id), err)
	}
	lines, err := tryReads(run, files, secret)
	if err != nil {
		return "", err
	}
	ls, _ := run("ls", "/var/lib/kubelet")
	return strings.Join(append(append([]string{"in " + plugin + ": " + strings.TrimSpace(id)}, lines...),
		"ls /var/lib/kubelet: "+strings.TrimSpace(lab.LastLines(ls, 1))), "\n"), nil
}

// tryReads reads each file with run (busybox in the node plugin's
// container), by its path and through /proc/1/root, and wants every read
// refused for the file's absence or its permissions, with nothing of it
// (the neighbour's secret, a key) in the answer.
func tryReads(run func(...string) (string, error), files []string, secret string) ([]string, error) {
	var lines []string
	for _, f := range files {
		for _, p := range []string{f, "/proc/1/root" + f} {
			out, err := run("cat", p)
			switch {
			case err == nil || strings.Contains(out, secret) || strings.Contains(out, "PRIVATE KEY") || strings.Contains(out, "client-key-data"):
				return nil, fmt.Errorf("the node plugin's container read %s: %q", p, lab.LastLines(out, 3))
			case !refused.MatchString(out):
				return nil, fmt.Errorf("reading %s in the node plugin's container failed for another reason than its absence: %s", p, out)
			}
			lines = append(lines, p+": "+refused.FindString(out))
		}
	}
	return lines, nil
}
