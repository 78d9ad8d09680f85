package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"maps"
	"math/big"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/csi/metrics"
)

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for k, v := range files {
		if err := os.WriteFile(filepath.Join(dir, k), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func testCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func TestCredential(t *testing.T) {
	dir := t.TempDir()
	jwt := filepath.Join(dir, "jwt")
	empty := filepath.Join(dir, "empty")
	writeFiles(t, dir, map[string]string{"jwt": "eyJhbGciOiJFUzM4NCJ9.e30.c2ln\n", "empty": " \n"})
	good := credential{PortalURL: "https://try.whitesky.cloud", Customer: "acme_1", Cloudspace: "k8s-prod", TokenFile: jwt}

	for _, tc := range []struct {
		url      string
		insecure bool
		want     string
	}{
		{"https://try.whitesky.cloud", false, "https://try.whitesky.cloud/api/1"},
		{"https://try.whitesky.cloud/", false, "https://try.whitesky.cloud/api/1"},
		{"http://127.0.0.1:8080", false, "http://127.0.0.1:8080/api/1"},
		{"http://[::1]:8080", false, "http://[::1]:8080/api/1"},
		{"http://localhost:8080", false, "http://localhost:8080/api/1"},
		{"http://10.0.2.100:8080", true, "http://10.0.2.100:8080/api/1"},
	} {
		c := good
		c.PortalURL, c.InsecureAllowHTTP = tc.url, tc.insecure
		got, err := c.apiURL()
		if err != nil || got != tc.want {
			t.Errorf("url %q: %q, %v; want %q", tc.url, got, err, tc.want)
		}
	}

	for _, tc := range []struct {
		name string
		edit func(*credential)
		want []string // every part must be in the error
	}{
		{"empty url", func(c *credential) { c.PortalURL = "" }, []string{"csi-driver-secret key url", "is empty"}},
		{"unfilled url", func(c *credential) { c.PortalURL = "$(VCO_PORTAL_URL)" }, []string{"key url", "not filled in"}},
		{"no scheme", func(c *credential) { c.PortalURL = "try.whitesky.cloud" }, []string{"key url", "no http or https scheme"}},
		{"ftp", func(c *credential) { c.PortalURL = "ftp://try.whitesky.cloud" }, []string{"key url", "no http or https scheme"}},
		{"http", func(c *credential) { c.PortalURL = "http://try.whitesky.cloud" },
			[]string{"csi-driver-secret key url (--portal-url)", "plain http to try.whitesky.cloud, not a loopback address", "--insecure-allow-http", "https://try.whitesky.cloud"}},
		{"http to 10.0.2.100", func(c *credential) { c.PortalURL = "http://10.0.2.100:8080" }, []string{"key url", "plain http to 10.0.2.100"}},
		{"no host", func(c *credential) { c.PortalURL = "https://" }, []string{"key url", "no host"}},
		{"api path", func(c *credential) { c.PortalURL = "https://try.whitesky.cloud/api/1" }, []string{"key url", "has a path (/api/1)"}},
		{"query", func(c *credential) { c.PortalURL = "https://try.whitesky.cloud?x=1" }, []string{"key url", "query or fragment"}},
		{"user", func(c *credential) { c.PortalURL = "https://me:pw@try.whitesky.cloud" }, []string{"key url", "user information"}},
		{"newline", func(c *credential) { c.PortalURL = "https://try.whitesky.cloud\n" }, []string{"key url", "white space"}},
		{"no customer", func(c *credential) { c.Customer = "" }, []string{"csi-driver-secret key customer (--customer) is empty"}},
		{"unfilled customer", func(c *credential) { c.Customer = "$(VCO_CUSTOMER)" }, []string{"key customer", "not filled in"}},
		{"spaced customer", func(c *credential) { c.Customer = "acme 1" }, []string{"key customer", "white space"}},
		{"no cloudspace", func(c *credential) { c.Cloudspace = "" }, []string{"csi-driver-secret key cloudspace (--cloudspace) is empty"}},
		{"cloudspace newline", func(c *credential) { c.Cloudspace = "k8s-prod\n" }, []string{"key cloudspace", "white space"}},
		{"no jwt", func(c *credential) { c.TokenFile = filepath.Join(dir, "absent") }, []string{"csi-driver-secret key jwt", "does not exist"}},
		{"empty jwt", func(c *credential) { c.TokenFile = empty }, []string{"csi-driver-secret key jwt", "is empty"}},
	} {
		c := good
		tc.edit(&c)
		_, err := c.apiURL()
		if err == nil {
			t.Errorf("%s: accepted", tc.name)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q lacks %q", tc.name, err, w)
			}
		}
		if strings.Contains(err.Error(), "eyJhbGciOiJFUzM4NCJ9") {
			t.Errorf("%s: error %q carries the JWT", tc.name, err)
		}
	}
}

// seedKeyBackend is the ConfigMap csi-key-backend-config in the form the
// seed's VCOCluster settings deliver it (address, transitMount,
// k8sAuthPath, role, caRef), and seedCA the openbao-ca ConfigMap beside
// it. docs/encryption.md shows the same objects.
const seedKeyBackend = `apiVersion: v1
kind: ConfigMap
metadata:
  name: csi-key-backend-config
  namespace: csi-driver
data:
  address: https://openbao.example.net:8200
  transitMount: transit-prod-1
  k8sAuthPath: kubernetes-prod-1
  role: vco-csi-node
  caRef: openbao-ca
`

const seedCA = `apiVersion: v1
kind: ConfigMap
metadata:
  name: openbao-ca
  namespace: csi-driver
data:
  ca.crt: |
`

// projectKeyBackend lays the ConfigMaps out as the node DaemonSet's
// projected volume does: the settings' keys as files, the CA object's
// keys under ca/configmap/ or ca/secret/, and the token.
func projectKeyBackend(t *testing.T, settings map[string]string, caKind string, ca map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	writeFiles(t, dir, settings)
	writeFiles(t, dir, map[string]string{"token": "eyJhbGciOiJSUzI1NiJ9.e30.c2ln"})
	if len(ca) > 0 {
		sub := filepath.Join(dir, "ca", strings.ToLower(caKind))
		if err := os.MkdirAll(sub, 0o700); err != nil {
			t.Fatal(err)
		}
		writeFiles(t, sub, ca)
	}
	return dir
}

func TestKeyBackend(t *testing.T) {
	ca := testCA(t)

	t.Run("seed", func(t *testing.T) { keyBackendSeed(t, ca) })
	t.Run("our names", func(t *testing.T) { keyBackendOurNames(t, ca) })
	t.Run("defaults", func(t *testing.T) { keyBackendDefaults(t) })
	t.Run("auth path", func(t *testing.T) { keyBackendAuthPath(t) })
	// The CA is found under every key such an object carries, in a
	// ConfigMap or a Secret, and caRef may name the kind.
	t.Run("ca", func(t *testing.T) { keyBackendCA(t, ca) })
	t.Run("none", func(t *testing.T) { keyBackendNone(t, ca) })

	full := map[string]string{"address": "https://openbao.example.net:8200", "transitMount": "transit-prod-1",
		"k8sAuthPath": "kubernetes-prod-1", "role": "vco-csi-node", "caRef": "openbao-ca"}
	for _, tc := range []struct {
		name   string
		edit   map[string]string // "" deletes the file
		caKind string
		ca     map[string]string
		want   []string
	}{
		{"no address", map[string]string{"address": ""}, "", nil, []string{"csi-key-backend-config has key", "but no key address"}},
		{"address misspelt", map[string]string{"address": "", "Address": "https://b:8200"}, "", nil,
			[]string{"has key Address, which the node plugin does not know", "address, transitMount"}},
		{"key misspelt", map[string]string{"transitmount": "t"}, "", nil, []string{"has key transitmount, which the node plugin does not know"}},
		{"blank address", map[string]string{"address": "\n"}, "", nil, []string{"csi-key-backend-config key address is empty"}},
		{"address no scheme", map[string]string{"address": "openbao.example.net:8200"}, "", nil, []string{"key address", "not an http(s) URL"}},
		{"address path", map[string]string{"address": "https://openbao.example.net:8200/v1"}, "", nil, []string{"key address", "has a path"}},
		{"address http", map[string]string{"address": "http://openbao.example.net:8200"}, "", nil,
			[]string{"csi-key-backend-config key address", "plain http to openbao.example.net, not a loopback address", "https://", "--insecure-allow-http"}},
		{"address http loopback", map[string]string{"address": "http://127.0.0.1:8200"}, "", nil, nil},
		{"no role", map[string]string{"role": ""}, "", nil, []string{"csi-key-backend-config has no key role"}},
		{"blank role", map[string]string{"role": " \n"}, "", nil, []string{"csi-key-backend-config key role is empty"}},
		{"spaced key", map[string]string{"transitKey": "a b"}, "", nil, []string{"key transitKey", "white space"}},
		{"spaced key alias", map[string]string{"transit_key": "a b"}, "", nil, []string{"key transit_key", "white space"}},
		{"both spellings differ", map[string]string{"transit_mount": "transit"}, "", nil,
			[]string{"has both transitMount and transit_mount, with different values"}},
		{"both spellings agree", map[string]string{"transit_mount": "/transit-prod-1\n", "auth_mount": "kubernetes-prod-1"}, "", nil, nil},
		{"bad transitMount", map[string]string{"transitMount": "a b"}, "", nil, []string{"key transitMount", "not a path"}},
		{"bad auth_mount", map[string]string{"k8sAuthPath": "", "auth_mount": "a//b"}, "", nil, []string{"key auth_mount", "not a path"}},
		{"empty namespace", map[string]string{"namespace": "\n"}, "", nil, []string{"key namespace is empty"}},
		{"caRef bad kind", map[string]string{"caRef": "Certificate/openbao-ca"}, "", nil, []string{"key caRef", "neither ConfigMap nor Secret"}},
		{"caRef bad name", map[string]string{"caRef": "OpenBao CA"}, "", nil, []string{"key caRef", "does not name a ConfigMap or Secret"}},
		{"caRef without bundle", map[string]string{"caRef": "corp-root-ca"}, "", nil,
			[]string{`key caRef "corp-root-ca": no CA bundle found in the ConfigMap or Secret openbao-ca`, "ca.crt, ca.pem, ca-bundle.crt"}},
		{"caRef names the other kind", map[string]string{"caRef": "Secret/openbao-ca"}, "ConfigMap", map[string]string{"ca.crt": ca},
			[]string{"no CA bundle found in the Secret openbao-ca"}},
		{"ca not pem", nil, "ConfigMap", map[string]string{"ca.crt": "not a certificate"}, []string{"ConfigMap openbao-ca key ca.crt", "no PEM certificate"}},
		{"ca truncated", nil, "Secret", map[string]string{"ca.pem": ca[:len(ca)-40]}, []string{"Secret openbao-ca key ca.pem"}},
		{"ca key block", nil, "Secret", map[string]string{"ca.crt": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"},
			[]string{"Secret openbao-ca key ca.crt", `type "PRIVATE KEY"`}},
		{"ca trailing junk", nil, "ConfigMap", map[string]string{"ca-bundle.crt": ca + "-----BEGIN CERT"},
			[]string{"ConfigMap openbao-ca key ca-bundle.crt", "after its last certificate"}},
		{"no token", map[string]string{"token": ""}, "", nil, []string{"ServiceAccount token (audience vault) key token", "does not exist"}},
		{"empty token", map[string]string{"token": "\n"}, "", nil, []string{"ServiceAccount token (audience vault) key token", "is empty"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := projectKeyBackend(t, nil, tc.caKind, tc.ca)
			files := maps.Clone(full)
			for k, v := range tc.edit {
				files[k] = v
				if v == "" {
					delete(files, k)
					os.Remove(filepath.Join(dir, k))
				}
			}
			if tc.ca == nil && files["caRef"] == "openbao-ca" {
				delete(files, "caRef") // the default; explicit, it asks for a bundle
			}
			writeFiles(t, dir, files)
			kb, err := loadKeyBackend(dir, false)
			if tc.want == nil {
				if err != nil || kb == nil {
					t.Fatalf("%+v, %v; want a key backend", kb, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted: %+v", kb)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "eyJhbGciOiJSUzI1NiJ9") {
				t.Errorf("error %q carries the token", err)
			}
		})
	}
}

func keyBackendSeed(t *testing.T, ca string) {
	var cm, caCM corev1.ConfigMap
	if err := yaml.UnmarshalStrict([]byte(seedKeyBackend), &cm); err != nil {
		t.Fatal(err)
	}
	indented := "    " + strings.ReplaceAll(strings.TrimSpace(ca), "\n", "\n    ") + "\n"
	if err := yaml.UnmarshalStrict([]byte(seedCA+indented), &caCM); err != nil {
		t.Fatal(err)
	}
	dir := projectKeyBackend(t, cm.Data, "ConfigMap", caCM.Data)
	kb, err := loadKeyBackend(dir, false)
	if err != nil || kb == nil {
		t.Fatalf("the seed's ConfigMaps: %v, %v", kb, err)
	}
	tc := kb.Transit
	if tc.Address != "https://openbao.example.net:8200" || tc.Mount != "transit-prod-1" || tc.KubernetesMount != "kubernetes-prod-1" ||
		tc.KubernetesRole != "vco-csi-node" || tc.CACertFile != filepath.Join(dir, "ca", "configmap", "ca.crt") ||
		tc.ServiceAccountTokenFile != filepath.Join(dir, "token") || tc.Token != "" || tc.Namespace != "" {
		t.Errorf("transit config %+v", tc)
	}
	if kb.Key.Name != DefaultTransitKey || kb.Key.Mount != "transit-prod-1" || kb.CASource != "ConfigMap openbao-ca key ca.crt" {
		t.Errorf("key %+v, CA from %q", kb.Key, kb.CASource)
	}
}

func keyBackendOurNames(t *testing.T, ca string) {
	dir := projectKeyBackend(t, map[string]string{"address": "https://openbao.example.net:8200/\n", "transit_key": "vco-csi-volumes",
		"role": "vco-csi-node", "transit_mount": "kv/transit", "auth_mount": "/k8s-prod/", "namespace": "team-a"}, "ConfigMap", map[string]string{"ca.crt": ca})
	kb, err := loadKeyBackend(dir, false)
	if err != nil || kb == nil {
		t.Fatalf("%v, %v", kb, err)
	}
	tc := kb.Transit
	if tc.Address != "https://openbao.example.net:8200" || tc.Mount != "kv/transit" || tc.KubernetesMount != "k8s-prod" ||
		tc.Namespace != "team-a" || tc.KubernetesRole != "vco-csi-node" || kb.Key.Name != "vco-csi-volumes" || kb.Key.Mount != "kv/transit" {
		t.Errorf("transit config %+v, key %+v", tc, kb.Key)
	}
}

func keyBackendDefaults(t *testing.T) {
	dir := projectKeyBackend(t, map[string]string{"address": "https://openbao.example.net:8200", "role": "r"}, "", nil)
	kb, err := loadKeyBackend(dir, false)
	if err != nil || kb == nil {
		t.Fatalf("%v, %v", kb, err)
	}
	if kb.Transit.Mount != "transit" || kb.Transit.KubernetesMount != "kubernetes" || kb.Transit.CACertFile != "" ||
		kb.Key.Mount != "transit" || kb.Key.Name != DefaultTransitKey || kb.CARef != DefaultCARef {
		t.Errorf("defaults %+v %+v %q", kb.Transit, kb.Key, kb.CARef)
	}
}

func keyBackendAuthPath(t *testing.T) {
	dir := projectKeyBackend(t, map[string]string{"address": "https://b:8200", "role": "r", "k8sAuthPath": "auth/kubernetes-prod-1/"}, "", nil)
	if kb, err := loadKeyBackend(dir, false); err != nil || kb.Transit.KubernetesMount != "kubernetes-prod-1" {
		t.Errorf("k8sAuthPath auth/kubernetes-prod-1/: %+v, %v; want the mount kubernetes-prod-1", kb, err)
	}
}

func keyBackendCA(t *testing.T, ca string) {
	base := map[string]string{"address": "https://b:8200", "role": "r"}
	for _, tc := range []struct {
		caRef, kind, key, want string
	}{
		{"", "ConfigMap", "ca.crt", "ConfigMap openbao-ca key ca.crt"},
		{"", "ConfigMap", "ca.pem", "ConfigMap openbao-ca key ca.pem"},
		{"", "ConfigMap", "ca-bundle.crt", "ConfigMap openbao-ca key ca-bundle.crt"},
		{"", "Secret", "ca.crt", "Secret openbao-ca key ca.crt"},
		{"openbao-ca", "Secret", "ca-bundle.crt", "Secret openbao-ca key ca-bundle.crt"},
		{"Secret/openbao-ca", "Secret", "ca.pem", "Secret openbao-ca key ca.pem"},
		{"configmap/openbao-ca", "ConfigMap", "ca.pem", "ConfigMap openbao-ca key ca.pem"},
		// Another object's name: the bundle delivered as openbao-ca.
		{"corp-root-ca", "ConfigMap", "ca.crt", "ConfigMap openbao-ca key ca.crt"},
	} {
		s := maps.Clone(base)
		if tc.caRef != "" {
			s["caRef"] = tc.caRef
		}
		dir := projectKeyBackend(t, s, tc.kind, map[string]string{tc.key: ca})
		kb, err := loadKeyBackend(dir, false)
		if err != nil || kb.CASource != tc.want || kb.Transit.CACertFile != filepath.Join(dir, "ca", strings.ToLower(tc.kind), tc.key) {
			t.Errorf("caRef %q, %s key %s: %+v, %v; want the CA from %s", tc.caRef, tc.kind, tc.key, kb, err, tc.want)
		}
	}
}

func keyBackendNone(t *testing.T, ca string) {
	// No ConfigMap yet (both are optional): only the token and the
	// CA are there, or the directory is not mounted at all.
	dir := projectKeyBackend(t, nil, "ConfigMap", map[string]string{"ca.crt": ca})
	for _, d := range []string{dir, filepath.Join(dir, "absent")} {
		if kb, err := loadKeyBackend(d, false); kb != nil || err != nil {
			t.Errorf("%s: %+v, %v; want no key backend and no error", d, kb, err)
		}
	}
}

// TestPluginRefusesBadSettingsAtStart runs the plugin's start with settings
// that must stop it, with the given words, before it listens or dials the
// agent. A bad key-backend ConfigMap is not one of them: see
// TestPartialKeyBackendKeepsPlainVolumes.
func TestPluginRefusesBadSettingsAtStart(t *testing.T) {
	dir := t.TempDir()
	kb := filepath.Join(dir, "key-backend")
	if err := os.Mkdir(kb, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFiles(t, dir, map[string]string{"jwt": "x"})
	writeFiles(t, kb, map[string]string{"address": "https://vault.example:8200", "role": "r", "token": "t"})
	sock := "unix://" + filepath.Join(dir, "csi.sock")
	ctl := []string{"--mode=controller", "--endpoint=" + sock, "--driver-name=cloud.whitesky.csi", "--token-file=" + filepath.Join(dir, "jwt")}
	node := []string{"--mode=node", "--endpoint=" + sock, "--driver-name=cloud.whitesky.csi", "--agent-socket=" + filepath.Join(dir, "absent.sock")}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{append(ctl, "--portal-url=https://try.whitesky.cloud", "--api-url=https://try.whitesky.cloud/api/1", "--customer=c", "--cloudspace=s"),
			"--portal-url and --api-url both given"},
		{append(ctl, "--portal-url=https://try.whitesky.cloud", "--customer=c"), "csi-driver-secret key cloudspace (--cloudspace) is empty"},
		{append(ctl, "--portal-url=https://try.whitesky.cloud/api/1", "--customer=c", "--cloudspace=s"), "csi-driver-secret key url"},
		{append(node, "--key-backend-dir="+kb, "--vault-addr=https://vault.example:8200"), "--key-backend-dir and --vault-addr"},
		{append(ctl, "--portal-url=http://try.whitesky.cloud", "--customer=c", "--cloudspace=s"), "csi-driver-secret key url (--portal-url) \"http://try.whitesky.cloud\" is plain http"},
		{append(ctl, "--api-url=http://try.whitesky.cloud/api/1", "--customer=c"), "--api-url \"http://try.whitesky.cloud/api/1\" is plain http"},
		{append(node, "--vault-addr=http://vault.example:8200"), "--vault-addr \"http://vault.example:8200\" is plain http"},
	} {
		out := captureStderr(t, func() {
			if rc := runPlugin(tc.args); rc != 1 {
				t.Errorf("%q: exit %d, want 1", tc.args, rc)
			}
		})
		if !strings.Contains(out, tc.want) {
			t.Errorf("%q: said %q, want %q", tc.args, out, tc.want)
		}
		if _, err := os.Stat(filepath.Join(dir, "csi.sock")); err == nil {
			t.Fatalf("%q: listened", tc.args)
		}
	}
}

// captureStderr returns what f writes to os.Stderr.
func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	tmp, err := os.CreateTemp(t.TempDir(), "stderr")
	if err != nil {
		t.Fatal(err)
	}
	defer tmp.Close()
	old := os.Stderr
	os.Stderr = tmp
	defer func() { os.Stderr = old }()
	f()
	b, err := os.ReadFile(tmp.Name())
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestSeedKeyBackendReachesTheTransitEngine: the seed's ConfigMaps, laid
// out as the DaemonSet projects them, make a transit client that trusts
// the CA of openbao-ca, logs in at the seed's k8sAuthPath with its role
// and wraps and unwraps with the default transit key in the seed's
// transitMount. The transit engine is the FAKE of crypt/transit/transittest
// (no Vault or OpenBao runs here), served over TLS.
func TestSeedKeyBackendReachesTheTransitEngine(t *testing.T) {
	fake := transittest.New()
	fake.AuthMount, fake.TransitMount, fake.Role = "kubernetes-prod-1", "transit-prod-1", "vco-csi-node"
	fake.Rotate(DefaultTransitKey)
	srv := httptest.NewTLSServer(fake)
	defer srv.Close()
	caPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}))

	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict([]byte(seedKeyBackend), &cm); err != nil {
		t.Fatal(err)
	}
	cm.Data["address"] = srv.URL // the seed's form, pointed at the fake
	for _, kind := range []string{"ConfigMap", "Secret"} {
		dir := projectKeyBackend(t, cm.Data, kind, map[string]string{"ca.crt": caPEM})
		writeFiles(t, dir, map[string]string{"token": fake.JWT})
		w, kb, err := nodeKeyBackend(dir, false)
		if err != nil || w == nil {
			t.Fatalf("%s openbao-ca: %v", kind, err)
		}
		ctx := context.Background()
		ct, err := w.Encrypt(ctx, kb.Key.Name, []byte("passphrase"))
		if err != nil {
			t.Fatalf("%s openbao-ca: wrap: %v", kind, err)
		}
		pt, err := w.Decrypt(ctx, kb.Key.Name, ct.Text)
		if err != nil || string(pt) != "passphrase" {
			t.Fatalf("%s openbao-ca: unwrap: %q %v", kind, pt, err)
		}
	}
	fake.Mu.Lock()
	defer fake.Mu.Unlock()
	for _, want := range []string{"POST /v1/auth/kubernetes-prod-1/login", "POST /v1/transit-prod-1/encrypt/vco-csi-volumes",
		"POST /v1/transit-prod-1/decrypt/vco-csi-volumes"} {
		if !slices.Contains(fake.Requests, want) {
			t.Errorf("the transit engine was not asked %s; it was asked %v", want, fake.Requests)
		}
	}
	// Without the CA the server's certificate is not trusted.
	dir := projectKeyBackend(t, map[string]string{"address": srv.URL, "role": "vco-csi-node", "k8sAuthPath": "kubernetes-prod-1",
		"transitMount": "transit-prod-1"}, "", nil)
	w, kb, err := nodeKeyBackend(dir, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Encrypt(context.Background(), kb.Key.Name, []byte("x")); err == nil {
		t.Error("a server whose CA is not in openbao-ca was trusted")
	}
}

// TestInsecureAllowHTTP: with --insecure-allow-http a plain http cloud API
// URL or key backend address to another host is accepted, and the start
// says so in warnings naming each; without it the key backend's address
// is a key backend problem, not an accepted setting.
func TestInsecureAllowHTTP(t *testing.T) {
	dir := t.TempDir()
	writeFiles(t, dir, map[string]string{"jwt": "eyJhbGciOiJFUzM4NCJ9.e30.c2ln", "vault-token": "hvs.t"})
	kb := filepath.Join(dir, "key-backend")
	if err := os.Mkdir(kb, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFiles(t, kb, map[string]string{"address": "http://10.0.2.100:8200", "role": "r", "token": "t"})
	sock := "unix://" + filepath.Join(dir, "csi.sock")
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--mode=controller", "--portal-url=http://10.0.2.100:8080", "--customer=c", "--cloudspace=s"},
			[]string{"INSECURE: --insecure-allow-http is set", "INSECURE: the cloud API is reached over plain http", "url=http://10.0.2.100:8080"}},
		{[]string{"--mode=controller", "--api-url=http://10.0.2.100:8080/api/1", "--customer=c"},
			[]string{"INSECURE: the cloud API is reached over plain http", "url=http://10.0.2.100:8080"}},
		{[]string{"--mode=node", "--vault-addr=http://10.0.2.100:8200", "--vault-token-file=" + filepath.Join(dir, "vault-token")},
			[]string{"INSECURE: the key backend is reached over plain http", "url=http://10.0.2.100:8200"}},
		{[]string{"--mode=node", "--key-backend-dir=" + kb},
			[]string{"INSECURE: the key backend is reached over plain http", "url=http://10.0.2.100:8200"}},
	} {
		args := append([]string{"--endpoint=" + sock, "--driver-name=cloud.whitesky.csi", "--token-file=" + filepath.Join(dir, "jwt"),
			"--agent-socket=" + filepath.Join(dir, "absent.sock"), "--insecure-allow-http"}, tc.args...)
		f, err := parsePluginFlags(args)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		cfg, _, _ := f.driverConfig(slog.New(slog.NewTextHandler(&out, nil)), metrics.New())
		if cfg.KeyBackendProblem != nil {
			t.Errorf("%q: key backend problem %v", tc.args, cfg.KeyBackendProblem)
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%q: log %q lacks %q", tc.args, out.String(), w)
			}
		}
		if !strings.Contains(out.String(), "level=WARN") {
			t.Errorf("%q: not a warning: %q", tc.args, out.String())
		}
	}
	// Without the option the key backend directory's http address is a
	// problem that names the key, and the plugin is not told otherwise.
	f, err := parsePluginFlags([]string{"--endpoint=" + sock, "--mode=node", "--driver-name=cloud.whitesky.csi", "--key-backend-dir=" + kb,
		"--agent-socket=" + filepath.Join(dir, "absent.sock")})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	cfg, _, _ := f.driverConfig(slog.New(slog.NewTextHandler(&out, nil)), metrics.New())
	if cfg.KeyBackendProblem == nil || !strings.Contains(cfg.KeyBackendProblem.Error(), `csi-key-backend-config key address "http://10.0.2.100:8200" is plain http`) {
		t.Errorf("key backend problem %v, want the address refused", cfg.KeyBackendProblem)
	}
	if cfg.Transit != nil || strings.Contains(out.String(), "INSECURE") {
		t.Errorf("the http address was used: %v\n%s", cfg.Transit, out.String())
	}
}
