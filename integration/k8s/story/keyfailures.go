package story

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

// k7Refusals: a new claim of the encrypted class meets its key backend
// failing three ways in turn: the role no longer binding the node
// plugin's ServiceAccount (the node plugins restarted, so they log in
// anew), the server stopped, the server started again and sealed. Each
// failure is named in the pod's events with what to do, and no
// passphrase is wrapped, so nothing is written to the disk; once the
// server is unsealed and the role restored, the kubelet's retry stages
// the volume and the pod starts.
func (s *story) k7Refusals(ctx context.Context, sc string) (string, error) {
	c, kb := s.c, s.c.KeyBackend
	role, err := kb.RecipeCommand("bao write auth/" + k8s.AuthMount + "/role/" + k8s.TransitRole)
	if err != nil {
		return "", err
	}
	const bound = "bound_service_account_names=" + k8s.NodeName
	if !strings.Contains(role, bound) {
		return "", fmt.Errorf("the recipe's role command does not say %s:\n%s", bound, role)
	}
	if _, err := c.OperatorSh(ctx, kb, strings.Replace(role, bound, "bound_service_account_names=someone-else", 1)); err != nil {
		return "", err
	}
	for _, args := range [][]string{{"rollout", "restart", "daemonset/" + k8s.NodeName}, {"rollout", "status", "daemonset/" + k8s.NodeName, "--timeout=5m"}} {
		if _, err := c.Kubectl(ctx, append([]string{"-n", k8s.AddonNamespace}, args...)...); err != nil {
			return "", err
		}
	}
	wraps, err := kb.Answered(k8s.TransitMount + "/encrypt/" + k8s.TransitKey)
	if err != nil {
		return "", err
	}
	if err := s.applyWriter(ctx, "k7f", encryptedClaim("k7f")); err != nil {
		return "", err
	}
	var seen []string
	for _, phase := range []struct {
		what, says string
		do         func() error
	}{
		{"the role binds another ServiceAccount", "refused the node plugin's login", func() error { return nil }},
		{"the server stopped", "did not answer", func() error { kb.Srv.Stop(); return nil }},
		{"the server started again, sealed", "the key backend is sealed", func() error { return kb.Srv.Restart(ctx) }},
	} {
		if err := phase.do(); err != nil {
			return "", err
		}
		msg, err := s.waitPodEvent(ctx, "app=k7f", phase.says)
		if err != nil {
			return "", fmt.Errorf("%s: %w", phase.what, err)
		}
		seen = append(seen, phase.what+": "+msg)
	}
	now, err := kb.Answered(k8s.TransitMount + "/encrypt/" + k8s.TransitKey)
	if err != nil {
		return "", err
	}
	s.check(e2e.P5, sc, now == wraps, "K7: no passphrase wrapped, so nothing written, while the key backend refused (%d wraps before, %d after)", wraps, now)
	if now != wraps {
		return "", fmt.Errorf("the key backend's audit log counts %d wraps, %d before the refusals: a passphrase was wrapped while the key backend refused", now, wraps)
	}
	if err := kb.Srv.Unseal(ctx, kb.Key); err != nil {
		return "", err
	}
	if _, err := c.OperatorSh(ctx, kb, role); err != nil {
		return "", err
	}
	ps, err := s.waitPods(ctx, "app=k7f", 10*time.Minute, "k7f Ready once the key backend is back", allReady(1))
	if err != nil {
		return "", err
	}
	for _, args := range [][]string{{"delete", "deployment", "k7f", "--wait=true"}, {"delete", "pvc", "k7f", "--wait=false"}} {
		if _, err := c.Kubectl(ctx, append([]string{"-n", Namespace}, args...)...); err != nil {
			return "", err
		}
	}
	return strings.Join(seen, "\n") + fmt.Sprintf("\n%s Ready on %s once unsealed and the role restored", ps[0].Name, ps[0].Node), nil
}

// encryptedClaim is a claim of the encrypted class.
func encryptedClaim(name string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: %s
spec:
  storageClassName: vco-csi-encrypted-vault
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
`, name)
}

// waitPodEvent waits up to five minutes (the kubelet's retries back off
// to two) for an Event of a pod of selector whose message holds says, and
// returns that message.
func (s *story) waitPodEvent(ctx context.Context, selector, says string) (string, error) {
	var msg string
	err := k8s.WaitFor(ctx, 5*time.Minute, "an Event saying "+says, func() (bool, string, error) {
		ps, err := s.pods(ctx, selector)
		if err != nil || len(ps) == 0 {
			return false, fmt.Sprintf("no pod of %s (%v)", selector, err), nil
		}
		out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "events", "--field-selector", "involvedObject.name="+ps[0].Name, "-o", "json")
		if err != nil {
			return false, err.Error(), nil
		}
		var list struct{ Items []eventItem }
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return false, err.Error(), nil
		}
		last := ""
		for _, it := range list.Items {
			if strings.Contains(it.Message, says) {
				msg = it.Message
				return true, "", nil
			}
			last = it.Message
		}
		return false, fmt.Sprintf("%d events of %s, the last: %s", len(list.Items), ps[0].Name, last), nil
	})
	return msg, err
}

// k7OtherCluster: the recipe followed for a second cluster on the same
// server gives it its own mount and key; the node plugin's login of this
// cluster (a token of its ServiceAccount, audience vault) wraps with this
// cluster's key and is refused the other cluster's, as
// docs/encryption.md promises.
func (s *story) k7OtherCluster(ctx context.Context, sc string) (string, error) {
	c, kb := s.c, s.c.KeyBackend
	const other = "other-1"
	for _, prefix := range []string{"bao secrets enable -path=" + k8s.TransitMount, "bao write -f " + k8s.TransitMount + "/keys/"} {
		cmd, err := kb.RecipeCommand(prefix)
		if err != nil {
			return "", err
		}
		if _, err := c.OperatorSh(ctx, kb, strings.ReplaceAll(cmd, k8s.ClusterName, other)); err != nil {
			return "", err
		}
	}
	script := fmt.Sprintf(`p=$(printf 'a passphrase' | base64)
theirs=$(bao write -field=ciphertext transit-%[1]s/encrypt/%[2]s plaintext=$p)
jwt=$(kubectl -n %[3]s create token %[4]s --audience vault --duration 10m)
export VAULT_TOKEN=$(bao write -field=token auth/%[5]s/login role=%[6]s jwt=$jwt)
bao write -field=ciphertext %[7]s/encrypt/%[2]s plaintext=$p >/dev/null && echo own-wrap-ok
bao write transit-%[1]s/decrypt/%[2]s ciphertext=$theirs 2>&1 && echo other-unwrap-ok || true
`, other, k8s.TransitKey, k8s.AddonNamespace, k8s.NodeName, k8s.AuthMount, k8s.TransitRole, k8s.TransitMount)
	out, err := c.OperatorSh(ctx, kb, script)
	if err != nil {
		return "", err
	}
	ok := strings.Contains(out, "own-wrap-ok") && !strings.Contains(out, "other-unwrap-ok") && strings.Contains(out, "permission denied")
	s.check(e2e.P5, sc, ok, "K7: the node plugin's login wraps with %s and is refused transit-%s's key", k8s.TransitMount, other)
	if !ok {
		return "", fmt.Errorf("the node plugin's login against another cluster's key:\n%s", out)
	}
	return fmt.Sprintf("logged in as %s: wraps with %s; transit-%s/decrypt refused (permission denied)", k8s.NodeName, k8s.TransitMount, other), nil
}

// k7Rotation: the transit key rotated as docs/encryption.md says, `vco-csi
// rewrap` in the node plugin pod of the volume's node brings its token to
// the new version; with min_decryption_version raised past the old
// version, the pod moved back to from opens the volume and reads its data.
func (s *story) k7Rotation(ctx context.Context, sc string, moved podInfo, pv, from string) (string, error) {
	c, kb := s.c, s.c.KeyBackend
	if _, err := c.OperatorSh(ctx, kb, fmt.Sprintf("bao write -f %s/keys/%s/rotate", k8s.TransitMount, k8s.TransitKey)); err != nil {
		return "", err
	}
	pod, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", "app.kubernetes.io/name="+k8s.NodeName,
		"--field-selector", "spec.nodeName="+moved.Node, "-o", "name")
	if err != nil || strings.TrimSpace(pod) == "" {
		return "", fmt.Errorf("the node plugin pod on %s: %q, %v", moved.Node, pod, err)
	}
	out, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "exec", strings.TrimSpace(pod), "-c", "vco-csi", "--", "vco-csi", "rewrap")
	if err != nil {
		agent, _ := c.Env.Lab.Guest(moved.Node).MustSh(ctx, "journalctl -u vco-agent --no-pager -n 12 2>&1 | cut -c1-400")
		return "", fmt.Errorf("%w\nits output: %s\nvco-agent on %s:\n%s", err, out, moved.Node, agent)
	}
	want := fmt.Sprintf("rewrapped: transit key %s version 1 -> 2", k8s.TransitKey)
	s.check(e2e.P5, sc, strings.Contains(out, want), "K7: vco-csi rewrap on %s after the key's rotation: %s", moved.Node, strings.TrimSpace(out))
	if !strings.Contains(out, want) {
		return "", fmt.Errorf("vco-csi rewrap on %s printed %q, want a line saying %q", moved.Node, out, want)
	}
	if _, err := c.OperatorSh(ctx, kb, fmt.Sprintf("bao write %s/keys/%s/config min_decryption_version=2", k8s.TransitMount, k8s.TransitKey)); err != nil {
		return "", err
	}
	ps, err := s.k7MoveTo(ctx, moved, from)
	if err != nil {
		return "", err
	}
	data, err := s.readLog(ctx, ps[0], pv)
	if err != nil {
		return "", err
	}
	if lines := strings.Count(data, "written-on-"); lines != 3 {
		return "", fmt.Errorf("after the rewrap the volume on %s holds %q, want three lines", from, data)
	}
	return fmt.Sprintf("%s: %s; min_decryption_version 2; %s on %s reads its three lines", moved.Node, strings.TrimSpace(out), ps[0].Name, from), nil
}
