package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/vault"
)

// The fake engine vco-lab starts wraps and unwraps with the key the node
// plugin uses by default, for the token it hands out and no other, and
// says in its description that it is a fake.
func TestStartTransitFake(t *testing.T) {
	te, err := startTransit("fake", "")
	if err != nil {
		t.Fatal(err)
	}
	defer te.stop()
	if !strings.Contains(te.description, "FAKE") || !strings.Contains(te.description, "Vault/OpenBao") {
		t.Errorf("description %q does not say it is a fake standing in for Vault/OpenBao", te.description)
	}
	addr := fmt.Sprintf("http://127.0.0.1:%d", te.port)
	c, err := transit.New(transit.Config{Address: addr, Token: te.token})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ct, err := c.Encrypt(ctx, transitKey, []byte("volume passphrase"))
	if err != nil {
		t.Fatalf("encrypt with %s: %v", transitKey, err)
	}
	pt, err := c.Decrypt(ctx, transitKey, ct.Text)
	if err != nil || !bytes.Equal(pt, []byte("volume passphrase")) {
		t.Fatalf("decrypt: %q, %v", pt, err)
	}
	other, err := transit.New(transit.Config{Address: addr, Token: te.token + "x"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Decrypt(ctx, transitKey, ct.Text); err == nil {
		t.Error("the fake accepted a token it did not hand out")
	}
}

func TestStartTransitReal(t *testing.T) {
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte("hvs.secret-token-value\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	te, err := startTransit("http://127.0.0.1:8200", tok)
	if err != nil {
		t.Fatal(err)
	}
	if te.port != 8200 || te.token != "hvs.secret-token-value" {
		t.Errorf("port %d, token read %v", te.port, te.token == "hvs.secret-token-value")
	}
	if strings.Contains(te.description, "secret") {
		t.Errorf("the description carries the token: %q", te.description)
	}
	for _, bad := range []struct{ spec, tokenFile string }{
		{"http://10.0.0.5:8200", tok},            // not loopback: the lab sends nowhere else
		{"https://127.0.0.1:8200", tok},          // the guests' forward carries plain http
		{"http://127.0.0.1", tok},                // no port
		{"http://127.0.0.1:8200", ""},            // no token
		{"http://127.0.0.1:8200", tok + ".none"}, // unreadable token
		{"openbao", tok},                         // a word that names no engine
	} {
		if _, err := startTransit(bad.spec, bad.tokenFile); err == nil {
			t.Errorf("startTransit(%q, %q) accepted", bad.spec, bad.tokenFile)
		} else if strings.Contains(err.Error(), "secret-token-value") {
			t.Errorf("error text carries the token: %v", err)
		}
	}
	if te, err := startTransit("none", ""); te != nil || err != nil {
		t.Errorf("none: %+v, %v", te, err)
	}
}

// -transit vault starts the Vault server built from source (skipped
// unless its build is cached: make vault-prefetch) with TLS for the
// guests' address, and its token wraps with the node plugin's default key.
func TestStartTransitVault(t *testing.T) {
	if _, ok, err := vault.Cached(lab.DefaultCacheDir()); err != nil || !ok {
		t.Skipf("no Vault build in the cache (%v): make vault-prefetch", err)
	}
	te, err := startTransit("vault", "")
	if err != nil {
		t.Fatal(err)
	}
	defer te.stop()
	if !strings.Contains(te.description, "Vault "+vault.Version+" built from source") || len(te.ca) == 0 {
		t.Errorf("description %q, CA of %d bytes", te.description, len(te.ca))
	}
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, te.ca, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := transit.New(transit.Config{Address: fmt.Sprintf("https://127.0.0.1:%d", te.port), CACertFile: ca, Token: te.token})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ct, err := c.Encrypt(ctx, transitKey, []byte("volume passphrase"))
	if err != nil {
		t.Fatalf("encrypt with %s: %v", transitKey, err)
	}
	if pt, err := c.Decrypt(ctx, transitKey, ct.Text); err != nil || string(pt) != "volume passphrase" {
		t.Fatalf("decrypt: %q, %v", pt, err)
	}
}
