package main

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// TestConfigMapWriter: the controller creates the node location map's
// ConfigMap when it is missing and replaces its data afterwards, with the
// ServiceAccount token read at each write. The API server is a fake that
// keeps one ConfigMap; a real one cannot run here.
func TestConfigMapWriter(t *testing.T) {
	var mu sync.Mutex
	var stored *corev1.ConfigMap
	var seen []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		b, _ := io.ReadAll(r.Body)
		var cm corev1.ConfigMap
		switch {
		case r.Method == http.MethodPut && r.URL.Path == "/api/v1/namespaces/kube-system/configmaps/vco-csi-node-locations":
			if stored == nil {
				w.WriteHeader(404)
				w.Write([]byte(`{"kind":"Status","message":"configmaps \"vco-csi-node-locations\" not found"}`))
				return
			}
		case r.Method == http.MethodPost && r.URL.Path == "/api/v1/namespaces/kube-system/configmaps":
		default:
			w.WriteHeader(405)
			return
		}
		if err := json.Unmarshal(b, &cm); err != nil || cm.Name != "vco-csi-node-locations" || cm.Namespace != "kube-system" {
			w.WriteHeader(400)
			return
		}
		stored = &cm
		w.Write(b)
	}))
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte("token-1\n"), 0o600)
	w, err := newConfigMapWriter(srv.URL, "kube-system", "vco-csi-node-locations", tok, ca)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := w.write(ctx, map[string]string{"4c4c4544-0042-3510-8052-b4c04f4a4d32": "ch-lug-1"}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(tok, []byte("token-2\n"), 0o600)
	if err := w.write(ctx, map[string]string{"4c4c4544-0042-3510-8052-b4c04f4a4d32": "nl-ams-1"}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if stored == nil || stored.Data["4c4c4544-0042-3510-8052-b4c04f4a4d32"] != "nl-ams-1" {
		t.Fatalf("stored ConfigMap %+v, want the second map", stored)
	}
	want := []string{"PUT", "POST", "PUT"}
	if len(seen) != 3 {
		t.Fatalf("requests %v, want PUT (404), POST, PUT", seen)
	}
	for i, s := range seen {
		if !strings.HasPrefix(s, want[i]+" ") {
			t.Fatalf("requests %v, want PUT (404), POST, PUT", seen)
		}
	}
	if !strings.HasSuffix(seen[0], "Bearer token-1") || !strings.HasSuffix(seen[2], "Bearer token-2") {
		t.Fatalf("requests %v: the token is not re-read at each write", seen)
	}
}

// TestConfigMapWriterEchoRedacted: an answer that echoes the request's
// Authorization header, in a Status message or in a page cut at 512 bytes
// across the token, leaves no piece of the token in the error.
func TestConfigMapWriterEchoRedacted(t *testing.T) {
	const token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2lnbmF0dXJlLW9mLXRoZS1jb250cm9sbGVy"
	page := false
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth := r.Header.Get("Authorization")
		if page {
			pad := strings.Repeat("x", 512-len("Authorization: ")-len(auth)/2)
			w.WriteHeader(http.StatusBadGateway)
			w.Write([]byte(pad + "Authorization: " + auth + "\n"))
			return
		}
		w.WriteHeader(http.StatusForbidden)
		json.NewEncoder(w).Encode(map[string]string{"kind": "Status", "message": "forbidden for " + auth})
	}))
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600)
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte(token), 0o600)
	w, err := newConfigMapWriter(srv.URL, "csi-driver", "vco-csi-node-locations", tok, ca)
	if err != nil {
		t.Fatal(err)
	}
	pieces := strings.Split(token, ".")
	for i := 0; i+8 <= len(token); i++ {
		pieces = append(pieces, token[i:i+8])
	}
	for _, page = range []bool{false, true} {
		err := w.write(context.Background(), map[string]string{"u": "ch-lug-1"})
		if err == nil {
			t.Fatalf("page %v: the write succeeded", page)
		}
		for _, p := range pieces {
			if strings.Contains(err.Error(), p) {
				t.Fatalf("page %v: %q of the token is in the error: %.300s", page, p, err)
			}
		}
	}
}
