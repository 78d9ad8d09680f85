package transit

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// fakeVault is a FAKE transit engine for tests: no Vault or OpenBao server
// can run on the build machines. It implements the few endpoints the client
// uses the way the real engine behaves: AES-256-GCM keys with versions,
// "vault:vN:base64(nonce|ciphertext)" ciphertexts, Kubernetes auth that
// checks the ServiceAccount JWT and role, token TTLs and renew-self, and
// Vault-style error bodies {"errors":[...]}.
type fakeVault struct {
	mu       sync.Mutex
	keys     map[string][][]byte // name -> versions (index 0 = v1)
	minDec   map[string]int
	tokens   map[string]time.Time // token -> expiry (zero: never)
	ttl      time.Duration
	jwt      string
	role     string
	logins   int
	renewals int
	delay    time.Duration
	now      func() time.Time
	requests []string // method+path of every request, for assertions
	bodies   []string // raw request bodies, to check what was sent
}

func newFakeVault() *fakeVault {
	return &fakeVault{keys: map[string][][]byte{}, minDec: map[string]int{}, tokens: map[string]time.Time{},
		ttl: time.Hour, jwt: "eyJhbGciOiJSUzI1NiJ9.sa-token.sig", role: "vco-node", now: time.Now}
}

func (f *fakeVault) rotate(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := make([]byte, 32)
	rand.Read(k)
	f.keys[name] = append(f.keys[name], k)
}

func (f *fakeVault) staticToken(tok string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[tok] = time.Time{}
}

func vaultErr(w http.ResponseWriter, code int, msgs ...string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"errors": msgs})
}

func (f *fakeVault) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-r.Context().Done():
			return
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var body map[string]any
	raw, _ := io.ReadAll(r.Body)
	f.requests = append(f.requests, r.Method+" "+r.URL.Path)
	f.bodies = append(f.bodies, string(raw))
	if err := json.Unmarshal(raw, &body); err != nil && len(raw) > 0 {
		vaultErr(w, 400, "failed to parse JSON input: "+err.Error())
		return
	}
	if r.Method != http.MethodPost {
		vaultErr(w, 405, "unsupported operation")
		return
	}
	if r.URL.Path == "/v1/auth/kubernetes/login" {
		if body["role"] != f.role {
			vaultErr(w, 400, fmt.Sprintf("invalid role name %q", body["role"]))
			return
		}
		if body["jwt"] != f.jwt {
			vaultErr(w, 403, "permission denied")
			return
		}
		f.logins++
		tok := fmt.Sprintf("hvs.fake-%d", f.logins)
		f.tokens[tok] = f.now().Add(f.ttl)
		f.writeAuth(w, tok)
		return
	}
	tok := r.Header.Get("X-Vault-Token")
	exp, ok := f.tokens[tok]
	if !ok || (!exp.IsZero() && !f.now().Before(exp)) {
		vaultErr(w, 403, "permission denied")
		return
	}
	if r.URL.Path == "/v1/auth/token/renew-self" {
		f.renewals++
		f.tokens[tok] = f.now().Add(f.ttl)
		f.writeAuth(w, tok)
		return
	}
	parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/v1/transit/"), "/")
	if len(parts) != 2 {
		vaultErr(w, 404, "unsupported path")
		return
	}
	op, name := parts[0], parts[1]
	versions := f.keys[name]
	if len(versions) == 0 {
		vaultErr(w, 400, "encryption key not found")
		return
	}
	switch op {
	case "encrypt":
		pt, err := base64.StdEncoding.DecodeString(fmt.Sprint(body["plaintext"]))
		if err != nil {
			vaultErr(w, 400, "failed to base64-decode plaintext")
			return
		}
		f.writeData(w, map[string]any{"ciphertext": seal(versions, len(versions), pt), "key_version": len(versions)})
	case "decrypt", "rewrap":
		pt, ver, err := open(versions, fmt.Sprint(body["ciphertext"]))
		if err != nil {
			vaultErr(w, 400, err.Error())
			return
		}
		if ver < f.minDec[name] {
			vaultErr(w, 400, "ciphertext or signature version is disallowed by policy (too old)")
			return
		}
		if op == "decrypt" {
			f.writeData(w, map[string]any{"plaintext": base64.StdEncoding.EncodeToString(pt)})
		} else {
			f.writeData(w, map[string]any{"ciphertext": seal(versions, len(versions), pt), "key_version": len(versions)})
		}
	default:
		vaultErr(w, 404, "unsupported path")
	}
}

func (f *fakeVault) writeAuth(w http.ResponseWriter, tok string) {
	json.NewEncoder(w).Encode(map[string]any{"auth": map[string]any{
		"client_token": tok, "lease_duration": int(f.ttl / time.Second), "renewable": true,
	}})
}

func (f *fakeVault) writeData(w http.ResponseWriter, data map[string]any) {
	json.NewEncoder(w).Encode(map[string]any{"data": data})
}

func seal(versions [][]byte, v int, pt []byte) string {
	b, _ := aes.NewCipher(versions[v-1])
	g, _ := cipher.NewGCM(b)
	nonce := make([]byte, g.NonceSize())
	rand.Read(nonce)
	return "vault:v" + strconv.Itoa(v) + ":" + base64.StdEncoding.EncodeToString(g.Seal(nonce, nonce, pt, nil))
}

func open(versions [][]byte, ct string) ([]byte, int, error) {
	v, err := ParseVersion(ct)
	if err != nil || v > len(versions) {
		return nil, 0, fmt.Errorf("invalid ciphertext: no prefix or unknown key version")
	}
	raw, err := base64.StdEncoding.DecodeString(strings.SplitN(ct, ":", 3)[2])
	if err != nil {
		return nil, 0, fmt.Errorf("invalid ciphertext: could not decode base64")
	}
	b, _ := aes.NewCipher(versions[v-1])
	g, _ := cipher.NewGCM(b)
	if len(raw) < g.NonceSize() {
		return nil, 0, fmt.Errorf("invalid ciphertext: too short")
	}
	pt, err := g.Open(nil, raw[:g.NonceSize()], raw[g.NonceSize():], nil)
	if err != nil {
		return nil, 0, fmt.Errorf("cipher: message authentication failed")
	}
	return pt, v, nil
}
