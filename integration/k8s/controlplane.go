package k8s

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// controlPlane is etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler, run on the host on loopback as lab processes.
type controlPlane struct {
	dir     string
	pki     *pki
	apiPort int
	// Kubeconfig is the administrator's, for kubectl on the host.
	Kubeconfig string
}

// startControlPlane writes the certificates and starts the four servers,
// and returns once the API server is ready. The API server reaches the
// kubelets through the egress selector configuration egress (the lab's
// kubelet proxy), by their Hostname address, the node's name.
func startControlPlane(ctx context.Context, l *lab.Lab, bins *Binaries, dir string, nodes []string, egress string, log io.Writer) (*controlPlane, error) {
	p, err := newPKI(filepath.Join(dir, "pki"))
	if err != nil {
		return nil, err
	}
	certs := []struct {
		name, cn string
		orgs     []string
		hosts    []string
	}{
		{"apiserver", "kube-apiserver", nil, []string{"127.0.0.1", HostInGuest, KubernetesSvc, "localhost",
			"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}},
		{"admin", "vco-lab-admin", []string{"system:masters"}, nil},
		{"controller-manager", "system:kube-controller-manager", nil, nil},
		{"scheduler", "system:kube-scheduler", nil, nil},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil},
	}
	for _, n := range nodes {
		certs = append(certs, struct {
			name, cn string
			orgs     []string
			hosts    []string
		}{"node-" + n, "system:node:" + n, []string{"system:nodes"}, nil})
	}
	for _, c := range certs {
		if err := p.issue(c.name, c.cn, c.orgs, c.hosts...); err != nil {
			return nil, fmt.Errorf("certificate %s: %w", c.name, err)
		}
	}
	var ports [3]int
	for i := range ports {
		if ports[i], err = lab.FreePort(); err != nil {
			return nil, err
		}
	}
	etcdPort, peerPort, apiPort := ports[0], ports[1], ports[2]
	cp := &controlPlane{dir: dir, pki: p, apiPort: apiPort, Kubeconfig: filepath.Join(dir, "admin.kubeconfig")}
	server := "https://127.0.0.1:" + strconv.Itoa(apiPort)
	for _, k := range []string{"admin", "controller-manager", "scheduler"} {
		kc, err := p.kubeconfig(k, server)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, k+".kubeconfig"), []byte(kc), 0o600); err != nil {
			return nil, err
		}
	}
	start := func(name, bin string, args ...string) error {
		logf, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			return err
		}
		defer logf.Close()
		cmd := exec.Command(bin, args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		if _, err := l.Spawn(name, cmd); err != nil {
			return fmt.Errorf("starting %s: %w", name, err)
		}
		return nil
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	// The lab's etcd does not fsync: its data lives as long as the lab. A
	// lab directory used before (vco-lab -dir) may hold an earlier
	// cluster's data, whose objects the new one must not inherit (its
	// certificates are new).
	if err := os.RemoveAll(filepath.Join(dir, "etcd")); err != nil {
		return nil, err
	}
	if err := start("etcd", bins.Etcd, "--name", "lab", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "lab="+peerURL, "--unsafe-no-fsync", "--log-level", "warn"); err != nil {
		return nil, err
	}
	pk := p.path
	if err := start("kube-apiserver", bins.APIServer,
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(apiPort), "--advertise-address", HostInGuest,
		"--service-cluster-ip-range", ServiceCIDR,
		"--client-ca-file", pk("ca.crt"), "--tls-cert-file", pk("apiserver.crt"), "--tls-private-key-file", pk("apiserver.key"),
		"--kubelet-client-certificate", pk("apiserver-kubelet-client.crt"), "--kubelet-client-key", pk("apiserver-kubelet-client.key"),
		"--egress-selector-config-file", egress, "--kubelet-preferred-address-types", "Hostname",
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", pk("sa.pub"), "--service-account-signing-key-file", pk("sa.key"),
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--allow-privileged", "--anonymous-auth=false", "--profiling=false",
		"--endpoint-reconciler-type", "none"); err != nil {
		return nil, err
	}
	if err := cp.waitReady(ctx, 3*time.Minute); err != nil {
		return nil, fmt.Errorf("kube-apiserver: %w (log %s)", err, filepath.Join(dir, "kube-apiserver.log"))
	}
	if err := start("kube-controller-manager", bins.ControllerManager,
		"--kubeconfig", filepath.Join(dir, "controller-manager.kubeconfig"),
		"--authentication-kubeconfig", filepath.Join(dir, "controller-manager.kubeconfig"),
		"--authorization-kubeconfig", filepath.Join(dir, "controller-manager.kubeconfig"),
		"--bind-address", "127.0.0.1", "--secure-port", "0", "--leader-elect=false",
		"--use-service-account-credentials", "--service-account-private-key-file", pk("sa.key"),
		"--root-ca-file", pk("ca.crt"), "--cluster-signing-cert-file", pk("ca.crt"), "--cluster-signing-key-file", pk("ca.key"),
		"--service-cluster-ip-range", ServiceCIDR); err != nil {
		return nil, err
	}
	if err := start("kube-scheduler", bins.Scheduler,
		"--kubeconfig", filepath.Join(dir, "scheduler.kubeconfig"),
		"--authentication-kubeconfig", filepath.Join(dir, "scheduler.kubeconfig"),
		"--authorization-kubeconfig", filepath.Join(dir, "scheduler.kubeconfig"),
		"--bind-address", "127.0.0.1", "--secure-port", "0", "--leader-elect=false"); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "k8s: control plane up on %s (etcd, kube-apiserver, kube-controller-manager, kube-scheduler; logs in %s)\n", server, dir)
	return cp, nil
}

// client is an HTTPS client with the administrator's certificate.
func (cp *controlPlane) client() (*http.Client, error) {
	cert, err := tls.LoadX509KeyPair(cp.pki.path("admin.crt"), cp.pki.path("admin.key"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(cp.pki.Cert)
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}}}, nil
}

func (cp *controlPlane) waitReady(ctx context.Context, limit time.Duration) error {
	c, err := cp.client()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(limit)
	var last string
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d/readyz", cp.apiPort), nil)
		resp, err := c.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(b)))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	return fmt.Errorf("not ready after %s: %s", limit, last)
}
