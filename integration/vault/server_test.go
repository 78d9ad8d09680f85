package vault

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

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
	bin := cachedServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, err := Start(ctx, bin, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)

	out, err := s.CLI(ctx, "", "version")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(out), "Vault "+Version+" ") {
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
	if _, err := s.CLI(ctx, root, "write", "transit/decrypt/test", "ciphertext=vault:v1:"+base64.StdEncoding.EncodeToString([]byte("not a ciphertext of this key"))); err == nil {
		t.Fatal("decrypting a forged ciphertext succeeded")
	}

	if _, err := s.CLI(ctx, root, "auth", "enable", "kubernetes"); err != nil {
		t.Fatal(err)
	}
	out, err = s.CLI(ctx, root, "auth", "list", "-format=json")
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
