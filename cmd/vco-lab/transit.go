package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/vault"
)

// transitKey is the key the node plugin wraps new volumes' passphrases
// with by default (vco-csi --vault-transit-key).
const transitKey = "vco-volumes"

// transitEngine is the transit engine E6 wraps passphrases with: where it
// listens on the host, a token it accepts, and what it is, for the report.
type transitEngine struct {
	port        int
	token       string
	ca          []byte // the PEM of the engine's CA when it speaks TLS
	description string
	stop        func()
}

// startTransit gives the story its transit engine. "vault" starts the
// Vault server built from source (integration/vault; built first unless
// cached) on 127.0.0.1 with TLS, set up with transit key vco-volumes and
// a token allowed exactly that key. "fake" (the default) starts the FAKE
// engine of crypt/transit/transittest on 127.0.0.1; "none"
// leaves E6 out; a URL names a real Vault/OpenBao, which must listen on
// 127.0.0.1 (the guests reach the host's loopback only; forward a remote
// server with a tunnel) and have a transit key vco-volumes, with a token
// from tokenFile. The token is never printed.
func startTransit(spec, tokenFile string) (*transitEngine, error) {
	switch spec {
	case "none", "":
		return nil, nil
	case "vault":
		return startVault()
	case "fake":
		fake := transittest.New()
		fake.Rotate(transitKey)
		b := make([]byte, 16)
		if _, err := rand.Read(b); err != nil {
			return nil, err
		}
		tok := "lab-" + hex.EncodeToString(b)
		fake.StaticToken(tok)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("listening for the fake transit engine: %w", err)
		}
		srv := &http.Server{Handler: fake, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		port := ln.Addr().(*net.TCPAddr).Port
		return &transitEngine{port: port, token: tok, stop: func() { _ = srv.Close() },
			description: fmt.Sprintf("FAKE transit engine (crypt/transit/transittest) on 127.0.0.1:%d, standing in for Vault/OpenBao", port)}, nil
	}
	u, err := url.Parse(spec)
	if err != nil || u.Scheme != "http" {
		// The guests' node plugins reach the engine through a plain TCP
		// forward and speak http to it.
		return nil, fmt.Errorf("-transit %q: want fake, none, or http://127.0.0.1:PORT of a Vault/OpenBao", spec)
	}
	if u.Hostname() != "127.0.0.1" {
		return nil, fmt.Errorf("-transit %s: the lab sends traffic to 127.0.0.1 only; forward the server to a port there (e.g. ssh -L) and give http://127.0.0.1:PORT", spec)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		return nil, fmt.Errorf("-transit %s: no port", spec)
	}
	if tokenFile == "" {
		return nil, fmt.Errorf("-transit %s needs -transit-token-file: a file holding a token allowed to encrypt and decrypt with transit key %s", spec, transitKey)
	}
	b, err := os.ReadFile(tokenFile)
	if err != nil {
		return nil, fmt.Errorf("reading the transit token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return nil, fmt.Errorf("the transit token file %s is empty", tokenFile)
	}
	return &transitEngine{port: port, token: tok, stop: func() {},
		description: fmt.Sprintf("Vault/OpenBao transit engine at %s (key %s)", spec, transitKey)}, nil
}

// startVault is startTransit's "vault".
func startVault() (*transitEngine, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Minute)
	defer cancel()
	bin, err := vault.Build(ctx, lab.DefaultCacheDir(), os.Stderr)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "vco-lab-vault-")
	if err != nil {
		return nil, err
	}
	t, err := vault.StartTransit(ctx, bin, dir, vault.Options{Hosts: []string{"10.0.2.100"}}, "transit", transitKey)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ca, err := os.ReadFile(t.CACert)
	if err != nil {
		t.Stop()
		os.RemoveAll(dir)
		return nil, err
	}
	u, _ := url.Parse(t.Addr)
	port, _ := strconv.Atoi(u.Port())
	return &transitEngine{port: port, token: t.Token, ca: ca, description: t.Describe(),
		stop: func() { t.Stop(); os.RemoveAll(dir) }}, nil
}
