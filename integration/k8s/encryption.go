package k8s

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// The node plugin's ServiceAccount, which the key backend's role binds.
const nodeServiceAccount = "system:serviceaccount:" + AddonNamespace + ":vco-csi-node"

// tokenReviewer judges a login's JWT as Vault's and OpenBao's Kubernetes
// auth method does: a TokenReview sent to the cluster's API server with
// the reviewer's token (the vco-csi-token-reviewer Secret of the
// encryption part), for the audience "vault"; the role binds the node
// plugin's ServiceAccount in the add-on's namespace.
func (c *Cluster) tokenReviewer(reviewerJWT string) (func(jwt, role string) error, error) {
	ca, err := os.ReadFile(c.cp.pki.path("ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("no certificate in %s", c.cp.pki.path("ca.crt"))
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	url := fmt.Sprintf("https://127.0.0.1:%d/apis/authentication.k8s.io/v1/tokenreviews", c.cp.apiPort)
	return func(jwt, role string) error {
		body, _ := json.Marshal(map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
			"spec": map[string]any{"token": jwt, "audiences": []string{"vault"}}})
		req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+reviewerJWT)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("token review: %w", err)
		}
		defer resp.Body.Close()
		var tr struct {
			Status struct {
				Authenticated bool
				Error         string
				Audiences     []string
				User          struct{ Username string }
			}
		}
		if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
			return fmt.Errorf("token review: the API server answered %s (is the reviewer bound to system:auth-delegator?)", resp.Status)
		}
		if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil {
			return fmt.Errorf("token review: %w", err)
		}
		switch {
		case !tr.Status.Authenticated:
			return fmt.Errorf("token review: not authenticated: %s", tr.Status.Error)
		case !slices.Contains(tr.Status.Audiences, "vault"):
			return fmt.Errorf("token review: audiences %v, the role wants vault", tr.Status.Audiences)
		case tr.Status.User.Username != nodeServiceAccount:
			return fmt.Errorf("token review: %s is not bound to role %s", tr.Status.User.Username, role)
		}
		return nil
	}, nil
}

// k7: a claim of the encrypted class with the key backend set up as
// docs/encryption.md says (the encryption part applied with make
// csi-addon, the token reviewer given to the key backend, the ConfigMap
// csi-key-backend-config, the node plugins restarted): the pod's data is
// on dm-crypt on its node, the pod moves to the other worker and reads it
// back, and the node plugin runs unprivileged.
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
	if err := s.step(sc, to, "the pod moved to "+to+" (cordon, delete) reads the data back", func() (string, error) {
		return s.k7Moved(ctx, sc, first, pv, to)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the node plugin's container is unprivileged", func() (string, error) {
		out, err := c.Kubectl(ctx, "-n", AddonNamespace, "get", "daemonset", NodeName, "-o", "jsonpath={range .spec.template.spec.containers[*]}{.name} {.securityContext}{\"\\n\"}{end}")
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
				return "", fmt.Errorf("container %s of %s is not plainly unprivileged: %s", name, NodeName, js)
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
	})
}

// k7KeyBackend sets the key backend up as docs/encryption.md says: the encryption part of the add-on, the token reviewer, the ConfigMap and the CA, the node plugins restarted.
func (s *story) k7KeyBackend(ctx context.Context) (string, error) {
	c := s.c
	mk := exec.CommandContext(ctx, "make", "-s", "-C", repoRoot(), "csi-addon", "VCO_CSI_IMAGE="+Image, "VCO_CSI_ENCRYPTION=1",
		"ADDON_DIR="+filepath.Join(c.Env.Lab.Dir(), "addon"))
	var stderr bytes.Buffer
	mk.Stderr = &stderr
	bundle, err := mk.Output()
	if err != nil {
		return "", fmt.Errorf("make csi-addon VCO_CSI_ENCRYPTION=1: %w: %s", err, stderr.String())
	}
	if _, err := c.KubectlInput(ctx, bytes.NewReader(bundle), "apply", "-f", "-"); err != nil {
		return "", err
	}
	var reviewer []byte
	if err := waitFor(ctx, 2*time.Minute, "the token reviewer's Secret filled", func() (bool, string, error) {
		out, err := c.Kubectl(ctx, "-n", AddonNamespace, "get", "secret", "vco-csi-token-reviewer", "-o", "jsonpath={.data.token}")
		if err != nil || strings.TrimSpace(out) == "" {
			return false, fmt.Sprint(err), nil
		}
		reviewer, err = base64.StdEncoding.DecodeString(strings.TrimSpace(out))
		return err == nil, fmt.Sprint(err), nil
	}); err != nil {
		return "", err
	}
	review, err := c.tokenReviewer(string(reviewer))
	if err != nil {
		return "", err
	}
	c.Transit.Mu.Lock()
	c.Transit.Review = review
	c.Transit.Mu.Unlock()
	cm := fmt.Sprintf(`apiVersion: v1
kind: ConfigMap
metadata:
  name: csi-key-backend-config
  namespace: %s
data:
  address: https://%s:%d
  transitMount: %s
  k8sAuthPath: %s
  role: %s
  caRef: openbao-ca
`, AddonNamespace, HostInGuest, GuestTransitPort, TransitMount, AuthMount, TransitRole)
	if _, err := c.KubectlInput(ctx, strings.NewReader(cm), "apply", "-f", "-"); err != nil {
		return "", err
	}
	// The key backend's CA as the recipe delivers it: kubectl create
	// configmap openbao-ca --from-file=ca.crt=<the server's CA>.
	caFile := filepath.Join(c.Env.Lab.Dir(), "openbao-ca.pem")
	if err := os.WriteFile(caFile, c.TransitCA, 0o644); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", AddonNamespace, "create", "configmap", "openbao-ca", "--from-file=ca.crt="+caFile); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", AddonNamespace, "rollout", "restart", "daemonset/"+NodeName); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", AddonNamespace, "rollout", "status", "daemonset/"+NodeName, "--timeout=5m"); err != nil {
		return "", c.podsState(ctx, err)
	}
	return fmt.Sprintf("encryption part applied; key backend %s (mount %s, auth %s, role %s) reviews tokens with the reviewer's; node plugins restarted and ready",
		c.Transit.Describe(), TransitMount, AuthMount, TransitRole), nil
}

// k7Claim creates a claim of the encrypted class with a pod writing to it, sets first to the pod and pv to its volume, and checks the volume is on dm-crypt with its passphrase wrapped by the key backend.
func (s *story) k7Claim(ctx context.Context, first *podInfo, pv *string) (string, error) {
	c := s.c
	p, err := s.startWriter(ctx, "k7", `apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: k7
spec:
  storageClassName: vco-csi-encrypted-vault
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
`)
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
	if c.transitOps("encrypt") == 0 {
		return "", fmt.Errorf("the volume was staged but its passphrase was never wrapped by the key backend (%s)", c.Transit.Describe())
	}
	return fmt.Sprintf("%s Ready on %s; mounted from %s; key backend: %s", first.Name, first.Node, strings.TrimSpace(out), c.Transit.Describe()), nil
}

// k7Moved moves the pod first off its node to to and reads its data back there, unwrapped by the key backend.
func (s *story) k7Moved(ctx context.Context, sc string, first podInfo, pv, to string) (string, error) {
	c := s.c
	if _, err := c.Kubectl(ctx, "cordon", first.Node); err != nil {
		return "", err
	}
	defer func() { _, _ = c.Kubectl(context.WithoutCancel(ctx), "uncordon", first.Node) }()
	if _, err := c.Kubectl(ctx, "-n", Namespace, "delete", "pod", first.Name, "--wait=false"); err != nil {
		return "", err
	}
	ps, err := s.waitPods(ctx, "app=k7", 10*time.Minute, "k7 Ready on "+to, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == to
	})
	if err != nil {
		return "", err
	}
	if c.transitOps("decrypt") == 0 {
		return "", fmt.Errorf("the volume was staged on %s without unwrapping its passphrase (%s)", to, c.Transit.Describe())
	}
	data, err := s.readLog(ctx, ps[0], pv)
	if err != nil {
		return "", err
	}
	want := "written-on-" + first.Node + "\nwritten-on-" + to
	s.check(e2e.P5, sc, data == want, "K7: the encrypted volume moved from %s to %s holds %q", first.Node, to, data)
	if data != want {
		return "", fmt.Errorf("the encrypted volume holds %q, want %q", data, want)
	}
	return fmt.Sprintf("%s on %s reads %q; key backend: %s", ps[0].Name, to, data, c.Transit.Describe()), nil
}

// transitOps counts the transit engine's requests of operation op
// (encrypt, decrypt).
func (c *Cluster) transitOps(op string) int {
	c.Transit.Mu.Lock()
	defer c.Transit.Mu.Unlock()
	n := 0
	for _, r := range c.Transit.Requests {
		if strings.Contains(r, "/"+TransitMount+"/"+op+"/") {
			n++
		}
	}
	return n
}
