// Package labpki is the lab's certificate authority: a CA of its own in a
// directory, and the client and serving certificates it issues there as
// PEM files (name.crt, name.key), for the lab's Kubernetes cluster, its
// key backends and the servers its tests run.
package labpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// CA issues certificates into Dir, where its own are ca.crt and ca.key.
type CA struct {
	Dir    string
	Cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	serial int64
}

// validity is how long the lab's certificates are valid, from an hour ago.
const validity = 30 * 24 * time.Hour

// New makes a CA named cn in dir (created 0700).
func New(dir, cn string) (*CA, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(validity),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{Dir: dir, Cert: cert, key: key, serial: 1}
	return ca, ca.write("ca", der, key)
}

// Path is the path of file name in the CA's directory.
func (c *CA) Path(name string) string { return filepath.Join(c.Dir, name) }

// Issue writes name.crt and name.key: a client certificate for cn in
// groups orgs, or a serving one for hosts (IP addresses or names) when
// hosts are given.
func (c *CA) Issue(name, cn string, orgs []string, hosts ...string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	c.serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(c.serial), Subject: pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(validity),
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
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.Cert, &key.PublicKey, c.key)
	if err != nil {
		return err
	}
	return c.write(name, der, key)
}

func (c *CA) write(name string, der []byte, key *ecdsa.PrivateKey) error {
	if err := WritePEM(c.Path(name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return c.WriteKey(name, key)
}

// WriteKey writes key as name.key.
func (c *CA) WriteKey(name string, key *ecdsa.PrivateKey) error {
	b, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return WritePEM(c.Path(name+".key"), "EC PRIVATE KEY", b)
}

// WritePEM writes der as one PEM block of type typ, mode 0600.
func WritePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}
