package k8s

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
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
type pki struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	serial int64
}

func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "vco-lab cluster CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(30 * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, ca: ca, caKey: key, serial: 1}
	if err := p.write("ca", der, key); err != nil {
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
	if err := writePEM(filepath.Join(dir, "sa.pub"), "PUBLIC KEY", pub); err != nil {
		return nil, err
	}
	return p, p.writeKey("sa", sa)
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

// issue writes name.crt and name.key: a client certificate for cn in
// groups orgs, or a serving one when hosts are given.
func (p *pki) issue(name, cn string, orgs []string, hosts ...string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	p.serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(p.serial), Subject: pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(30 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if len(hosts) > 0 {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		for _, h := range hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return err
	}
	return p.write(name, der, key)
}

func (p *pki) write(name string, der []byte, key *ecdsa.PrivateKey) error {
	if err := writePEM(p.path(name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return p.writeKey(name, key)
}

func (p *pki) writeKey(name string, key *ecdsa.PrivateKey) error {
	b, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(p.path(name+".key"), "EC PRIVATE KEY", b)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
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
