package agentnodetest

import (
	"log/slog"
	"net"
	"net/http/httptest"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
)

// ServeAgent serves vco-agent's real API for m on the unix socket sock, as
// the daemon does (any caller of this process's uid is let in), and returns
// the node plugin's client dialled to it with o. A nil log discards the
// server's lines. Everything stops when t ends.
func ServeAgent(t testing.TB, sock string, m *volume.Manager, id server.NodeIdentity, log *slog.Logger, o agentnode.Options) *agentnode.Agent {
	t.Helper()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := server.New(server.Options{Version: "test", Policy: peercred.Policy{GID: -1}, Volumes: m, Log: log, Identity: id}).NewGRPC()
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	a, err := agentnode.Dial(sock, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// Transit serves a FAKE Vault transit engine (transittest: no Vault or
// OpenBao runs here) holding the key vco-volumes, and returns a client
// logged in to it with a static token, and the fake for tests that look
// at what it was asked.
func Transit(t testing.TB) (*transit.Client, *transittest.Fake) {
	t.Helper()
	f := transittest.New()
	f.Rotate("vco-volumes")
	f.StaticToken("node-token")
	hs := httptest.NewServer(f)
	t.Cleanup(hs.Close)
	c, err := transit.New(transit.Config{Address: hs.URL, Token: "node-token"})
	if err != nil {
		t.Fatal(err)
	}
	return c, f
}
