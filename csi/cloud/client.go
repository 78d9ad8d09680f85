// Package cloud is the whitesky.cloud API client for the calls vco-csi makes:
// disks, their snapshots and notes, VM disk attach/detach, VMs with their
// reference_id, cloudspaces and locations. It was written from the API's
// Swagger description (base path /api/1).
//
// The client owns transport concerns only: the Bearer credential (read from
// a file and re-read when the file changes), a custom CA, a deadline on every
// call, and retries with exponential backoff and full jitter on 5xx and 429.
// It returns errors wrapping the sentinels in errors.go; it never decides
// what a failure means to Kubernetes. The credential never appears in an
// error or a log line, and never travels over plain http but to a loopback
// address (or with Config.InsecureAllowHTTP), redirects included.
package cloud

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
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

// Config says where the API is and how to reach it.
type Config struct {
	// BaseURL is the API root, e.g. https://try.whitesky.cloud/api/1.
	// It must be https, or http to a loopback address.
	BaseURL string
	// InsecureAllowHTTP lets BaseURL be http to any host, which sends the
	// JWT in clear (the simulator's and the lab's set-ups only).
	InsecureAllowHTTP bool
	// Customer is the customer id every path starts with.
	Customer string
	// TokenFile holds the JWT. It is re-read whenever its size or
	// modification time changes, so a rotated credential is picked up
	// without a restart.
	TokenFile string
	// CAFile, if set, is a PEM bundle trusted instead of the system roots.
	CAFile string
	// CallTimeout bounds a call whose context has no deadline. Default 30s.
	CallTimeout time.Duration
	// MaxAttempts per call, including the first. Default 5.
	MaxAttempts int
	// BackoffBase and BackoffMax shape the retry delays. Defaults 200ms, 5s.
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// HTTPClient overrides the transport (tests). CAFile is then ignored.
	HTTPClient *http.Client
	// WrapTransport, if set, wraps the client's transport (metrics: every
	// request, retries included, passes through it).
	WrapTransport func(http.RoundTripper) http.RoundTripper
}

// Client talks to one customer's whitesky.cloud API.
type Client struct {
	cfg  Config
	base *url.URL
	http *http.Client
	tok  *tokenFile
}

// New checks the configuration and builds a client. The token file must be
// readable now; a later read failure fails the call that needs it.
func New(cfg Config) (*Client, error) {
	if cfg.BaseURL == "" || cfg.Customer == "" {
		return nil, errors.New("cloud: API URL and customer id are required")
	}
	u, err := url.Parse(strings.TrimRight(cfg.BaseURL, "/"))
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, fmt.Errorf("cloud: API URL %q is not an absolute http(s) URL", cfg.BaseURL)
	}
	if !cleartext.Allowed(u, cfg.InsecureAllowHTTP) {
		return nil, fmt.Errorf("cloud: API URL %q is http to %s, which is not a loopback address: the JWT would travel in clear; use https (%s allows http for test set-ups)",
			cfg.BaseURL, u.Hostname(), cleartext.Option)
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 5
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = 200 * time.Millisecond
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 5 * time.Second
	}
	hc := cfg.HTTPClient
	if hc == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		// The controller's calls come in bursts (a StatefulSet scaled
		// up): keep their connections for the next burst instead of
		// the default two, so a burst does not open (and, over TLS,
		// handshake) a connection per request.
		tr.MaxIdleConnsPerHost = 64
		if cfg.CAFile != "" {
			pem, err := os.ReadFile(cfg.CAFile)
			if err != nil {
				return nil, fmt.Errorf("cloud: reading CA bundle: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("cloud: CA bundle %s holds no PEM certificate", cfg.CAFile)
			}
			tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		}
		hc = &http.Client{Transport: tr}
	}
	// A copy: the credential never follows a redirect to plain http,
	// whoever made the client.
	own := *hc
	own.CheckRedirect = cleartext.CheckRedirect
	if cfg.WrapTransport != nil {
		rt := own.Transport
		if rt == nil {
			rt = http.DefaultTransport
		}
		own.Transport = cfg.WrapTransport(rt)
	}
	hc = &own
	c := &Client{cfg: cfg, base: u, http: hc, tok: &tokenFile{path: cfg.TokenFile}}
	if cfg.TokenFile != "" {
		if _, err := c.tok.get(); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Host is the portal host name, from which the default driver name is made.
func (c *Client) Host() string { return c.base.Hostname() }

// tokenFile caches the credential and reloads it when the file changes.
type tokenFile struct {
	path  string
	mu    sync.Mutex
	mod   time.Time
	size  int64
	token string
}

func (t *tokenFile) get() (string, error) {
	if t.path == "" {
		return "", nil
	}
	st, err := os.Stat(t.path)
	if err != nil {
		return "", fmt.Errorf("cloud: credential file %s: %w", t.path, errors.Unwrap(err))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.token != "" && st.ModTime().Equal(t.mod) && st.Size() == t.size {
		return t.token, nil
	}
	b, err := os.ReadFile(t.path)
	if err != nil {
		return "", fmt.Errorf("cloud: reading credential file %s: %w", t.path, errors.Unwrap(err))
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("cloud: credential file %s is empty", t.path)
	}
	t.token, t.mod, t.size = tok, st.ModTime(), st.Size()
	return tok, nil
}

// call describes one API request.
type call struct {
	op, target string
	method     string
	path       string // below /customers/{customer}
	query      url.Values
	body       any
	out        any
	// hint is appended to a 403's error text.
	forbiddenHint string
	// beforeRetry runs before each retry of a call that is not idempotent.
	// It returns true when the first attempt took effect after all (the
	// caller has then found and stored the result) and retrying must stop.
	beforeRetry func(ctx context.Context) bool
}

func (c *Client) do(ctx context.Context, cl call) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.CallTimeout)
		defer cancel()
	}
	var lastErr error
	for attempt := 0; attempt < c.cfg.MaxAttempts; attempt++ {
		if attempt > 0 {
			delay := c.backoff(attempt, lastErr)
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return c.ctxErr(cl, ctx, lastErr)
			case <-t.C:
			}
			if cl.beforeRetry != nil && cl.beforeRetry(ctx) {
				return nil
			}
		}
		err := c.once(ctx, cl)
		if err == nil {
			return nil
		}
		lastErr = err
		var ae *APIError
		if !errors.As(err, &ae) || !retryable(ae.Status) {
			if ctx.Err() != nil {
				return c.ctxErr(cl, ctx, err)
			}
			return err
		}
	}
	return lastErr
}

func (c *Client) ctxErr(cl call, ctx context.Context, last error) error {
	msg := "gave up: " + ctx.Err().Error()
	if last != nil {
		msg += "; last error: " + last.Error()
	}
	return &APIError{Op: cl.op, Target: cl.target, Message: msg, Kind: ErrUnavailable}
}

// retryAfterError carries a server's Retry-After through to the backoff.
type retryAfterError struct {
	*APIError
	after time.Duration
}

func (c *Client) backoff(attempt int, last error) time.Duration {
	max := c.cfg.BackoffBase << (attempt - 1)
	if max > c.cfg.BackoffMax || max <= 0 {
		max = c.cfg.BackoffMax
	}
	d := time.Duration(rand.Int64N(int64(max)) + 1)
	var ra *retryAfterError
	if errors.As(last, &ra) && ra.after > d {
		d = min(ra.after, c.cfg.BackoffMax)
	}
	return d
}

func (c *Client) once(ctx context.Context, cl call) error {
	tok, err := c.tok.get()
	if err != nil {
		return &APIError{Op: cl.op, Target: cl.target, Message: err.Error(), Kind: ErrUnauthorized}
	}
	u := *c.base
	u.Path = c.base.Path + "/customers/" + url.PathEscape(c.cfg.Customer) + cl.path
	if len(cl.query) > 0 {
		u.RawQuery = cl.query.Encode()
	}
	var body io.Reader
	if cl.body != nil {
		b, err := json.Marshal(cl.body)
		if err != nil {
			return fmt.Errorf("%s: encoding request: %w", cl.op, err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, cl.method, u.String(), body)
	if err != nil {
		return fmt.Errorf("%s: %w", cl.op, err)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return unanswered(cl, req, err, tok)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if kind := kindForStatus(resp.StatusCode); kind != nil {
		return c.refused(cl, resp, kind, data, tok)
	}
	if cl.out == nil || len(bytes.TrimSpace(data)) == 0 {
		return nil
	}
	if err := json.Unmarshal(data, cl.out); err != nil {
		return &APIError{Op: cl.op, Target: cl.target, Status: resp.StatusCode,
			Message: "answer is not the expected JSON: " + err.Error(), Kind: ErrInvalid}
	}
	return nil
}

// unanswered is the error of a request the API did not answer. Only HTTP
// 5xx and 429 are retried, so this goes back to the caller, whose own
// retry loop decides. A url.Error names the URL last asked for, which a
// redirect's Location chose: the method, the URL asked for and the cause
// are kept instead.
func unanswered(cl call, req *http.Request, err error, tok string) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = fmt.Errorf("%s %s: %w", req.Method, req.URL.Redacted(), ue.Err)
	}
	return &APIError{Op: cl.op, Target: cl.target, Message: redact.Text(err.Error(), tok), Kind: ErrUnavailable}
}

// refused is the error of an answer whose status is kind, data its body
// and tok the credential the request carried.
func (c *Client) refused(cl call, resp *http.Response, kind error, data []byte, tok string) error {
	ae := &APIError{Op: cl.op, Target: cl.target, Status: resp.StatusCode,
		Message: apiMessage(data, tok), Kind: kind}
	if kind == ErrForbidden && cl.forbiddenHint != "" {
		ae.Hint = cl.forbiddenHint
	}
	if kind == ErrUnauthorized {
		ae.Hint = "the credential in " + c.cfg.TokenFile + " was rejected; renew it"
	}
	if resp.StatusCode == 429 || resp.StatusCode == 503 {
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
			return &retryAfterError{APIError: ae, after: time.Duration(s) * time.Second}
		}
	}
	return ae
}

// Unwrap lets errors.As find the APIError inside a retryAfterError.
func (e *retryAfterError) Unwrap() error { return e.APIError }

// echoMax bounds what of an error body goes into an error text.
const echoMax = 200

// apiMessage extracts the human message from an error body, without the
// credential tok or anything shaped like one; the API answers
// {"message": "..."} but a proxy in front of it may answer HTML that
// echoes the request's headers.
func apiMessage(b []byte, tok string) string {
	var m struct {
		Message string `json:"message"`
		Error   string `json:"error"`
	}
	if json.Unmarshal(b, &m) == nil {
		if m.Message != "" {
			return redact.Text(m.Message, tok)
		}
		if m.Error != "" {
			return redact.Text(m.Error, tok)
		}
	}
	return redact.Echo(b, echoMax, tok)
}
