package transit

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
)

// tlsFake starts the fake transit engine behind TLS with its own CA and
// returns a config trusting that CA and logging in with Kubernetes auth.
func tlsFake(t *testing.T) (*transittest.Fake, Config) {
	t.Helper()
	f := transittest.New()
	srv := httptest.NewTLSServer(f)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	cert := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(ca, cert, 0o600); err != nil {
		t.Fatal(err)
	}
	sa := filepath.Join(dir, "token")
	if err := os.WriteFile(sa, []byte(f.JWT+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	f.Rotate("volumes")
	return f, Config{Address: srv.URL, CACertFile: ca, KubernetesRole: f.Role, ServiceAccountTokenFile: sa, Timeout: 5 * time.Second}
}

func TestWrapUnwrapRewrapWithKubernetesAuth(t *testing.T) {
	f, cfg := tlsFake(t)
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	secret := []byte("random volume passphrase \x00\xff")
	ct, err := c.Encrypt(ctx, "volumes", secret)
	if err != nil {
		t.Fatal(err)
	}
	if ct.Version != 1 || !strings.HasPrefix(ct.Text, "vault:v1:") {
		t.Fatalf("ciphertext %+v", ct)
	}
	pt, err := c.Decrypt(ctx, "volumes", ct.Text)
	if err != nil || !bytes.Equal(pt, secret) {
		t.Fatalf("Decrypt: %q %v", pt, err)
	}
	f.Rotate("volumes")
	re, err := c.Rewrap(ctx, "volumes", ct.Text)
	if err != nil || re.Version != 2 || !strings.HasPrefix(re.Text, "vault:v2:") {
		t.Fatalf("Rewrap: %+v %v", re, err)
	}
	f.MinDecryptionVersion["volumes"] = 2
	if _, err := c.Decrypt(ctx, "volumes", ct.Text); err == nil || !strings.Contains(err.Error(), "disallowed by policy") {
		t.Fatalf("old ciphertext after min_decryption_version: %v", err)
	}
	if pt, err := c.Decrypt(ctx, "volumes", re.Text); err != nil || !bytes.Equal(pt, secret) {
		t.Fatalf("rewrapped: %v", err)
	}
	if f.Logins != 1 {
		t.Fatalf("%d logins for one client", f.Logins)
	}
	if f.Requests[0] != "POST /v1/auth/kubernetes/login" {
		t.Fatalf("first request %s", f.Requests[0])
	}
}

func TestTokenRenewalAndRelogin(t *testing.T) {
	f, cfg := tlsFake(t)
	var mu sync.Mutex
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	f.Now = clock
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.now = clock
	ctx := context.Background()
	if _, err := c.Encrypt(ctx, "volumes", []byte("a")); err != nil {
		t.Fatal(err)
	}
	// Past half the lease: the client renews before the request.
	advance(40 * time.Minute)
	if _, err := c.Encrypt(ctx, "volumes", []byte("a")); err != nil {
		t.Fatal(err)
	}
	if f.Renewals != 1 || f.Logins != 1 {
		t.Fatalf("renewals %d logins %d", f.Renewals, f.Logins)
	}
	// Past the whole lease: a fresh login.
	advance(2 * time.Hour)
	if _, err := c.Encrypt(ctx, "volumes", []byte("a")); err != nil {
		t.Fatal(err)
	}
	if f.Logins != 2 {
		t.Fatalf("logins %d after expiry", f.Logins)
	}
	// Revoked on the server while the client thinks it valid: one re-login
	// and a retry.
	f.Mu.Lock()
	f.Tokens = map[string]time.Time{}
	f.Mu.Unlock()
	if _, err := c.Encrypt(ctx, "volumes", []byte("a")); err != nil {
		t.Fatal(err)
	}
	if f.Logins != 3 {
		t.Fatalf("logins %d after revocation", f.Logins)
	}
}

// Errors name the server, the operation and the key, and carry the
// server's message; no secret sent in the request appears in them.
func TestErrorsNameAddressAndKeyNeverSecrets(t *testing.T) {
	f, cfg := tlsFake(t)
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	secret := []byte("s3cret-passphrase")
	_, err = c.Encrypt(ctx, "missing-key", secret)
	var te *Error
	if !errors.As(err, &te) || te.Status != 400 {
		t.Fatalf("unknown key: %v", err)
	}
	msg := err.Error()
	for _, want := range []string{cfg.Address, "encrypt", `"missing-key"`, "encryption key not found"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	if _, err := c.Decrypt(ctx, "volumes", "vault:v1:AAAA"); err == nil || !strings.Contains(err.Error(), "invalid ciphertext") {
		t.Fatalf("bad ciphertext: %v", err)
	}

	// Wrong ServiceAccount token: a login error naming the role, not the JWT.
	bad := cfg
	bad.ServiceAccountTokenFile = filepath.Join(t.TempDir(), "sa")
	os.WriteFile(bad.ServiceAccountTokenFile, []byte("eyJ.other-jwt.sig"), 0o600)
	c2, _ := New(bad)
	_, err = c2.Encrypt(ctx, "volumes", secret)
	if !errors.As(err, &te) || te.Status != 403 || !strings.Contains(err.Error(), "kubernetes login") || !strings.Contains(err.Error(), "vco-node") {
		t.Fatalf("bad JWT: %v", err)
	}
	// Static token rejected.
	st := cfg
	st.Token, st.KubernetesRole = "hvs.not-a-real-token", ""
	c3, _ := New(st)
	_, err = c3.Encrypt(ctx, "volumes", secret)
	if !errors.As(err, &te) || te.Status != 403 {
		t.Fatalf("bad static token: %v", err)
	}
	all := strings.Join([]string{msg, err.Error()}, "\n")
	for _, s := range []string{string(secret), f.JWT, "eyJ.other-jwt.sig", "hvs.not-a-real-token", "hvs.fake"} {
		if strings.Contains(all, s) {
			t.Fatalf("an error text carries a secret %q: %s", s, all)
		}
	}
	// The JWT did go to the login endpoint, and only there.
	for i, b := range f.Bodies {
		if strings.Contains(b, f.JWT) && f.Requests[i] != "POST /v1/auth/kubernetes/login" {
			t.Fatalf("JWT sent to %s", f.Requests[i])
		}
	}
}

func TestUntrustedCAIsRefused(t *testing.T) {
	_, cfg := tlsFake(t)
	cfg.CACertFile = ""
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Encrypt(context.Background(), "volumes", []byte("x"))
	if err == nil || !strings.Contains(err.Error(), "certificate") || !strings.Contains(err.Error(), cfg.Address) {
		t.Fatalf("server with an unknown CA: %v", err)
	}
}

func TestTimeout(t *testing.T) {
	f, cfg := tlsFake(t)
	f.Delay = 2 * time.Second
	cfg.Timeout = 200 * time.Millisecond
	cfg.Token, cfg.KubernetesRole = "hvs.static", ""
	f.StaticToken("hvs.static")
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = c.Encrypt(context.Background(), "volumes", []byte("x"))
	if err == nil || !strings.Contains(err.Error(), "Timeout") && !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("slow server: %v", err)
	}
	if time.Since(start) > 1500*time.Millisecond {
		t.Fatal("the request was not cut at the timeout")
	}
	if strings.Contains(err.Error(), "hvs.static") {
		t.Fatal("token in error")
	}
}

func TestConfigErrors(t *testing.T) {
	for _, cfg := range []Config{
		{Address: "vault:8200", Token: "t"},
		{Address: "https://vault:8200"},
		{Address: "https://vault:8200", Token: "t", CACertFile: "/nonexistent/ca.pem"},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

func TestParseVersion(t *testing.T) {
	for in, want := range map[string]int{"vault:v1:abc": 1, "vault:v12:x": 12, "vault:v0:x": 0, "v1:abc": 0, "vault:x1:a": 0} {
		got, err := ParseVersion(in)
		if got != want || (want == 0) != (err != nil) {
			t.Errorf("ParseVersion(%q) = %d, %v", in, got, err)
		}
	}
}

// Against a real Vault or OpenBao, when one is configured.
func TestRealVault(t *testing.T) {
	addr := os.Getenv("VCO_TEST_VAULT_ADDR")
	if addr == "" {
		t.Skip("VCO_TEST_VAULT_ADDR is not set: no real Vault/OpenBao to test against (set it with VCO_TEST_VAULT_TOKEN and optionally VCO_TEST_VAULT_KEY, VCO_TEST_VAULT_CACERT)")
	}
	key := os.Getenv("VCO_TEST_VAULT_KEY")
	if key == "" {
		key = "vco-test"
	}
	c, err := New(Config{Address: addr, Token: os.Getenv("VCO_TEST_VAULT_TOKEN"), CACertFile: os.Getenv("VCO_TEST_VAULT_CACERT"), Mount: os.Getenv("VCO_TEST_VAULT_MOUNT")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ct, err := c.Encrypt(ctx, key, []byte("real vault round trip"))
	if err != nil {
		t.Fatal(err)
	}
	pt, err := c.Decrypt(ctx, key, ct.Text)
	if err != nil || string(pt) != "real vault round trip" {
		t.Fatalf("Decrypt: %q %v", pt, err)
	}
	re, err := c.Rewrap(ctx, key, ct.Text)
	if err != nil || re.Version < ct.Version {
		t.Fatalf("Rewrap: %+v %v", re, err)
	}
}

// The fake's Review hook stands where a real Kubernetes auth method asks
// the cluster's TokenReview API: the token it is given is the one the
// client read from its ServiceAccount token file, and its verdict decides
// the login.
func TestLoginJudgedByTheReviewHook(t *testing.T) {
	f, cfg := tlsFake(t)
	var reviewed []string
	f.Review = func(jwt, role string) error {
		reviewed = append(reviewed, role+" "+jwt)
		if jwt != "reviewed.good.jwt" {
			return errors.New("token review: not authenticated")
		}
		return nil
	}
	if err := os.WriteFile(cfg.ServiceAccountTokenFile, []byte("reviewed.good.jwt\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.Encrypt(ctx, "volumes", []byte("x")); err != nil {
		t.Fatalf("a token the review accepts: %v", err)
	}
	if len(reviewed) != 1 || reviewed[0] != f.Role+" reviewed.good.jwt" {
		t.Fatalf("reviewed %q", reviewed)
	}
	// f.JWT is no longer what counts.
	if err := os.WriteFile(cfg.ServiceAccountTokenFile, []byte(f.JWT+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Encrypt(ctx, "volumes", []byte("x")); err == nil || !strings.Contains(err.Error(), "403") && !strings.Contains(err.Error(), "denied") {
		t.Fatalf("a token the review refuses: %v", err)
	}
}

// pieces are the runs of a token that must not reach an error text: each
// of its parts of 4 bytes or more and every 8-byte window across it.
func pieces(tok string) []string {
	var p []string
	for _, part := range strings.Split(tok, ".") {
		if len(part) >= 4 {
			p = append(p, part)
		}
	}
	for i := 0; i+8 <= len(tok); i++ {
		p = append(p, tok[i:i+8])
	}
	return p
}

// TestEchoCutShortKeepsNoPieceOfTheJWT: a proxy that answers the login
// with an error echoing the request body cut short, the ServiceAccount
// JWT cut anywhere, leaves no piece of the JWT in the error.
func TestEchoCutShortKeepsNoPieceOfTheJWT(t *testing.T) {
	const jwt = "eyJhbGciOiJSUzI1NiIsImtpZCI6Im5vZGUifQ.eyJhdWQiOlsidmF1bHQiXSwic3ViIjoic3lzdGVtOnNlcnZpY2VhY2NvdW50In0.c2lnbmF0dXJlLW9mLXRoZS1zZXJ2aWNlYWNjb3VudC10b2tlbg"
	var cut atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		b = b[:min(int(cut.Load()), len(b))]
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string][]string{"errors": {"proxy: malformed request " + string(b)}})
	}))
	defer srv.Close()
	sa := filepath.Join(t.TempDir(), "token")
	os.WriteFile(sa, []byte(jwt), 0o600)
	c, err := New(Config{Address: srv.URL, KubernetesRole: "vco-node", ServiceAccountTokenFile: sa, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	before := len(`{"jwt":"`)
	for n := before + len("eyJ") + 4; n <= before+len(jwt); n++ {
		cut.Store(int64(n))
		err := c.Login(context.Background())
		if err == nil || !strings.Contains(err.Error(), "proxy: malformed request") {
			t.Fatalf("echo cut at %d: %v, want the proxy's error", n, err)
		}
		for _, p := range pieces(jwt[:n-before]) {
			if strings.Contains(err.Error(), p) {
				t.Fatalf("echo cut at %d: %q of the JWT is in the error: %v", n, p, err)
			}
		}
	}
}

// TestHTTPOnlyToLoopback: a vault address of plain http to another host is
// refused unless InsecureAllowHTTP says otherwise; to a loopback address
// it is accepted.
func TestHTTPOnlyToLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr     string
		insecure bool
		refused  bool
	}{
		{"http://openbao.example.net:8200", false, true},
		{"http://10.0.2.100:8200", false, true},
		{"http://10.0.2.100:8200", true, false},
		{"http://127.0.0.1:8200", false, false},
		{"http://[::1]:8200", false, false},
		{"http://localhost:8200", false, false},
		{"https://openbao.example.net:8200", false, false},
	} {
		_, err := New(Config{Address: tc.addr, Token: "hvs.t", InsecureAllowHTTP: tc.insecure})
		if tc.refused != (err != nil) || tc.refused && !strings.Contains(err.Error(), "not a loopback address") {
			t.Errorf("%s (insecure %v): %v, want refused %v", tc.addr, tc.insecure, err, tc.refused)
		}
	}
}

// TestRedirectToHTTPCarriesNothing: an https server that redirects (307,
// 308: headers and body resent) to plain http, here on the same loopback
// host, is not followed; the http server never sees the token or the
// passphrase.
func TestRedirectToHTTPCarriesNothing(t *testing.T) {
	var seen atomic.Value
	seen.Store("")
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen.Store("token " + r.Header.Get("X-Vault-Token") + " body " + string(b))
		w.WriteHeader(http.StatusForbidden)
	}))
	defer plain.Close()
	for _, code := range []int{http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, plain.URL+r.URL.Path, code)
		}))
		defer srv.Close()
		ca := filepath.Join(t.TempDir(), "ca.pem")
		os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600)
		c, err := New(Config{Address: srv.URL, Token: "hvs.redirected-token", CACertFile: ca, Timeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Encrypt(context.Background(), "volumes", []byte("passphrase"))
		if err == nil || !strings.Contains(err.Error(), "refused a redirect from "+srv.URL+" to "+plain.URL) {
			t.Errorf("HTTP %d to http: %v, want the redirect refused", code, err)
		}
		if s := seen.Load().(string); s != "" {
			t.Fatalf("HTTP %d: the http server got a request with %s", code, s)
		}
	}
}
