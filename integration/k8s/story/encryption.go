package story

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// k7: a claim of the encrypted class with a Vault server built from
// source as the key backend, set up by following docs/encryption.md's
// recipe: the pod's data is on dm-crypt on its node, the pod moves to the
// other worker and reads it back, and the node plugin runs unprivileged;
// the key rotated and the volume rewrapped (vco-csi rewrap), it opens
// with min_decryption_version past its first wrap; another cluster's key
// on the same server is refused to this cluster's
// node plugin; the key backend's failures are named in a pod's events and
// nothing is wrapped until it is back.
func (s *story) k7(ctx context.Context) error {
	const sc = "K7"
	c := s.c
	if err := s.step(sc, "cluster", "the key backend set up as docs/encryption.md says", func() (string, error) {
		return s.k7KeyBackend(ctx)
	}); err != nil {
		return err
	}
	var first podInfo
	var pv string
	if err := s.step(sc, "cluster", "a claim of the encrypted class and a pod writing to it; on its node the filesystem is on dm-crypt", func() (string, error) {
		return s.k7Claim(ctx, &first, &pv)
	}); err != nil {
		return err
	}
	to := s.other(first.Node)
	var moved podInfo
	if err := s.step(sc, to, "the pod moved to "+to+" (cordon, delete) reads the data back", func() (string, error) {
		return s.k7Moved(ctx, sc, first, pv, to, &moved)
	}); err != nil {
		return err
	}
	if err := s.step(sc, to, "the key rotated, vco-csi rewrap, min_decryption_version raised: the pod moved back reads its data", func() (string, error) {
		return s.k7Rotation(ctx, sc, moved, pv, first.Node)
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "the node plugin's container is unprivileged", func() (string, error) {
		out, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "daemonset", k8s.NodeName, "-o", "jsonpath={range .spec.template.spec.containers[*]}{.name} {.securityContext}{\"\\n\"}{end}")
		if err != nil {
			return "", err
		}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			name, js, _ := strings.Cut(l, " ")
			var sc struct {
				Privileged   *bool
				Capabilities struct{ Add []string }
			}
			if err := json.Unmarshal([]byte(js), &sc); err != nil {
				return "", fmt.Errorf("container %s: securityContext %q: %w", name, js, err)
			}
			if sc.Privileged == nil || *sc.Privileged || len(sc.Capabilities.Add) > 0 {
				return "", fmt.Errorf("container %s of %s is not plainly unprivileged: %s", name, k8s.NodeName, js)
			}
		}
		// Free the encrypted disk for the scenarios after this one.
		if _, err := c.Kubectl(ctx, "-n", Namespace, "delete", "deployment", "k7", "--wait=true"); err != nil {
			return "", err
		}
		if _, err := c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "k7", "--wait=false"); err != nil {
			return "", err
		}
		return lab.LastLines(strings.TrimSpace(out), 3), nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "another cluster's key on the same server is refused to this cluster's node plugin", func() (string, error) {
		return s.k7OtherCluster(ctx, sc)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the key backend refusing (login, stopped, sealed) is named in the pod's events; nothing is wrapped until it is back", func() (string, error) {
		return s.k7Refusals(ctx, sc)
	})
}

// k7KeyBackend starts the Vault server and follows docs/encryption.md's
// recipe against it and the cluster (the encryption part applied with
// make csi-addon, the transit mount, key and policy, the Kubernetes auth
// mount reviewing tokens with the cluster's reviewer, the ConfigMaps, the
// node plugins restarted), then waits for the node plugins.
func (s *story) k7KeyBackend(ctx context.Context) (string, error) {
	c := s.c
	if c.KeyBackend == nil {
		kb, err := c.StartKeyBackend(ctx, c.KeyBackendPort, s.log)
		if err != nil {
			return "", err
		}
		c.KeyBackend = kb
	}
	kb := c.KeyBackend
	n, err := c.FollowRecipe(ctx, kb)
	if err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", k8s.AddonNamespace, "rollout", "status", "daemonset/"+k8s.NodeName, "--timeout=5m"); err != nil {
		return "", c.PodsState(ctx, err)
	}
	return fmt.Sprintf("%s: the %d blocks of docs/encryption.md's recipe followed (mount %s, auth %s, role %s); node plugins restarted and ready",
		kb.Describe(), n, k8s.TransitMount, k8s.AuthMount, k8s.TransitRole), nil
}

// k7Claim creates a claim of the encrypted class with a pod writing to it, sets first to the pod and pv to its volume, and checks the volume is on dm-crypt with its passphrase wrapped by the key backend.
func (s *story) k7Claim(ctx context.Context, first *podInfo, pv *string) (string, error) {
	c := s.c
	p, err := s.startWriter(ctx, "k7", encryptedClaim("k7"))
	if err != nil {
		return "", err
	}
	*first = p
	if *pv, err = s.pvOf(ctx, "k7"); err != nil {
		return "", err
	}
	g := c.Env.Lab.Guest(first.Node)
	out, err := g.MustSh(ctx, "src=$(findmnt -n -o SOURCE "+volumeMount(first.UID, *pv)+"); echo $src $(lsblk -n -d -o TYPE $src)")
	if err != nil {
		return "", err
	}
	if f := strings.Fields(out); len(f) != 2 || f[1] != "crypt" {
		return "", fmt.Errorf("the pod's volume is mounted from %q, not a dm-crypt mapping", strings.TrimSpace(out))
	}
	logins, err := c.KeyBackend.Answered("auth/" + k8s.AuthMount + "/login")
	if err != nil {
		return "", err
	}
	wraps, err := c.KeyBackend.Answered(k8s.TransitMount + "/encrypt/" + k8s.TransitKey)
	if err != nil {
		return "", err
	}
	if logins == 0 || wraps == 0 {
		return "", fmt.Errorf("the volume was staged but the key backend's audit log shows %d logins and %d wraps (%s)", logins, wraps, c.KeyBackend.Describe())
	}
	return fmt.Sprintf("%s Ready on %s; mounted from %s; the key backend's audit log: %d logins, %d wraps", first.Name, first.Node, strings.TrimSpace(out), logins, wraps), nil
}

// k7Moved moves the pod first off its node to to and reads its data back there, unwrapped by the key backend.
func (s *story) k7Moved(ctx context.Context, sc string, first podInfo, pv, to string, moved *podInfo) (string, error) {
	c := s.c
	ps, err := s.k7MoveTo(ctx, first, to)
	if err != nil {
		return "", err
	}
	unwraps, err := c.KeyBackend.Answered(k8s.TransitMount + "/decrypt/" + k8s.TransitKey)
	if err != nil {
		return "", err
	}
	if unwraps == 0 {
		return "", fmt.Errorf("the volume was staged on %s but the key backend's audit log shows no unwrap (%s)", to, c.KeyBackend.Describe())
	}
	*moved = ps[0]
	data, err := s.readLog(ctx, ps[0], pv)
	if err != nil {
		return "", err
	}
	want := "written-on-" + first.Node + "\nwritten-on-" + to
	s.check(e2e.P5, sc, data == want, "K7: the encrypted volume moved from %s to %s holds %q", first.Node, to, data)
	if data != want {
		return "", fmt.Errorf("the encrypted volume holds %q, want %q", data, want)
	}
	return fmt.Sprintf("%s on %s reads %q; the key backend's audit log: %d unwraps", ps[0].Name, to, data, unwraps), nil
}

// k7MoveTo moves K7's pod p to the worker to (p's node cordoned, p
// deleted) and returns the pod once it is Ready there; when it does not
// come up, the error carries p's node's vco-agent journal and the
// workers' kubelet journals.
func (s *story) k7MoveTo(ctx context.Context, p podInfo, to string) ([]podInfo, error) {
	c := s.c
	if _, err := c.Kubectl(ctx, "cordon", p.Node); err != nil {
		return nil, err
	}
	defer func() { _, _ = c.Kubectl(context.WithoutCancel(ctx), "uncordon", p.Node) }()
	if _, err := c.Kubectl(ctx, "-n", Namespace, "delete", "pod", p.Name, "--wait=false"); err != nil {
		return nil, err
	}
	ps, err := s.waitPods(ctx, "app=k7", 10*time.Minute, "k7 Ready on "+to, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == to
	})
	if err != nil {
		agent, _ := c.Env.Lab.Guest(p.Node).MustSh(ctx, "journalctl -u vco-agent --no-pager -n 25 2>&1 | cut -c1-300")
		return nil, c.WithLogs(fmt.Errorf("%w\n--- %s: vco-agent\n%s", err, p.Node, agent))
	}
	return ps, nil
}
