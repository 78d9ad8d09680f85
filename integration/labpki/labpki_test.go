package labpki

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"testing"
)

func TestIssuedCertificatesVerifyAgainstTheCA(t *testing.T) {
	ca, err := New(t.TempDir(), "test CA")
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Issue("server", "server", nil, "127.0.0.1", "example.test"); err != nil {
		t.Fatal(err)
	}
	if err := ca.Issue("client", "admin", []string{"system:masters"}); err != nil {
		t.Fatal(err)
	}
	pem, err := os.ReadFile(ca.Path("ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("ca.crt holds no certificate")
	}
	for name, usage := range map[string]x509.ExtKeyUsage{"server": x509.ExtKeyUsageServerAuth, "client": x509.ExtKeyUsageClientAuth} {
		pair, err := tls.LoadX509KeyPair(ca.Path(name+".crt"), ca.Path(name+".key"))
		if err != nil {
			t.Fatal(err)
		}
		leaf, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		opts := x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{usage}}
		if name == "server" {
			opts.DNSName = "127.0.0.1"
		}
		if _, err := leaf.Verify(opts); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}
