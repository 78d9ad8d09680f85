package kubeevents

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
	"github.com/whitesky-cloud/vco-storage/internal/redact"
)

const (
	// Namespace holds the Events about the Node: the API server accepts an
	// Event about a cluster-scoped object such as a Node only in "default"
	// (or in no namespace), which is where the kubelet puts its own Node
	// Events. An Event about a claim or a pod lives in the object's
	// namespace.
	Namespace = "default"
	// Component is the Events' source and reporting controller.
	Component = "vco-csi"

	// The agent process and sequence number of the last occurrence an
	// Event counts: what a restarted plugin compares the replayed events
	// with.
	annStarted = "cloud.whitesky/agent-started"
	annSeq     = "cloud.whitesky/agent-sequence"

	maxMessage  = 1024 // the API's limit on a new-style Event's note
	maxInstance = 128  // the API's limit on reportingInstance
	// maxUnreconciled bounds the occurrences remembered one by one for an
	// Event not yet known to exist; the agent's ring holds 256 events.
	maxUnreconciled = 1024
)

// ServiceAccountDir is where a pod's API token and CA are projected.
const ServiceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// ErrNotInCluster says the process is not in a pod: no API server is named.
var ErrNotInCluster = errors.New("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")

var errNoNode = errors.New("no node name: set --node-name, or NODE_NAME from the downward API (spec.nodeName)")

// Report is one agent event to show in Kubernetes.
type Report struct {
	// AgentStarted and Seq identify the event: the agent process's start
	// time (its GetStatus) and the event's sequence number in it.
	AgentStarted time.Time
	Seq          uint64
	Time         time.Time
	// Reason is the agent's event type, e.g. DiskRefused.
	Reason string
	// Type is corev1.EventTypeWarning or corev1.EventTypeNormal.
	Type string
	// Volume, Device, HolderKey and HolderNode, where the agent gave them.
	Volume, Device, HolderKey, HolderNode string
	// Serial is the disk's serial, where the agent gave it: a refusal
	// by the uevent watcher names no volume, only the disk.
	Serial string
	// Message is the agent's sentence.
	Message string
	// About is the object the Event is about besides the Node; the zero
	// Object means the Node.
	About Object
}

// The kinds of Object.
const (
	KindClaim = "PersistentVolumeClaim"
	KindPod   = "Pod"
)

// Object is a namespaced object an Event is about: the
// PersistentVolumeClaim a volume was made for, or a pod it is published
// to.
type Object struct {
	Kind, Namespace, Name string
	// UID is a pod's, from the kubelet (podInfoOnMount); a claim's is read
	// from the API server when its first Event is written, since `kubectl
	// describe` finds Events by the object's uid too.
	UID string
}

// Config says where and how to post.
type Config struct {
	// Node is the Kubernetes name of the Node the Events are about.
	Node string
	// Server is the API server, https://host:port.
	Server string
	// TokenFile holds the ServiceAccount token; it is read for every
	// request, since the projected token rotates.
	TokenFile string
	// Client makes the requests; it carries the API server's CA.
	Client *http.Client
	Log    *slog.Logger
	// Observe, when set, is told each outcome: an Event created or
	// updated, a request failed, an occurrence already_posted (by a
	// previous plugin process) or dropped (too many Events waiting).
	Observe func(result string)
	// Interval is the least time between two writes of one Event; the
	// occurrences in between are folded into its count. Default 30 s.
	Interval time.Duration
	// Retry is the first wait after a failed request, doubled up to
	// MaxRetry (defaults 1 s and 1 min).
	Retry, MaxRetry time.Duration
	// Timeout bounds one request (default 10 s).
	Timeout time.Duration
	// MaxSeries bounds the Events remembered (default 512).
	MaxSeries int
}

// Poster writes Reports as Events. Record never blocks on the API: Run,
// on its own goroutine, does the writing.
type Poster struct {
	cfg  Config
	now  func() time.Time
	wake chan struct{}

	mu       sync.Mutex
	series   map[string]*series
	order    uint64
	retryAt  time.Time
	backoff  time.Duration
	failing  bool
	failures int
	dropping bool
	// denied: an Event about a claim or a pod was refused for want of
	// RBAC; said once until one is posted again.
	denied bool
}

// pos is an event's place in the agent's history.
type pos struct {
	started time.Time
	seq     uint64
}

func (a pos) after(b pos) bool {
	if !a.started.Equal(b.started) {
		return a.started.After(b.started)
	}
	return a.seq > b.seq
}

// series is one Event: the occurrences of one report about one object.
type series struct {
	name        string
	r           Report // the latest occurrence
	uid         string // the object's, once known
	order       uint64
	first, last time.Time
	latest      pos
	count       int32
	// written is the count the API holds, once known.
	written int32
	// known: the Event's state in the API is known (this process wrote or
	// read it). Until then the occurrences are kept one by one, to be
	// compared with what a previous plugin process already counted.
	known        bool
	unreconciled []pos
	extra        int32 // occurrences beyond maxUnreconciled
	// held is the last occurrence the Event a previous plugin process
	// wrote counts: the rest of the replay, arriving after the Event was
	// read, is not counted again.
	held      pos
	notBefore time.Time
}

func (s *series) dirty() bool { return !s.known || s.count != s.written }

// New makes a Poster with cfg.
func New(cfg Config) (*Poster, error) {
	if cfg.Node == "" {
		return nil, errNoNode
	}
	if cfg.Server == "" || cfg.Client == nil || cfg.TokenFile == "" {
		return nil, errors.New("kubeevents: Server, Client and TokenFile are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Observe == nil {
		cfg.Observe = func(string) {}
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 30 * time.Second
	}
	if cfg.Retry <= 0 {
		cfg.Retry = time.Second
	}
	if cfg.MaxRetry < cfg.Retry {
		cfg.MaxRetry = max(time.Minute, cfg.Retry)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.MaxSeries <= 0 {
		cfg.MaxSeries = 512
	}
	cfg.Server = strings.TrimRight(cfg.Server, "/")
	return &Poster{cfg: cfg, now: time.Now, wake: make(chan struct{}, 1), series: map[string]*series{}}, nil
}

// InCluster makes a Poster for node through the API server and
// ServiceAccount of the pod it runs in (files under dir, normally
// ServiceAccountDir). It fails with ErrNotInCluster outside a pod.
func InCluster(node, dir string, cfg Config) (*Poster, error) {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, ErrNotInCluster
	}
	if node == "" {
		return nil, errNoNode
	}
	caFile := dir + "/ca.crt"
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("the Kubernetes API's CA: %w; the node DaemonSet projects it (volume kube-api-access)", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("the Kubernetes API's CA file %s holds no PEM certificate", caFile)
	}
	cfg.Node, cfg.Server, cfg.TokenFile = node, "https://"+net.JoinHostPort(host, port), dir+"/token"
	cfg.Client = &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
		CheckRedirect: cleartext.CheckRedirect}
	return New(cfg)
}

// EventName is the name of the Event reporting r by node, about node or
// about r.About: the same report (type, volume, device, holder,
// sentence) about the same object always has the same name, so its
// occurrences are counted on one Event and a restarted plugin finds the
// Event it wrote before.
func EventName(node string, r Report) string {
	h := sha256.New()
	fields := []string{node, r.Reason, r.Type, r.Volume, r.Device, r.HolderKey, r.HolderNode, r.Message}
	prefix := node
	if a := r.About; a.Kind != "" {
		fields, prefix = append(fields, a.Kind, a.Namespace, a.Name, a.UID), a.Name
	}
	for _, f := range fields {
		h.Write([]byte(f))
		h.Write([]byte{0})
	}
	suffix := ".vco-" + hex.EncodeToString(h.Sum(nil)[:8])
	if len(prefix)+len(suffix) > 253 {
		prefix = strings.TrimRight(prefix[:253-len(suffix)], ".-")
	}
	return prefix + suffix
}

// Record queues r. It never waits for the API.
func (p *Poster) Record(r Report) {
	if r.Time.IsZero() {
		r.Time = p.now()
	}
	name := EventName(p.cfg.Node, r)
	p.mu.Lock()
	s := p.series[name]
	if s == nil {
		if len(p.series) >= p.cfg.MaxSeries && !p.evictLocked() {
			warn := !p.dropping
			p.dropping = true
			p.mu.Unlock()
			p.cfg.Observe("dropped")
			if warn {
				p.cfg.Log.Warn("too many Kubernetes Events wait to be posted; dropping new ones until the API server takes them (the journal and `vco-agent events` have them all)",
					"waiting", p.cfg.MaxSeries, "reason", r.Reason, "volume", r.Volume, "device", r.Device)
			}
			return
		}
		p.order++
		s = &series{name: name, order: p.order, first: r.Time, uid: r.About.UID}
		p.series[name] = s
	}
	p.dropping = false
	at := pos{r.AgentStarted, r.Seq}
	if s.known && !at.after(s.held) {
		p.mu.Unlock()
		p.cfg.Observe("already_posted")
		return
	}
	s.r, s.last = r, r.Time
	if at.after(s.latest) {
		s.latest = at
	}
	s.count++
	if !s.known {
		if len(s.unreconciled) < maxUnreconciled {
			s.unreconciled = append(s.unreconciled, at)
		} else {
			s.extra++
		}
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// evictLocked forgets the written Event seen longest ago. Forgetting is
// safe: a later occurrence finds the Event by its name and counts on.
func (p *Poster) evictLocked() bool {
	var old *series
	for _, s := range p.series {
		if !s.dirty() && (old == nil || s.last.Before(old.last)) {
			old = s
		}
	}
	if old == nil {
		return false
	}
	delete(p.series, old.name)
	return true
}

// Run writes queued Events until ctx ends.
func (p *Poster) Run(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		d := p.flush(ctx)
		if ctx.Err() != nil {
			return
		}
		var tc <-chan time.Time
		if d >= 0 {
			t.Reset(d)
			tc = t.C
		}
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
		case <-tc:
		}
		t.Stop()
	}
}

// flush writes every Event that is due, oldest first, and returns how long
// until the next is due (-1: none waits). A failed request stops the
// round: the API server is unreachable or refuses us, and every Event
// waits for the retry.
func (p *Poster) flush(ctx context.Context) time.Duration {
	for ctx.Err() == nil {
		now := p.now()
		p.mu.Lock()
		if now.Before(p.retryAt) {
			d := p.retryAt.Sub(now)
			p.mu.Unlock()
			return d
		}
		var due *series
		next := time.Duration(-1)
		for _, s := range p.series {
			if !s.dirty() {
				continue
			}
			if w := s.notBefore.Sub(now); w > 0 {
				if next < 0 || w < next {
					next = w
				}
				continue
			}
			if due == nil || s.order < due.order {
				due = s
			}
		}
		p.mu.Unlock()
		if due == nil {
			return next
		}
		err := p.write(ctx, due)
		if ctx.Err() != nil {
			return -1
		}
		if p.givenUp(due, err) {
			continue
		}
		p.mu.Lock()
		if err != nil {
			p.failures++
			if p.backoff == 0 {
				p.backoff = p.cfg.Retry
			} else {
				p.backoff = min(2*p.backoff, p.cfg.MaxRetry)
			}
			p.retryAt = p.now().Add(p.backoff)
			warn := !p.failing
			p.failing = true
			p.mu.Unlock()
			p.cfg.Observe("failed")
			if warn {
				p.cfg.Log.Warn("Kubernetes Events cannot be posted; retrying, the agent's events stay in its journal and in `vco-agent events`", "err", err.Error())
			}
			continue
		}
		if p.failing {
			p.cfg.Log.Info("Kubernetes Events are posted again", "failed_attempts", p.failures)
		}
		p.failing, p.failures, p.backoff = false, 0, 0
		p.mu.Unlock()
	}
	return -1
}

// givenUp gives s up when err says that asking again would get the same
// answer (an invalid Event, a claim that is gone, no permission for
// Events about claims and pods): retrying would hold up every other Event
// behind it. It says whether it did.
func (p *Poster) givenUp(s *series, err error) bool {
	rej, den, gone := (*rejectedError)(nil), (*deniedError)(nil), (*goneError)(nil)
	if !errors.As(err, &rej) && !errors.As(err, &den) && !errors.As(err, &gone) {
		return false
	}
	p.mu.Lock()
	s.known, s.written, s.unreconciled, s.extra = true, s.count, nil, 0
	s.notBefore = p.now().Add(p.cfg.Interval)
	first := !p.denied
	if den != nil {
		p.denied = true
	}
	p.mu.Unlock()
	p.cfg.Observe("failed")
	switch {
	case den != nil:
		if first {
			p.cfg.Log.Warn("Kubernetes Events about claims and pods cannot be posted; those about the node still are, and the journal has the agent's events", "err", err.Error())
		}
	case gone != nil:
		p.cfg.Log.Info("a claim is gone; the agent's event is posted about the node only", "err", err.Error())
	default:
		p.cfg.Log.Warn("the API server refused a Kubernetes Event as invalid; it is not posted (the journal has the agent's event)", "err", err.Error())
	}
	return true
}

// eventLocked is s as the Event to write.
func (p *Poster) eventLocked(s *series) *corev1.Event {
	node, r := p.cfg.Node, s.r
	inst := node
	if len(inst) > maxInstance {
		inst = inst[:maxInstance]
	}
	// The kubelet refers to its Node with the node's name as the UID
	// too; `kubectl describe node` looks for both.
	about := corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: node, UID: types.UID(node)}
	if a := r.About; a.Kind != "" {
		about = corev1.ObjectReference{Kind: a.Kind, APIVersion: "v1", Namespace: a.Namespace, Name: a.Name, UID: types.UID(s.uid)}
	}
	return &corev1.Event{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Event"},
		ObjectMeta: metav1.ObjectMeta{
			Name: s.name, Namespace: namespaceOf(r),
			Labels: map[string]string{"app.kubernetes.io/part-of": "vco-csi"},
			Annotations: map[string]string{
				annStarted: s.latest.started.UTC().Format(time.RFC3339Nano),
				annSeq:     strconv.FormatUint(s.latest.seq, 10),
			},
		},
		InvolvedObject: about,
		Reason:         r.Reason,
		Message:        truncate(r.Message, maxMessage),
		Source:         corev1.EventSource{Component: Component, Host: node},
		FirstTimestamp: metav1.NewTime(s.first),
		LastTimestamp:  metav1.NewTime(s.last),
		Count:          s.count,
		Type:           r.Type,
		// Legacy Events (no eventTime) may carry these; `kubectl get
		// events` shows them as the source.
		ReportingController: Component,
		ReportingInstance:   inst,
	}
}

// namespaceOf is where the Event reporting r lives.
func namespaceOf(r Report) string {
	if r.About.Kind != "" {
		return r.About.Namespace
	}
	return Namespace
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n-len("…")]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "…"
}

// write brings one Event up to date: a PATCH of its count when this
// process knows it exists, else a POST; a POST that finds the Event
// already there (a previous plugin process wrote it) reads it and counts
// only the occurrences it does not hold yet.
func (p *Poster) write(ctx context.Context, s *series) error {
	p.mu.Lock()
	about, uid := s.r.About, s.uid
	p.mu.Unlock()
	if about.Kind == KindClaim && uid == "" {
		if err := p.claimUID(ctx, s, about); err != nil {
			return err
		}
	}
	p.mu.Lock()
	ev, known := p.eventLocked(s), s.known
	p.mu.Unlock()
	if known {
		patch := map[string]any{
			"count": ev.Count, "lastTimestamp": ev.LastTimestamp,
			"metadata": map[string]any{"annotations": ev.Annotations},
		}
		code, msg, err := p.do(ctx, http.MethodPatch, p.eventURL(ev.Namespace, s.name), patch, nil)
		switch {
		case err != nil:
			return p.failed("updating", ev, err)
		case code == http.StatusNotFound:
			// Deleted meanwhile (the API server's --event-ttl): make it
			// again with the whole count.
		case code/100 == 2:
			p.wrote(s, ev.Count, "updated")
			return nil
		default:
			return p.failed("updating", ev, apiError(code, msg, objectOf(ev)))
		}
	}
	code, msg, err := p.do(ctx, http.MethodPost, p.collectionURL(ev.Namespace), ev, nil)
	switch {
	case err != nil:
		return p.failed("creating", ev, err)
	case code == http.StatusConflict:
		return p.reconcile(ctx, s, ev)
	case code/100 == 2:
		p.wrote(s, ev.Count, "created")
		return nil
	default:
		return p.failed("creating", ev, apiError(code, msg, objectOf(ev)))
	}
}

// reconcile reads the Event a previous plugin process wrote and adds the
// occurrences it does not count yet; they are written by the next flush.
func (p *Poster) reconcile(ctx context.Context, s *series, ev *corev1.Event) error {
	var old corev1.Event
	code, msg, err := p.do(ctx, http.MethodGet, p.eventURL(ev.Namespace, s.name), nil, &old)
	if err != nil {
		return p.failed("reading", ev, err)
	}
	if code/100 != 2 {
		return p.failed("reading", ev, apiError(code, msg, objectOf(ev)))
	}
	var held pos
	if t, err := time.Parse(time.RFC3339Nano, old.Annotations[annStarted]); err == nil {
		if n, err := strconv.ParseUint(old.Annotations[annSeq], 10, 64); err == nil {
			held = pos{t, n}
		}
	}
	p.mu.Lock()
	n := s.extra
	for _, at := range s.unreconciled {
		if at.after(held) {
			n++
		}
	}
	skipped := len(s.unreconciled) + int(s.extra-n)
	s.known, s.unreconciled, s.extra, s.held = true, nil, 0, held
	s.written, s.count = old.Count, old.Count+n
	if !old.FirstTimestamp.IsZero() {
		s.first = old.FirstTimestamp.Time
	}
	if held.after(s.latest) {
		s.latest = held
	}
	p.mu.Unlock()
	for range skipped {
		p.cfg.Observe("already_posted")
	}
	return nil
}

func (p *Poster) wrote(s *series, count int32, result string) {
	p.mu.Lock()
	s.known, s.written, s.unreconciled, s.extra = true, count, nil, 0
	s.notBefore = p.now().Add(p.cfg.Interval)
	if s.r.About.Kind != "" {
		p.denied = false
	}
	p.mu.Unlock()
	p.cfg.Observe(result)
}

// claimUID reads the uid of the claim s is about: `kubectl describe pvc`
// finds Events by the claim's uid as well as by its name.
func (p *Poster) claimUID(ctx context.Context, s *series, c Object) error {
	var pvc corev1.PersistentVolumeClaim
	u := p.cfg.Server + "/api/v1/namespaces/" + url.PathEscape(c.Namespace) + "/persistentvolumeclaims/" + url.PathEscape(c.Name)
	code, msg, err := p.do(ctx, http.MethodGet, u, nil, &pvc)
	what := fmt.Errorf("reading claim %s/%s of volume %s, to post %s about it", c.Namespace, c.Name, s.r.Volume, s.r.Reason)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %w", what, err)
	case code == http.StatusNotFound:
		// The claim is gone (deleted since its volume was staged):
		// nothing to show the report on but the Node.
		return &goneError{fmt.Errorf("%w: HTTP 404: %s", what, msg)}
	case code/100 != 2:
		return fmt.Errorf("%w: %w", what, apiError(code, msg, c))
	case pvc.UID == "":
		return &rejectedError{fmt.Errorf("%w: the API server's answer has no uid", what)}
	}
	p.mu.Lock()
	s.uid = string(pvc.UID)
	p.mu.Unlock()
	return nil
}

func (p *Poster) failed(what string, ev *corev1.Event, err error) error {
	about := "node " + p.cfg.Node
	if ev.InvolvedObject.Kind != "Node" {
		about = ev.InvolvedObject.Kind + " " + ev.InvolvedObject.Namespace + "/" + ev.InvolvedObject.Name + " (reported by node " + p.cfg.Node + ")"
	}
	return fmt.Errorf("%s Event %s/%s (%s about %s): %w", what, ev.Namespace, ev.Name, ev.Reason, about, err)
}

func (p *Poster) collectionURL(ns string) string {
	return p.cfg.Server + "/api/v1/namespaces/" + url.PathEscape(ns) + "/events"
}

func (p *Poster) eventURL(ns, name string) string {
	return p.collectionURL(ns) + "/" + url.PathEscape(name)
}

// apiError says what an answer of the API server to a request about an
// Event (or about its object) means for the operator.
func apiError(code int, msg string, about Object) error {
	switch code {
	case http.StatusUnauthorized:
		return fmt.Errorf("HTTP 401: the API server did not accept the node plugin's ServiceAccount token (%s)", msg)
	case http.StatusForbidden:
		err := fmt.Errorf("HTTP 403: %s; the node plugin's ServiceAccount needs create, get and patch on events, and get on persistentvolumeclaims, in every namespace (ClusterRole vco-csi-node-events, deploy/manifests/31-rbac-node.yaml)", msg)
		if about.Kind != "" && about.Kind != "Node" {
			return &deniedError{err}
		}
		return err
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		return &rejectedError{fmt.Errorf("HTTP %d: %s", code, msg)}
	}
	return fmt.Errorf("HTTP %d: %s", code, msg)
}

// goneError: the claim an Event would be about does not exist.
type goneError struct{ error }

func (e *goneError) Unwrap() error { return e.error }

// objectOf is what ev is about.
func objectOf(ev *corev1.Event) Object {
	o := ev.InvolvedObject
	return Object{Kind: o.Kind, Namespace: o.Namespace, Name: o.Name, UID: string(o.UID)}
}

// deniedError: the node plugin may not post an Event about a claim or a
// pod (an older add-on's RBAC, or one trimmed by hand). The Event is
// given up, as an invalid one is; the Node's Events go on.
type deniedError struct{ error }

func (e *deniedError) Unwrap() error { return e.error }

// rejectedError: the API server refused this one Event as invalid. Asking
// again would get the same answer and hold up every other Event behind
// it, so it is given up.
type rejectedError struct{ error }

func (e *rejectedError) Unwrap() error { return e.error }

// do makes one request. The token is read for each request and goes into
// the Authorization header only: no error or log line carries it.
func (p *Poster) do(ctx context.Context, method, u string, in, out any) (int, string, error) {
	tok, err := os.ReadFile(p.cfg.TokenFile)
	if err != nil {
		return 0, "", fmt.Errorf("the ServiceAccount token: %w", err)
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return 0, "", err
		}
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return 0, "", err
	}
	bearer := strings.TrimSpace(string(tok))
	req.Header.Set("Authorization", "Bearer "+bearer)
	req.Header.Set("Accept", "application/json")
	switch method {
	case http.MethodPatch:
		req.Header.Set("Content-Type", "application/merge-patch+json")
	case http.MethodPost:
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := p.cfg.Client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 == 2 && out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return 0, "", fmt.Errorf("the API server's answer is not an Event: %w", err)
		}
		return resp.StatusCode, "", nil
	}
	// The answer goes into the log: a proxy's page may echo the token.
	var st metav1.Status
	if json.Unmarshal(b, &st) == nil && st.Message != "" {
		return resp.StatusCode, redact.Text(st.Message, bearer), nil
	}
	return resp.StatusCode, redact.Echo(b, 512, bearer), nil
}
