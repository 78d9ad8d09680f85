package reliability

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// forms are the ways a secret could show up in text: as is, in base64
// (how proto JSON and our LUKS2 tokens carry bytes) and in hex.
func forms(secret string) []string {
	f := []string{secret, base64.StdEncoding.EncodeToString([]byte(secret)), base64.RawURLEncoding.EncodeToString([]byte(secret)), hex.EncodeToString([]byte(secret))}
	// A JWT's signature alone is a secret too.
	if i := strings.LastIndexByte(secret, '.'); i > 0 && len(secret)-i > 8 {
		f = append(f, secret[i+1:])
	}
	return f
}

// leaks names every place in texts where a form of secret appears.
func leaks(secret string, texts map[string]string) []string {
	var out []string
	for where, text := range texts {
		for _, f := range forms(secret) {
			if strings.Contains(text, f) {
				out = append(out, where)
				break
			}
		}
	}
	return out
}

// TestPassphraseNeverShown pushes an encryption passphrase through the
// agent's stage path, the success path and every refusal, and searches
// the gRPC errors, the agent's log at debug level, the event ring, the
// metrics text, the disk listing and the state directory for it.
func TestPassphraseNeverShown(t *testing.T) {
	h := newHost(t)
	h.start()
	const pass = "pp-Gx7Q2vT9-correct-horse-battery"
	staging := kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "enc")
	enc := &api.Encryption{Passphrase: []byte(pass), FormatIfBlank: true}
	texts := map[string]string{}
	reqs := map[string]*api.StageVolumeRequest{
		"encrypted stage":   {VolumeId: "enc-1", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: staging, Encryption: enc, AllowUnfenced: true},
		"unknown disk":      {VolumeId: "enc-2", Device: &api.DeviceLocator{Serial: "nope"}, StagingPath: staging, Encryption: enc, AllowUnfenced: true},
		"bad path":          {VolumeId: "enc-3", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: "/etc/" + pass, Encryption: enc, AllowUnfenced: true},
		"bad fs type":       {VolumeId: "enc-4", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: staging, FsType: "zfs", Encryption: enc, AllowUnfenced: true},
		"without opt-in":    {VolumeId: "enc-5", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: staging, Encryption: enc},
		"bad grant":         {VolumeId: "enc-6", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: staging, Encryption: enc, Grant: &api.TakeoverGrant{Disk: "d"}},
		"block with fstype": {VolumeId: "enc-7", Device: &api.DeviceLocator{LoopBackingFile: h.img}, StagingPath: staging, Block: true, FsType: "xfs", Encryption: enc, AllowUnfenced: true},
	}
	for name, r := range reqs {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_, err := h.c.StageVolume(ctx, r)
		cancel()
		texts["error of "+name] = fmt.Sprint(err) + " " + status.Convert(err).Message()
	}
	// The path in "bad path" carries the passphrase on purpose: that the
	// agent repeats a path it was given is fine. Drop that one error and
	// search everything else, including the log lines about it.
	delete(texts, "error of bad path")
	ctx := context.Background()
	evs, err := h.c.ListRecentEvents(ctx, &api.ListRecentEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	texts["events"] = fmt.Sprint(evs)
	disks, err := h.c.ListDisks(ctx, &api.ListDisksRequest{})
	if err == nil {
		texts["disks"] = fmt.Sprint(disks)
	}
	texts["metrics"] = h.scrapeMetrics()
	filepath.WalkDir(h.state, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			b, _ := os.ReadFile(p)
			texts["state file "+p] = string(b)
		}
		return nil
	})
	// The log may quote the bad path; everything else in it counts.
	var logLines []string
	for _, l := range strings.Split(h.log(), "\n") {
		if !strings.Contains(l, "/etc/"+pass) {
			logLines = append(logLines, l)
		}
	}
	texts["agent log"] = strings.Join(logLines, "\n")
	if l := leaks(pass, texts); len(l) > 0 {
		t.Fatalf("the passphrase appears in: %v", l)
	}
	figures.add("secret paths searched for the passphrase, JWT and vault token", len(texts))
}

// TestJWTNeverShown runs CSI controller calls through answers that echo
// the request's credential (a misconfigured proxy does that) and through a
// rejected credential, and searches the errors and the plugin's log.
func TestJWTNeverShown(t *testing.T) {
	e := newCSIEnv(t)
	texts := map[string]string{}
	for i, code := range []int{500, 403, 401, 400, 404} {
		e.proxy.set(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo, f.echoAuth = 20, "* /", code, true })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := e.ctrl.CreateVolume(ctx, createReq(fmt.Sprintf("pvc-secret-%d", i), 1))
		cancel()
		texts[fmt.Sprintf("error under %d", code)] = fmt.Sprint(err)
		ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
		_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "ch-lug-1/100"})
		cancel()
		texts[fmt.Sprintf("delete error under %d", code)] = fmt.Sprint(err)
	}
	e.proxy.set(func(f *faultProxy) { f.burst, f.echoAuth = 0, false })
	e.logMu.Lock()
	texts["plugin log"] = e.logs.String()
	e.logMu.Unlock()
	if l := leaks(testJWT, texts); len(l) > 0 {
		t.Fatalf("the JWT appears in: %v\n%v", l, texts)
	}
	for k, v := range texts {
		if strings.HasPrefix(k, "error") && v == "<nil>" {
			t.Errorf("%s: the call succeeded; the echoing answers were not reached", k)
		}
	}
	figures.add("secret paths searched for the passphrase, JWT and vault token", len(texts))
}

// pieces are the runs of a token that must not show anywhere, whole or
// cut short: each dot-separated part of 4 bytes or more (a JWT's header,
// payload and signature) and every 8 bytes in a row of it.
func pieces(secret string) []string {
	var p []string
	for _, part := range strings.Split(secret, ".") {
		if len(part) >= 4 {
			p = append(p, part)
		}
	}
	for i := 0; i+8 <= len(secret); i++ {
		p = append(p, secret[i:i+8])
	}
	return p
}

// pieceLeaks names every place in texts where a piece of secret appears,
// with the piece.
func pieceLeaks(secret string, texts map[string]string) []string {
	var out []string
	for where, text := range texts {
		for _, p := range pieces(secret) {
			if strings.Contains(text, p) {
				out = append(out, fmt.Sprintf("%s (%q)", where, p))
				break
			}
		}
	}
	return out
}

// TestEchoedHeadersKeepNoPieceOfAToken puts hostile proxies in front of
// both APIs. In front of the cloud API, error pages echo every request
// header with the JWT starting at each byte from where it ends just
// before the 200th, where the client cuts an echoed page, to where it
// starts just before it; CSI calls go through them. In front of the key
// backend, Vault-shaped errors echo the request's headers and body cut
// short at each byte of the Vault token and of the ServiceAccount JWT.
// No part of either JWT (header, payload, signature), nor 8 bytes in a
// row of any token, shows in the CSI errors, the plugin's log or the
// transit errors.
func TestEchoedHeadersKeepNoPieceOfAToken(t *testing.T) {
	e := newCSIEnv(t)
	texts := map[string]string{}
	for at := 200 - len(testJWT) - 1; at <= 200; at++ {
		code := []int{403, 502, 400}[at%3]
		e.proxy.set(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo, f.echoAt = 20, "* /", code, at })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := e.ctrl.CreateVolume(ctx, createReq(fmt.Sprintf("pvc-echo-%d", at), 1))
		cancel()
		texts[fmt.Sprintf("create error, JWT at byte %d, HTTP %d", at, code)] = fmt.Sprint(err)
		if err == nil || !strings.Contains(err.Error(), http.StatusText(code)) {
			t.Fatalf("JWT at byte %d: %v, want the proxy's HTTP %d page", at, err, code)
		}
	}
	e.proxy.set(func(f *faultProxy) { f.burst, f.echoAt = 0, 0 })
	e.logMu.Lock()
	texts["plugin log"] = e.logs.String()
	e.logMu.Unlock()
	if l := pieceLeaks(testJWT, texts); len(l) > 0 {
		t.Fatalf("a piece of the JWT appears in: %v", l)
	}
	n := len(texts)
	transitTexts := echoedToTransit(t)
	for _, secret := range []string{echoVaultToken, echoSAJWT} {
		if l := pieceLeaks(secret, transitTexts); len(l) > 0 {
			t.Fatalf("a piece of %s... appears in: %v", secret[:6], l)
		}
	}
	figures.add("secret paths searched for the passphrase, JWT and vault token", n+len(transitTexts))
}

const (
	echoVaultToken = "hvs.CAESIJ-reliability-echoed-vault-token-7c1d"
	echoSAJWT      = "eyJhbGciOiJSUzI1NiIsImtpZCI6InJlbCJ9.eyJhdWQiOlsidmF1bHQiXSwic3ViIjoicmVsaWFiaWxpdHkifQ.c2lnbmF0dXJlLW9mLXRoZS1zZXJ2aWNlYWNjb3VudA"
)

// echoedToTransit runs the transit client through a proxy that answers
// every request with a Vault-shaped error echoing its headers and body,
// cut short at each byte of the token it carries, and returns the
// errors. The transit engine behind it is the FAKE of transittest.
func echoedToTransit(t *testing.T) map[string]string {
	f := transittest.New()
	f.JWT = echoSAJWT
	f.StaticToken(echoVaultToken)
	f.Rotate("vol-key")
	var cut atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var echo strings.Builder
		for _, k := range slices.Sorted(maps.Keys(r.Header)) {
			fmt.Fprintf(&echo, "%s: %s\n", k, strings.Join(r.Header[k], ", "))
		}
		echo.Write(b)
		s := echo.String()
		// Cut inside the token: the vault token's header, or the body's JWT.
		i := strings.Index(s, echoVaultToken)
		if i < 0 {
			i = strings.Index(s, echoSAJWT)
		}
		s = s[:min(len(s), max(i, 0)+int(cut.Load()))]
		w.WriteHeader(http.StatusBadGateway)
		json.NewEncoder(w).Encode(map[string][]string{"errors": {"proxy: upstream failed for request " + s}})
	}))
	t.Cleanup(srv.Close)
	sa := filepath.Join(t.TempDir(), "sa")
	os.WriteFile(sa, []byte(echoSAJWT), 0o600)
	texts := map[string]string{}
	ctx := context.Background()
	for _, cfg := range []transit.Config{
		{Address: srv.URL, Token: echoVaultToken, Timeout: 2 * time.Second},
		{Address: srv.URL, KubernetesRole: f.Role, ServiceAccountTokenFile: sa, Timeout: 2 * time.Second},
	} {
		c, err := transit.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for n := 1; n <= len(echoSAJWT)+1; n++ {
			cut.Store(int64(n))
			_, err := c.Encrypt(ctx, "vol-key", []byte("plain"))
			if err == nil || !strings.Contains(err.Error(), "proxy: upstream failed") {
				t.Fatalf("echo cut %d bytes into the token: %v, want the proxy's error", n, err)
			}
			texts[fmt.Sprintf("encrypt, role %q, echo cut %d bytes into the token", cfg.KubernetesRole, n)] = err.Error()
		}
	}
	return texts
}

// TestVaultTokenNeverShown drives the transit client with a static token
// and with Kubernetes auth through failures whose answers echo the token,
// and searches every error.
func TestVaultTokenNeverShown(t *testing.T) {
	const vaultToken = "hvs.CAESIJ-reliability-vault-token-9f3a"
	f := transittest.New()
	f.StaticToken(vaultToken)
	f.Rotate("vol-key")
	echo := false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if echo {
			// Echo what the request carried: its token and its body.
			b, _ := io.ReadAll(r.Body)
			w.WriteHeader(500)
			json.NewEncoder(w).Encode(map[string][]string{"errors": {"internal error for token " + r.Header.Get("X-Vault-Token") + " and request " + string(b)}})
			return
		}
		f.ServeHTTP(w, r)
	}))
	defer srv.Close()
	sa := filepath.Join(t.TempDir(), "sa")
	os.WriteFile(sa, []byte(f.JWT), 0o600)
	texts := map[string]string{}
	ctx := context.Background()
	for _, cfg := range []transit.Config{
		{Address: srv.URL, Token: vaultToken, Timeout: 2 * time.Second},
		{Address: srv.URL, KubernetesRole: "wrong-role", ServiceAccountTokenFile: sa, Timeout: 2 * time.Second},
		{Address: srv.URL, KubernetesRole: f.Role, ServiceAccountTokenFile: sa, Timeout: 2 * time.Second},
	} {
		c, err := transit.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, ech := range []bool{false, true} {
			echo = ech
			_, err = c.Encrypt(ctx, "no-such-key", []byte("plain"))
			texts[fmt.Sprintf("encrypt role=%q echo=%v", cfg.KubernetesRole, ech)] = fmt.Sprint(err)
			_, err = c.Decrypt(ctx, "vol-key", "vault:v1:not-base64!")
			texts[fmt.Sprintf("decrypt role=%q echo=%v", cfg.KubernetesRole, ech)] = fmt.Sprint(err)
			_, err = c.Rewrap(ctx, "vol-key", "vault:v9:AAAA")
			texts[fmt.Sprintf("rewrap role=%q echo=%v", cfg.KubernetesRole, ech)] = fmt.Sprint(err)
		}
		echo = false
	}
	for _, secret := range []string{vaultToken, f.JWT} {
		if l := leaks(secret, texts); len(l) > 0 {
			t.Fatalf("%s... appears in: %v\n%v", secret[:8], l, texts)
		}
	}
	figures.add("secret paths searched for the passphrase, JWT and vault token", len(texts))
}

// TestTLSVerifies serves both the API client and the transit client from
// a server with a self-signed certificate: refused without its CA,
// accepted with it. And no code outside tests can switch verification off.
func TestTLSVerifies(t *testing.T) {
	f := transittest.New()
	f.StaticToken("tok")
	f.Rotate("k")
	srv := httptest.NewTLSServer(f)
	defer srv.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644)
	ctx := context.Background()
	for _, withCA := range []bool{false, true} {
		cfg := transit.Config{Address: srv.URL, Token: "tok", Timeout: 2 * time.Second}
		if withCA {
			cfg.CACertFile = ca
		}
		c, _ := transit.New(cfg)
		_, err := c.Encrypt(ctx, "k", []byte("x"))
		if withCA != (err == nil) {
			t.Errorf("transit, CA given %v: %v", withCA, err)
		}
		if !withCA && !strings.Contains(err.Error(), "certificate") {
			t.Errorf("transit without the CA: %v, want a certificate error", err)
		}
	}
	tok := filepath.Join(t.TempDir(), "jwt")
	os.WriteFile(tok, []byte(testJWT), 0o600)
	api := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, `{"locations":[{"location":"ch-lug-1"}]}`) }))
	api.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
	api.StartTLS()
	defer api.Close()
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: api.Certificate().Raw}), 0o644)
	for _, withCA := range []bool{false, true} {
		cfg := cloud.Config{BaseURL: api.URL + "/api/1", Customer: "acme", TokenFile: tok, MaxAttempts: 1}
		if withCA {
			cfg.CAFile = ca
		}
		c, err := cloud.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.ListLocations(ctx)
		if withCA != (err == nil) {
			t.Errorf("API client, CA given %v: %v", withCA, err)
		}
	}
	// No switch to skip verification anywhere in the shipped code.
	_, self, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(self), "..", "..")
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && (d.Name() == ".tools" || d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			b, _ := os.ReadFile(p)
			if strings.Contains(string(b), "InsecureSkipVerify") {
				t.Errorf("%s sets InsecureSkipVerify", p)
			}
		}
		return nil
	})
}
