// Package transit wraps and unwraps volume passphrases with a key held by a
// Vault or OpenBao transit secrets engine, so that a passphrase is stored on
// disk (in the volume's LUKS2 token) only in encrypted form and the node
// never holds the wrapping key.
//
// It speaks the small part of the HTTP API it needs (transit encrypt,
// decrypt and rewrap; Kubernetes auth login; token renew-self) with the
// standard library instead of the full Vault client: the node plugin image
// stays small and every request, timeout and error text is under our
// control. Error texts name the server address, the operation and the key,
// never a token, a passphrase or a JWT. None of those travels over plain
// http but to a loopback address (or with Config.InsecureAllowHTTP),
// redirects included.
package transit

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
	"github.com/whitesky-cloud/vco-storage/internal/redact"
)

// Config says where the transit engine is and how to log in.
type Config struct {
	// Address is the server's base URL, e.g. https://vault.example:8200.
	// It must be https, or http to a loopback address.
	Address string
	// InsecureAllowHTTP lets Address be http to any host, which sends the
	// ServiceAccount JWT, the Vault token and the passphrases in clear
	// (the simulator's and the lab's set-ups only).
	InsecureAllowHTTP bool
	// Mount is the transit engine's mount path (default "transit").
	Mount string
	// Namespace is sent as X-Vault-Namespace when set (Vault Enterprise,
	// OpenBao namespaces).
	Namespace string
	// CACertFile is a PEM bundle to trust instead of the system roots.
	CACertFile string
	// Timeout bounds every single HTTP request (default 10s).
	Timeout time.Duration

	// Token is a static Vault token (operators, tests). When empty the
	// client logs in with Kubernetes auth.
	Token string
	// KubernetesRole is the Vault role bound to the ServiceAccount.
	KubernetesRole string
	// KubernetesMount is the Kubernetes auth mount path (default
	// "kubernetes").
	KubernetesMount string
	// ServiceAccountTokenFile is the projected ServiceAccount token (default
	// /var/run/secrets/kubernetes.io/serviceaccount/token). It is read at
	// every login because the kubelet rotates it.
	ServiceAccountTokenFile string
}

// DefaultServiceAccountTokenFile is where Kubernetes mounts the pod's token.
const DefaultServiceAccountTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"

// Client talks to one transit engine. It is safe for concurrent use.
type Client struct {
	cfg  Config
	http *http.Client
	now  func() time.Time

	mu        sync.Mutex
	token     string
	renewable bool
	issued    time.Time
	ttl       time.Duration // 0: does not expire
}

// New checks cfg and builds a client. It does not contact the server.
func New(cfg Config) (*Client, error) {
	u, err := url.Parse(cfg.Address)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, fmt.Errorf("transit: vault address %q is not an http(s) URL", cfg.Address)
	}
	if !cleartext.Allowed(u, cfg.InsecureAllowHTTP) {
		return nil, fmt.Errorf("transit: vault address %q is http to %s, which is not a loopback address: the ServiceAccount token, the Vault token and the passphrases would travel in clear; use https (%s allows http for test set-ups)",
			cfg.Address, u.Hostname(), cleartext.Option)
	}
	cfg.Address = strings.TrimRight(cfg.Address, "/")
	if cfg.Mount == "" {
		cfg.Mount = "transit"
	}
	if cfg.KubernetesMount == "" {
		cfg.KubernetesMount = "kubernetes"
	}
	if cfg.ServiceAccountTokenFile == "" {
		cfg.ServiceAccountTokenFile = DefaultServiceAccountTokenFile
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Token == "" && cfg.KubernetesRole == "" {
		return nil, fmt.Errorf("transit: vault %s: neither a token nor a Kubernetes auth role is configured", cfg.Address)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil
	if cfg.CACertFile != "" {
		pem, err := os.ReadFile(cfg.CACertFile)
		if err != nil {
			return nil, fmt.Errorf("transit: vault %s: read CA bundle: %w", cfg.Address, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("transit: vault %s: %s holds no PEM certificate", cfg.Address, cfg.CACertFile)
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	hc := &http.Client{Transport: tr, Timeout: cfg.Timeout, CheckRedirect: cleartext.CheckRedirect}
	c := &Client{cfg: cfg, http: hc, now: time.Now}
	if cfg.Token != "" {
		c.token = cfg.Token
	}
	return c, nil
}

// Error is a failed request. It carries what the server said (its
// "errors" list), never what was sent.
type Error struct {
	Address string
	Op      string
	Key     string
	Status  int      // HTTP status, 0 when no response arrived
	Errors  []string // the server's error messages
	Err     error    // transport error, when no response arrived
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "transit: vault %s: %s", e.Address, e.Op)
	if e.Key != "" {
		fmt.Fprintf(&b, " with key %q", e.Key)
	}
	if e.Err != nil {
		fmt.Fprintf(&b, ": %v", e.Err)
	}
	if e.Status != 0 {
		fmt.Fprintf(&b, ": HTTP %d", e.Status)
	}
	if len(e.Errors) > 0 {
		fmt.Fprintf(&b, ": %s", strings.Join(e.Errors, "; "))
	}
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// TooOld says the server refused to decrypt a ciphertext whose key
// version is below the key's min_decryption_version (HTTP 400, "version is
// disallowed by policy (too old)" in Vault and OpenBao).
func (e *Error) TooOld() bool {
	return e.Status == http.StatusBadRequest && e.says("disallowed by policy (too old)")
}

// Sealed says the server answered that it is sealed (HTTP 503, "Vault is
// sealed").
func (e *Error) Sealed() bool {
	return e.Status == http.StatusServiceUnavailable && e.says("sealed")
}

// LoginRefused says the server refused the Kubernetes login (HTTP 4xx):
// the role unknown, or the ServiceAccount, its namespace or the token's
// audience not the ones the role binds.
func (e *Error) LoginRefused() bool {
	return strings.HasPrefix(e.Op, "kubernetes login") && e.Status/100 == 4
}

// Unanswered says no response arrived: the server unreachable, the
// connection refused or cut, or the deadline passed first.
func (e *Error) Unanswered() bool { return e.Status == 0 && e.Err != nil }

func (e *Error) says(words string) bool {
	for _, m := range e.Errors {
		if strings.Contains(m, words) {
			return true
		}
	}
	return false
}

// Ciphertext is a wrapped secret and the key version that wrapped it.
type Ciphertext struct {
	Text    string // "vault:vN:..."
	Version int
}

// ParseVersion returns N of a "vault:vN:..." ciphertext.
func ParseVersion(ct string) (int, error) {
	parts := strings.SplitN(ct, ":", 3)
	if len(parts) != 3 || parts[0] != "vault" || !strings.HasPrefix(parts[1], "v") {
		return 0, errors.New(`ciphertext lacks the "vault:vN:" prefix`)
	}
	n, err := strconv.Atoi(parts[1][1:])
	if err != nil || n < 1 {
		return 0, errors.New("ciphertext has no valid key version")
	}
	return n, nil
}

// Encrypt wraps plaintext with the named key.
func (c *Client) Encrypt(ctx context.Context, key string, plaintext []byte) (Ciphertext, error) {
	var out struct {
		Data struct {
			Ciphertext string `json:"ciphertext"`
		} `json:"data"`
	}
	body := map[string]any{"plaintext": base64.StdEncoding.EncodeToString(plaintext)}
	if err := c.call(ctx, "encrypt", key, "/v1/"+c.cfg.Mount+"/encrypt/"+url.PathEscape(key), body, &out); err != nil {
		return Ciphertext{}, err
	}
	return c.ciphertext("encrypt", key, out.Data.Ciphertext)
}

// Decrypt unwraps a ciphertext made by Encrypt or Rewrap.
func (c *Client) Decrypt(ctx context.Context, key, ciphertext string) ([]byte, error) {
	var out struct {
		Data struct {
			Plaintext string `json:"plaintext"`
		} `json:"data"`
	}
	body := map[string]any{"ciphertext": ciphertext}
	if err := c.call(ctx, "decrypt", key, "/v1/"+c.cfg.Mount+"/decrypt/"+url.PathEscape(key), body, &out); err != nil {
		return nil, err
	}
	pt, err := base64.StdEncoding.DecodeString(out.Data.Plaintext)
	if err != nil {
		return nil, &Error{Address: c.cfg.Address, Op: "decrypt", Key: key, Err: errors.New("response plaintext is not base64")}
	}
	return pt, nil
}

// Rewrap re-encrypts a ciphertext under the newest version of the key
// without the plaintext leaving the server.
func (c *Client) Rewrap(ctx context.Context, key, ciphertext string) (Ciphertext, error) {
	var out struct {
		Data struct {
			Ciphertext string `json:"ciphertext"`
		} `json:"data"`
	}
	body := map[string]any{"ciphertext": ciphertext}
	if err := c.call(ctx, "rewrap", key, "/v1/"+c.cfg.Mount+"/rewrap/"+url.PathEscape(key), body, &out); err != nil {
		return Ciphertext{}, err
	}
	return c.ciphertext("rewrap", key, out.Data.Ciphertext)
}

func (c *Client) ciphertext(op, key, ct string) (Ciphertext, error) {
	v, err := ParseVersion(ct)
	if err != nil {
		return Ciphertext{}, &Error{Address: c.cfg.Address, Op: op, Key: key, Err: fmt.Errorf("response: %w", err)}
	}
	return Ciphertext{Text: ct, Version: v}, nil
}

// call runs one authenticated transit request. A 403 on a token that came
// from Kubernetes auth is answered by one fresh login and one retry: the
// token may have been revoked or expired early on the server.
func (c *Client) call(ctx context.Context, op, key, path string, body, out any) error {
	tok, err := c.ensureToken(ctx)
	if err != nil {
		return err
	}
	err = c.do(ctx, op, key, path, tok, body, out)
	var te *Error
	if c.cfg.Token == "" && errors.As(err, &te) && te.Status == http.StatusForbidden {
		c.mu.Lock()
		c.token = ""
		c.mu.Unlock()
		if tok, err = c.ensureToken(ctx); err != nil {
			return err
		}
		err = c.do(ctx, op, key, path, tok, body, out)
	}
	return err
}

// ensureToken returns a token that is valid now: it logs in when there is
// none or it has expired, and renews a renewable token past half its TTL.
func (c *Client) ensureToken(ctx context.Context) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if c.token != "" && c.ttl > 0 {
		age := now.Sub(c.issued)
		switch {
		case age >= c.ttl:
			if c.cfg.Token != "" {
				return "", &Error{Address: c.cfg.Address, Op: "authenticate", Err: errors.New("the configured token has expired")}
			}
			c.token = ""
		case age >= c.ttl/2 && c.renewable:
			if err := c.renewLocked(ctx); err != nil && c.cfg.Token == "" {
				// A failed renewal is survivable while Kubernetes auth
				// can log in again.
				c.token = ""
			} else if err != nil {
				return "", err
			}
		}
	}
	if c.token == "" {
		if err := c.loginLocked(ctx); err != nil {
			return "", err
		}
	}
	return c.token, nil
}

type authResponse struct {
	Auth *struct {
		ClientToken   string `json:"client_token"`
		LeaseDuration int    `json:"lease_duration"`
		Renewable     bool   `json:"renewable"`
	} `json:"auth"`
}

// Login authenticates with the ServiceAccount token now (it also happens
// on demand).
func (c *Client) Login(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.loginLocked(ctx)
}

func (c *Client) loginLocked(ctx context.Context) error {
	if c.cfg.Token != "" {
		c.token = c.cfg.Token
		return nil
	}
	jwt, err := os.ReadFile(c.cfg.ServiceAccountTokenFile)
	if err != nil {
		return &Error{Address: c.cfg.Address, Op: "kubernetes login", Err: fmt.Errorf("read ServiceAccount token file: %w", err)}
	}
	var out authResponse
	body := map[string]any{"role": c.cfg.KubernetesRole, "jwt": strings.TrimSpace(string(jwt))}
	if err := c.do(ctx, "kubernetes login as role "+strconv.Quote(c.cfg.KubernetesRole), "", "/v1/auth/"+c.cfg.KubernetesMount+"/login", "", body, &out); err != nil {
		return err
	}
	if out.Auth == nil || out.Auth.ClientToken == "" {
		return &Error{Address: c.cfg.Address, Op: "kubernetes login", Err: errors.New("response carries no client token")}
	}
	c.setTokenLocked(out.Auth.ClientToken, out.Auth.LeaseDuration, out.Auth.Renewable)
	return nil
}

func (c *Client) setTokenLocked(tok string, leaseSeconds int, renewable bool) {
	c.token = tok
	c.renewable = renewable
	c.issued = c.now()
	c.ttl = time.Duration(leaseSeconds) * time.Second
}

// Renew extends the current token's lease now (it also happens on demand
// past half the lease).
func (c *Client) Renew(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.token == "" {
		return c.loginLocked(ctx)
	}
	return c.renewLocked(ctx)
}

func (c *Client) renewLocked(ctx context.Context) error {
	var out authResponse
	if err := c.do(ctx, "token renewal", "", "/v1/auth/token/renew-self", c.token, map[string]any{}, &out); err != nil {
		return err
	}
	if out.Auth == nil || out.Auth.ClientToken == "" {
		return &Error{Address: c.cfg.Address, Op: "token renewal", Err: errors.New("response carries no auth block")}
	}
	c.setTokenLocked(out.Auth.ClientToken, out.Auth.LeaseDuration, out.Auth.Renewable)
	return nil
}

// do sends one JSON POST and decodes the answer or the server's errors.
func (c *Client) do(ctx context.Context, op, key, path, token string, body, out any) error {
	fail := func(status int, msgs []string, err error) error {
		return &Error{Address: c.cfg.Address, Op: op, Key: key, Status: status, Errors: msgs, Err: err}
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return fail(0, nil, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.Address+path, bytes.NewReader(raw))
	if err != nil {
		return fail(0, nil, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("X-Vault-Token", token)
	}
	if c.cfg.Namespace != "" {
		req.Header.Set("X-Vault-Namespace", c.cfg.Namespace)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		// url.Error repeats the URL, which holds no secret; keep only the
		// cause so the address is not printed twice.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fail(0, nil, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fail(resp.StatusCode, nil, fmt.Errorf("read response: %w", err))
	}
	if resp.StatusCode/100 != 2 {
		var e struct {
			Errors []string `json:"errors"`
		}
		if json.Unmarshal(data, &e) != nil || len(e.Errors) == 0 {
			e.Errors = []string{http.StatusText(resp.StatusCode)}
		}
		// A server or a proxy in front of it may echo the request, whole
		// or cut short: what was sent in confidence, and anything shaped
		// like a credential, is cut out of the words kept.
		secrets := []string{token}
		if m, ok := body.(map[string]any); ok {
			for _, k := range []string{"jwt", "plaintext"} {
				if v, ok := m[k].(string); ok {
					secrets = append(secrets, v)
				}
			}
		}
		for i := range e.Errors {
			e.Errors[i] = redact.Text(e.Errors[i], secrets...)
		}
		return fail(resp.StatusCode, e.Errors, nil)
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fail(resp.StatusCode, nil, fmt.Errorf("response is not the expected JSON: %w", err))
	}
	return nil
}
