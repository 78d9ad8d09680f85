package k8s

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"

	"github.com/whitesky-cloud/vco-storage/integration/labpki"
)

// The addresses the cluster is known by. Guests reach the host through
// QEMU's user network: 10.0.2.100 is the host as the guests see it (each
// port a forward to the host's loopback), 10.96.0.1 the kubernetes
// service, which each worker sends to the API server's forward.
const (
	HostInGuest   = "10.0.2.100"
	NodeIP        = "10.0.2.15"
	ServiceCIDR   = "10.96.0.0/24"
	KubernetesSvc = "10.96.0.1"
	// Ports on HostInGuest.
	GuestAPIPort      = 6443
	GuestRegistryPort = 5000
	GuestCloudPort    = 8080
	GuestTransitPort  = 8200
)

// pki writes the cluster's certificates into dir: a CA, the API server's
// serving certificate, client certificates for the administrator, the
// controller manager, the scheduler, the API server's calls to kubelets
// and each node, and the service-account signing key.
type pki struct{ *labpki.CA }

func newPKI(dir string) (*pki, error) {
	ca, err := labpki.New(dir, "vco-lab cluster CA")
	if err != nil {
		return nil, err
	}
	// The service-account key pair: the API server checks tokens with the
	// public half, the controller manager signs with the private one.
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	pub, err := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err != nil {
		return nil, err
	}
	if err := labpki.WritePEM(filepath.Join(dir, "sa.pub"), "PUBLIC KEY", pub); err != nil {
		return nil, err
	}
	return &pki{ca}, ca.WriteKey("sa", sa)
}

func (p *pki) path(name string) string { return p.Path(name) }

func (p *pki) issue(name, cn string, orgs []string, hosts ...string) error {
	return p.Issue(name, cn, orgs, hosts...)
}

// kubeconfig is a kubeconfig for the client certificate name, talking to
// server, with the certificates inline (so it can be copied into a guest
// as one file).
func (p *pki) kubeconfig(name, server string) (string, error) {
	var b64 [3]string
	for i, f := range []string{p.path("ca.crt"), p.path(name + ".crt"), p.path(name + ".key")} {
		data, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		b64[i] = base64Std(data)
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: vco-lab
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: vco-lab
  context: {cluster: vco-lab, user: %s}
current-context: vco-lab
`, server, b64[0], name, b64[1], b64[2], name), nil
}

func base64Std(b []byte) string { return base64.StdEncoding.EncodeToString(b) }
