// Package transittest is a FAKE Vault/OpenBao transit engine for tests.
// No Vault or OpenBao server can run on the build machines, so the transit
// client and the code that stores wrapped passphrases in LUKS2 tokens are
// tested against this fake; a real server is used when VCO_TEST_VAULT_ADDR
// is set. Besides tests, only the lab harness vco-lab links it, to run the
// encrypted-volume scenario of `make lab`, where it says it is a fake; no
// binary that is shipped to nodes does.
package transittest

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

// Fake is a FAKE transit engine. It implements the few endpoints the client
// uses the way the real engine behaves: AES-256-GCM keys with versions,
// "vault:vN:base64(nonce|ciphertext)" ciphertexts, Kubernetes auth that
// checks the ServiceAccount JWT and role, token TTLs and renew-self, and
// Vault-style error bodies {"errors":[...]}.
type Fake struct {
	Mu                   sync.Mutex
	Keys                 map[string][][]byte // name -> versions (index 0 = v1)
	MinDecryptionVersion map[string]int
	Tokens               map[string]time.Time // token -> expiry (zero: never)
	TTL                  time.Duration
	JWT                  string
	Role                 string
	Logins               int
	Renewals             int
	Delay                time.Duration
	Now                  func() time.Time
	Requests             []string // method+path of every request, for assertions
	Bodies               []string // raw request bodies, to check what was sent
	// AuthMount and TransitMount are where the Kubernetes auth method and
	// the transit engine are mounted ("kubernetes" and "transit" when
	// empty).
	AuthMount, TransitMount string
	// Review, when set, judges a login's JWT in place of comparing it with
	// JWT, as a real Kubernetes auth method does by sending it to the
	// cluster's TokenReview API: nil accepts it. It is called without Mu
	// held.
	Review func(jwt, role string) error
}

// New makes a fake with no keys, a one-hour token TTL, and a Kubernetes
// role "vco-node" that accepts the JWT in Fake.JWT.
func New() *Fake {
	return &Fake{Keys: map[string][][]byte{}, MinDecryptionVersion: map[string]int{}, Tokens: map[string]time.Time{},
		TTL: time.Hour, JWT: "eyJhbGciOiJSUzI1NiJ9.sa-token.sig", Role: "vco-node", Now: time.Now}
}

// Rotate adds a new version of key name (creating the key).
func (f *Fake) Rotate(name string) {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	k := make([]byte, 32)
	rand.Read(k)
	f.Keys[name] = append(f.Keys[name], k)
}

// StaticToken registers a token that never expires.
func (f *Fake) StaticToken(tok string) {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	f.Tokens[tok] = time.Time{}
}

func vaultErr(w http.ResponseWriter, code int, msgs ...string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"errors": msgs})
}

// ServeHTTP answers the transit, Kubernetes auth and renew-self endpoints.
func (f *Fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if f.Delay > 0 {
		select {
		case <-time.After(f.Delay):
		case <-r.Context().Done():
			return
		}
	}
	f.Mu.Lock()
	defer f.Mu.Unlock()
	var body map[string]any
	raw, _ := io.ReadAll(r.Body)
	f.Requests = append(f.Requests, r.Method+" "+r.URL.Path)
	f.Bodies = append(f.Bodies, string(raw))
	if err := json.Unmarshal(raw, &body); err != nil && len(raw) > 0 {
		vaultErr(w, 400, "failed to parse JSON input: "+err.Error())
		return
	}
	if r.Method != http.MethodPost {
		vaultErr(w, 405, "unsupported operation")
		return
	}
	authMount, transitMount := f.AuthMount, f.TransitMount
	if authMount == "" {
		authMount = "kubernetes"
	}
	if transitMount == "" {
		transitMount = "transit"
	}
	if r.URL.Path == "/v1/auth/"+authMount+"/login" {
		f.login(w, body)
		return
	}
	tok := r.Header.Get("X-Vault-Token")
	exp, ok := f.Tokens[tok]
	if !ok || (!exp.IsZero() && !f.Now().Before(exp)) {
		vaultErr(w, 403, "permission denied")
		return
	}
	if r.URL.Path == "/v1/auth/token/renew-self" {
		f.Renewals++
		f.Tokens[tok] = f.Now().Add(f.TTL)
		f.writeAuth(w, tok)
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/v1/"+transitMount+"/")
	parts := strings.Split(rest, "/")
	if !ok || len(parts) != 2 {
		vaultErr(w, 404, "unsupported path")
		return
	}
	f.transit(w, parts[0], parts[1], body)
}

// login answers a Kubernetes auth login with a new token. Called with
// f.Mu held; a Review runs without it.
func (f *Fake) login(w http.ResponseWriter, body map[string]any) {
	if body["role"] != f.Role {
		vaultErr(w, 400, fmt.Sprintf("invalid role name %q", body["role"]))
		return
	}
	if review := f.Review; review != nil {
		jwt, _ := body["jwt"].(string)
		role := f.Role
		f.Mu.Unlock()
		err := review(jwt, role)
		f.Mu.Lock()
		if err != nil {
			vaultErr(w, 403, "permission denied", err.Error())
			return
		}
	} else if body["jwt"] != f.JWT {
		vaultErr(w, 403, "permission denied")
		return
	}
	f.Logins++
	tok := fmt.Sprintf("hvs.fake-%d", f.Logins)
	f.Tokens[tok] = f.Now().Add(f.TTL)
	f.writeAuth(w, tok)
}

// transit answers the transit operation op (encrypt, decrypt, rewrap)
// with key name. Called with f.Mu held.
func (f *Fake) transit(w http.ResponseWriter, op, name string, body map[string]any) {
	versions := f.Keys[name]
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
		if ver < f.MinDecryptionVersion[name] {
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

func (f *Fake) writeAuth(w http.ResponseWriter, tok string) {
	json.NewEncoder(w).Encode(map[string]any{"auth": map[string]any{
		"client_token": tok, "lease_duration": int(f.TTL / time.Second), "renewable": true,
	}})
}

func (f *Fake) writeData(w http.ResponseWriter, data map[string]any) {
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
	v, err := parseVersion(ct)
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

func parseVersion(ct string) (int, error) {
	parts := strings.SplitN(ct, ":", 3)
	if len(parts) != 3 || parts[0] != "vault" || !strings.HasPrefix(parts[1], "v") {
		return 0, fmt.Errorf("no vault:vN: prefix")
	}
	n, err := strconv.Atoi(parts[1][1:])
	if err != nil || n < 1 {
		return 0, fmt.Errorf("bad version")
	}
	return n, nil
}

// Describe sums up what the fake was asked: logins, and requests per
// transit operation.
func (f *Fake) Describe() string {
	f.Mu.Lock()
	defer f.Mu.Unlock()
	ops := map[string]int{}
	for _, r := range f.Requests {
		for _, op := range []string{"encrypt", "decrypt", "rewrap"} {
			if strings.Contains(r, "/"+op+"/") {
				ops[op]++
			}
		}
	}
	return fmt.Sprintf("FAKE transit engine: %d logins, %d encrypt, %d decrypt, %d rewrap", f.Logins, ops["encrypt"], ops["decrypt"], ops["rewrap"])
}
