package vault

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// cachedServer returns the cached server binary, skipping the test unless
// VCO_VAULT is set and a build is in the cache.
func cachedServer(t *testing.T) string {
	t.Helper()
	if os.Getenv("VCO_VAULT") == "" {
		t.Skip("runs a Vault server built from source: run it with 'make test-vault' (sets VCO_VAULT=1)")
	}
	bin, ok, err := Cached(lab.DefaultCacheDir())
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Skipf("no Vault %s build in the cache (%s is absent): 'make vault-prefetch' builds it", Version, bin)
	}
	return bin
}

// jsonField runs the CLI with -format=json and returns data.<field> of
// its answer.
func jsonField(ctx context.Context, t *testing.T, s *Server, token, field string, args ...string) string {
	t.Helper()
	args = append([]string{args[0], "-format=json"}, args[1:]...)
	out, err := s.CLI(ctx, token, args...)
	if err != nil {
		t.Fatal(err)
	}
	var r struct {
		Data map[string]any `json:"data"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("vault %s: %v", args[0], err)
	}
	v, _ := r.Data[field].(string)
	if v == "" {
		t.Fatalf("vault %s: no data.%s in its answer", strings.Join(args[:2], " "), field)
	}
	return v
}

// TestServer runs the built server as an operator would, not in dev
// mode: file storage, TLS from the lab's CA on loopback, initialised with
// one key share, refusing work while sealed, unsealed; then the transit
// engine encrypts and decrypts and the Kubernetes auth method is enabled.
func TestServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, root, _ := unsealed(ctx, t, cachedServer(t))
	for _, args := range [][]string{{"secrets", "enable", "transit"}, {"write", "-f", "transit/keys/test"}} {
		if _, err := s.CLI(ctx, root, args...); err != nil {
			t.Fatal(err)
		}
	}
	plain := base64.StdEncoding.EncodeToString([]byte("a volume's passphrase"))
	ct := jsonField(ctx, t, s, root, "ciphertext", "write", "transit/encrypt/test", "plaintext="+plain)
	if !strings.HasPrefix(ct, "vault:v1:") || strings.Contains(ct, plain) {
		t.Fatalf("ciphertext %q: want vault:v1:..., not the plaintext", ct)
	}
	if got := jsonField(ctx, t, s, root, "plaintext", "write", "transit/decrypt/test", "ciphertext="+ct); got != plain {
		t.Fatalf("decrypt gave %q, want %q", got, plain)
	}
	forged := "ciphertext=vault:v1:" + base64.StdEncoding.EncodeToString([]byte("not a ciphertext of this key"))
	if _, err := s.CLI(ctx, root, "write", "transit/decrypt/test", forged); err == nil {
		t.Fatal("decrypting a forged ciphertext succeeded")
	}

	if _, err := s.CLI(ctx, root, "auth", "enable", "kubernetes"); err != nil {
		t.Fatal(err)
	}
	out, err := s.CLI(ctx, root, "auth", "list", "-format=json")
	if err != nil {
		t.Fatal(err)
	}
	var mounts map[string]struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(out, &mounts); err != nil {
		t.Fatal(err)
	}
	if mounts["kubernetes/"].Type != "kubernetes" {
		t.Fatalf("auth list: %s; want kubernetes/ of type kubernetes", out)
	}
}

// unsealed starts the server in a directory of the test's own and takes
// it from uninitialised and sealed to unsealed, checking each state and
// that a sealed server refuses work; it returns the root token and the
// unseal key.
func unsealed(ctx context.Context, t *testing.T, bin string) (*Server, string, string) {
	t.Helper()
	s, err := Start(ctx, bin, t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	out, err := s.CLI(ctx, "", "version")
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(out)); len(f) < 2 || f[0] != "Vault" || f[1] != Version {
		t.Fatalf("vault version = %q, want Vault %s", out, Version)
	}
	if st, err := s.Status(ctx); err != nil || st.Initialized || !st.Sealed {
		t.Fatalf("a new server: %+v, %v; want uninitialised and sealed", st, err)
	}
	key, root, err := s.Init(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := s.Status(ctx); err != nil || !st.Initialized || !st.Sealed {
		t.Fatalf("after init: %+v, %v; want initialised and sealed", st, err)
	}
	if _, err := s.CLI(ctx, root, "secrets", "enable", "transit"); err == nil || !strings.Contains(err.Error(), "sealed") {
		t.Fatalf("enabling transit on a sealed server: %v, want a refusal naming the seal", err)
	}
	if err := s.Unseal(ctx, key); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Status(ctx); err != nil || st.Sealed {
		t.Fatalf("after unseal: %+v, %v; want unsealed", st, err)
	}
	return s, root, key
}

// TestTransitClient runs the product's transit client (crypt/transit)
// against the real server, with a token: wrap, unwrap, and after the key's
// rotation a rewrap to the new version while the old wrap still unwraps;
// raising min_decryption_version past the old wrap makes its unwrap fail
// with the server's refusal.
func TestTransitClient(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, root, _ := unsealed(ctx, t, cachedServer(t))
	const mount, key = "transit-lab", "vco-csi-volumes"
	for _, args := range [][]string{{"secrets", "enable", "-path=" + mount, "transit"}, {"write", "-f", mount + "/keys/" + key}} {
		if _, err := s.CLI(ctx, root, args...); err != nil {
			t.Fatal(err)
		}
	}
	c, err := transit.New(transit.Config{Address: s.Addr, CACertFile: s.CACert, Mount: mount, Token: root})
	if err != nil {
		t.Fatal(err)
	}
	secret := []byte("a volume's passphrase")
	v1, err := c.Encrypt(ctx, key, secret)
	if err != nil || v1.Version != 1 {
		t.Fatalf("Encrypt: %+v, %v; want version 1", v1, err)
	}
	if _, err := s.CLI(ctx, root, "write", "-f", mount+"/keys/"+key+"/rotate"); err != nil {
		t.Fatal(err)
	}
	v2, err := c.Rewrap(ctx, key, v1.Text)
	if err != nil || v2.Version != 2 {
		t.Fatalf("Rewrap after rotation: %+v, %v; want version 2", v2, err)
	}
	for _, ct := range []transit.Ciphertext{v1, v2} {
		if pt, err := c.Decrypt(ctx, key, ct.Text); err != nil || string(pt) != string(secret) {
			t.Fatalf("Decrypt of version %d: %q, %v", ct.Version, pt, err)
		}
	}
	if _, err := s.CLI(ctx, root, "write", mount+"/keys/"+key+"/config", "min_decryption_version=2"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Decrypt(ctx, key, v1.Text)
	var te *transit.Error
	if !errors.As(err, &te) || !te.TooOld() {
		t.Fatalf("Decrypt of version 1 below min_decryption_version 2: %v, want the server's 400 taken for a version too old", err)
	}
	if pt, err := c.Decrypt(ctx, key, v2.Text); err != nil || string(pt) != string(secret) {
		t.Fatalf("Decrypt of version 2: %q, %v", pt, err)
	}
}

// TestTransitClientSealedAndUnreachable: the client's errors against a
// sealed server and a stopped one are the ones the node plugin explains
// (csi/driver: sealed, no answer); started again it is sealed until
// unsealed, and still holds its key.
func TestTransitClientSealedAndUnreachable(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, root, key := unsealed(ctx, t, cachedServer(t))
	for _, args := range [][]string{{"secrets", "enable", "transit"}, {"write", "-f", "transit/keys/k"}} {
		if _, err := s.CLI(ctx, root, args...); err != nil {
			t.Fatal(err)
		}
	}
	c, err := transit.New(transit.Config{Address: s.Addr, CACertFile: s.CACert, Mount: "transit", Token: root, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ct, err := c.Encrypt(ctx, "k", []byte("p"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CLI(ctx, root, "operator", "seal"); err != nil {
		t.Fatal(err)
	}
	var te *transit.Error
	if _, err := c.Decrypt(ctx, "k", ct.Text); !errors.As(err, &te) || !te.Sealed() || te.Unanswered() {
		t.Fatalf("Decrypt against the sealed server: %v, want an answer saying sealed", err)
	}
	s.Stop()
	if _, err := c.Decrypt(ctx, "k", ct.Text); !errors.As(err, &te) || !te.Unanswered() || te.Sealed() {
		t.Fatalf("Decrypt against the stopped server: %v, want no answer", err)
	}
	// Started again, it is sealed until unsealed, and its key is kept.
	if err := s.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Status(ctx); err != nil || !st.Sealed {
		t.Fatalf("after a restart: %+v, %v; want sealed", st, err)
	}
	if err := s.Unseal(ctx, key); err != nil {
		t.Fatal(err)
	}
	if pt, err := c.Decrypt(ctx, "k", ct.Text); err != nil || string(pt) != "p" {
		t.Fatalf("Decrypt after the restart: %q, %v", pt, err)
	}
}

// TestStartTransit: the lab's key backend without Kubernetes: its token
// wraps, unwraps and rewraps with its key, and nothing else.
func TestStartTransit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tr, err := StartTransit(ctx, cachedServer(t), t.TempDir(), Options{Hosts: []string{"10.0.2.100"}}, "transit", "vco-volumes")
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Stop()
	c, err := transit.New(transit.Config{Address: tr.Addr, CACertFile: tr.CACert, Mount: tr.Mount, Token: tr.Token})
	if err != nil {
		t.Fatal(err)
	}
	ct, err := c.Encrypt(ctx, tr.Key, []byte("p"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Rewrap(ctx, tr.Key, ct.Text); err != nil {
		t.Fatalf("rewrap with the lab's token: %v", err)
	}
	if pt, err := c.Decrypt(ctx, tr.Key, ct.Text); err != nil || string(pt) != "p" {
		t.Fatalf("decrypt: %q, %v", pt, err)
	}
	var te *transit.Error
	if _, err := c.Encrypt(ctx, "another-key", []byte("p")); !errors.As(err, &te) || te.Status != 403 {
		t.Fatalf("encrypt with a key the policy does not name: %v, want 403", err)
	}
}
