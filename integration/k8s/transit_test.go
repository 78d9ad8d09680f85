package k8s

import (
	"crypto/x509"
	"testing"
)

// The transit engine's certificate is what the node plugins check against
// the openbao-ca ConfigMap K7 gives them: valid for the address they dial
// under that CA, and under no other.
func TestTransitCertificateVerifiesForTheWorkersAddress(t *testing.T) {
	cert, caPEM, err := transitCert()
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("the CA PEM holds no certificate")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: HostInGuest}); err != nil {
		t.Fatalf("the certificate does not verify for %s under its CA: %v", HostInGuest, err)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "10.0.2.101"}); err == nil {
		t.Fatal("the certificate verifies for an address it was not made for")
	}
	_, otherCA, err := transitCert()
	if err != nil {
		t.Fatal(err)
	}
	other := x509.NewCertPool()
	other.AppendCertsFromPEM(otherCA)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: other, DNSName: HostInGuest}); err == nil {
		t.Fatal("the certificate verifies under another lab's CA")
	}
}
