package kubeevents

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// fakeAPI is a FAKE of the Kubernetes API server's core/v1 Events (no API
// server runs here): create, get and JSON merge patch in any namespace,
// with the bearer token checked, as the node plugin uses them; and get of
// PersistentVolumeClaims, for their uid. Events are kept by name (the
// names the plugin gives differ across namespaces too).
type fakeAPI struct {
	mu       sync.Mutex
	token    string
	events   map[string]*corev1.Event
	requests []string // "POST name", "PATCH name", "GET name"; "GET pvc ns/name"
	answer   int      // when not 0, every request gets this status
	invalid  string   // requests about the Event of this name get 422
	hold     chan struct{}
	// claims holds the PersistentVolumeClaims' uids by namespace/name.
	claims map[string]string
	// denied namespaces answer 403 to every request, as RBAC does for an
	// account granted nothing there.
	denied map[string]bool
}

func newFakeAPI(token string) *fakeAPI {
	return &fakeAPI{token: token, events: map[string]*corev1.Event{}, claims: map[string]string{}, denied: map[string]bool{}}
}

func (f *fakeAPI) status(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(metav1.Status{Status: "Failure", Message: msg, Code: int32(code)})
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	ns, resource, name, ok := f.route(w, r)
	if !ok {
		return
	}
	if resource == "persistentvolumeclaims" {
		f.serveClaim(w, r, ns, name)
		return
	}
	body, _ := io.ReadAll(r.Body)
	if r.Method == http.MethodPost {
		var e corev1.Event
		if err := json.Unmarshal(body, &e); err != nil {
			f.status(w, http.StatusBadRequest, err.Error())
			return
		}
		if e.Namespace != ns {
			f.status(w, http.StatusBadRequest, "the namespace of the provided object does not match the namespace sent on the request")
			return
		}
		name = e.Name
	}
	f.requests = append(f.requests, r.Method+" "+name)
	if name == f.invalid && name != "" {
		f.status(w, http.StatusUnprocessableEntity, fmt.Sprintf("Event %q is invalid: message: Too long", name))
		return
	}
	if f.answer != 0 {
		f.status(w, f.answer, fmt.Sprintf(`events is forbidden: User "system:serviceaccount:csi-driver:vco-csi-node" cannot %s resource "events" in API group "" in the namespace "default"`, strings.ToLower(r.Method)))
		return
	}
	f.serveEvent(w, r, name, body)
}

// route reads /api/v1/namespaces/<ns>/<resource>[/<name>] and answers
// what the API server would for a wrong path, a wrong token or a
// namespace the plugin's grant does not reach.
func (f *fakeAPI) route(w http.ResponseWriter, r *http.Request) (ns, resource, name string, ok bool) {
	parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/api/v1/namespaces/"), "/")
	if !strings.HasPrefix(r.URL.Path, "/api/v1/namespaces/") || len(parts) < 2 || len(parts) > 3 ||
		(parts[1] != "events" && parts[1] != "persistentvolumeclaims") {
		f.status(w, http.StatusNotFound, "no such path "+r.URL.Path)
		return "", "", "", false
	}
	ns, resource = parts[0], parts[1]
	if len(parts) == 3 {
		name = parts[2]
	}
	if r.Header.Get("Authorization") != "Bearer "+f.token {
		f.status(w, http.StatusUnauthorized, "Unauthorized")
		return "", "", "", false
	}
	if f.denied[ns] {
		f.requests = append(f.requests, r.Method+" denied "+ns+"/"+resource)
		f.status(w, http.StatusForbidden, fmt.Sprintf(`%s is forbidden: User "system:serviceaccount:csi-driver:vco-csi-node" cannot %s resource %q in API group "" in the namespace %q`,
			resource, strings.ToLower(r.Method), resource, ns))
		return "", "", "", false
	}
	return ns, resource, name, true
}

// serveClaim answers a GET of a claim the fake knows.
func (f *fakeAPI) serveClaim(w http.ResponseWriter, r *http.Request, ns, name string) {
	f.requests = append(f.requests, r.Method+" pvc "+ns+"/"+name)
	uid, ok := f.claims[ns+"/"+name]
	if r.Method != http.MethodGet || !ok {
		f.status(w, http.StatusNotFound, fmt.Sprintf("persistentvolumeclaims %q not found", name))
		return
	}
	json.NewEncoder(w).Encode(corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID(uid)}})
}

// serveEvent creates, reads or merge-patches the Event name.
func (f *fakeAPI) serveEvent(w http.ResponseWriter, r *http.Request, name string, body []byte) {
	old := f.events[name]
	switch r.Method {
	case http.MethodPost:
		if old != nil {
			f.status(w, http.StatusConflict, fmt.Sprintf("events %q already exists", name))
			return
		}
		var e corev1.Event
		json.Unmarshal(body, &e)
		f.events[name] = &e
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(e)
	case http.MethodGet:
		if old == nil {
			f.status(w, http.StatusNotFound, fmt.Sprintf("events %q not found", name))
			return
		}
		json.NewEncoder(w).Encode(old)
	case http.MethodPatch:
		f.patchEvent(w, r, name, old, body)
	default:
		f.status(w, http.StatusMethodNotAllowed, r.Method)
	}
}

// patchEvent applies a merge patch to the Event old.
func (f *fakeAPI) patchEvent(w http.ResponseWriter, r *http.Request, name string, old *corev1.Event, body []byte) {
	if old == nil {
		f.status(w, http.StatusNotFound, fmt.Sprintf("events %q not found", name))
		return
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/merge-patch+json" {
		f.status(w, http.StatusUnsupportedMediaType, "content type "+ct)
		return
	}
	var cur, patch map[string]any
	b, _ := json.Marshal(old)
	json.Unmarshal(b, &cur)
	if err := json.Unmarshal(body, &patch); err != nil {
		f.status(w, http.StatusBadRequest, err.Error())
		return
	}
	b, _ = json.Marshal(mergePatch(cur, patch))
	var e corev1.Event
	json.Unmarshal(b, &e)
	f.events[name] = &e
	json.NewEncoder(w).Encode(e)
}

// mergePatch applies a JSON merge patch (RFC 7386).
func mergePatch(cur, patch map[string]any) map[string]any {
	if cur == nil {
		cur = map[string]any{}
	}
	for k, v := range patch {
		switch pv := v.(type) {
		case nil:
			delete(cur, k)
		case map[string]any:
			cm, _ := cur[k].(map[string]any)
			cur[k] = mergePatch(cm, pv)
		default:
			cur[k] = v
		}
	}
	return cur
}

func (f *fakeAPI) snapshot() (map[string]corev1.Event, []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev := map[string]corev1.Event{}
	for k, v := range f.events {
		ev[k] = *v
	}
	return ev, append([]string(nil), f.requests...)
}

func (f *fakeAPI) set(fn func(f *fakeAPI)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

const testToken = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2VuLWZvci10ZXN0cw.c2ln"

type results struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *results) observe(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[s]++
}

func (r *results) get(s string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[s]
}

// lockedBuffer collects log lines from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type rig struct {
	api   *fakeAPI
	srv   *httptest.Server
	token string // the token file
	res   *results
	log   *lockedBuffer
}

func newRig(t *testing.T) *rig {
	api := newFakeAPI(testToken)
	srv := httptest.NewTLSServer(api)
	t.Cleanup(srv.Close)
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte(testToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return &rig{api: api, srv: srv, token: tok, res: &results{}, log: &lockedBuffer{}}
}

// poster starts a Poster (a plugin process) against the rig's API server.
func (r *rig) poster(t *testing.T, interval time.Duration) (*Poster, context.CancelFunc) {
	p, err := New(Config{Node: "worker-1", Server: r.srv.URL, TokenFile: r.token, Client: r.srv.Client(),
		Log: slog.New(slog.NewTextHandler(r.log, nil)), Observe: r.res.observe,
		Interval: interval, Retry: 20 * time.Millisecond, MaxRetry: 50 * time.Millisecond, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	return p, stop
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func sec(t time.Time) time.Time { return t.Truncate(time.Second) }

var agentStart = time.Date(2026, 12, 1, 6, 0, 0, 123456789, time.UTC)

func refusal(seq uint64) Report {
	return Report{AgentStarted: agentStart, Seq: seq, Time: agentStart.Add(time.Duration(seq) * time.Second),
		Reason: "DiskRefused", Type: corev1.EventTypeWarning, Volume: "pvc-1", Device: "/dev/sdb",
		HolderKey: "0000000000abcdef", HolderNode: "worker-2",
		Message: "volume pvc-1: disk /dev/sdb is held by worker-2 (key 0000000000abcdef); it is set read-only and nothing is mounted"}
}

func TestPostsTheEventAboutTheNode(t *testing.T) {
	r := newRig(t)
	p, _ := r.poster(t, time.Hour)
	p.Record(refusal(7))
	eventually(t, "the Event", func() bool { ev, _ := r.api.snapshot(); return len(ev) == 1 })
	ev, _ := r.api.snapshot()
	e := ev[EventName("worker-1", refusal(7))]
	want := corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: "worker-1", UID: "worker-1"}
	if e.InvolvedObject != want {
		t.Errorf("involvedObject %+v, want %+v", e.InvolvedObject, want)
	}
	if e.Namespace != "default" || e.Reason != "DiskRefused" || e.Type != "Warning" || e.Count != 1 ||
		e.Message != refusal(7).Message || e.Source.Component != "vco-csi" || e.Source.Host != "worker-1" ||
		e.ReportingController != "vco-csi" || e.ReportingInstance != "worker-1" {
		t.Errorf("Event %+v", e)
	}
	// The API keeps whole seconds.
	if !e.FirstTimestamp.Time.Equal(sec(refusal(7).Time)) || !e.LastTimestamp.Time.Equal(sec(refusal(7).Time)) {
		t.Errorf("timestamps %v..%v, want the agent's %v", e.FirstTimestamp, e.LastTimestamp, refusal(7).Time)
	}
	if e.Annotations[annSeq] != "7" || e.Annotations[annStarted] != "2026-12-01T06:00:00.123456789Z" {
		t.Errorf("annotations %v", e.Annotations)
	}
	if !strings.HasPrefix(e.Name, "worker-1.vco-") {
		t.Errorf("name %q", e.Name)
	}
	eventually(t, "created counted", func() bool { return r.res.get("created") == 1 })
}

// The uevent watcher may refuse the same disk again and again: one Event
// counts the repeats, written at most once per interval.
func TestRepeatsAreCountedOnOneEvent(t *testing.T) {
	r := newRig(t)
	const interval = 300 * time.Millisecond
	p, _ := r.poster(t, interval)
	start := time.Now()
	for seq := uint64(1); seq <= 20; seq++ {
		p.Record(refusal(seq))
	}
	other := refusal(21)
	other.Device, other.Message = "/dev/sdc", strings.Replace(other.Message, "sdb", "sdc", 1)
	p.Record(other)
	name := EventName("worker-1", refusal(1))
	eventually(t, "count 20 and the other", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 20 && len(ev) == 2 })
	ev, reqs := r.api.snapshot()
	if len(ev) != 2 || ev[EventName("worker-1", other)].Count != 1 {
		t.Errorf("Events %v; want the refusal of sdb counted 20 times and one of sdc", ev)
	}
	e := ev[name]
	if !e.FirstTimestamp.Time.Equal(sec(refusal(1).Time)) || !e.LastTimestamp.Time.Equal(sec(refusal(20).Time)) || e.Annotations[annSeq] != "20" {
		t.Errorf("first %v last %v seq %s; want %v, %v, 20", e.FirstTimestamp, e.LastTimestamp, e.Annotations[annSeq], refusal(1).Time, refusal(20).Time)
	}
	// The first occurrence right away, the rest folded into writes at
	// least an interval apart.
	writes := 0
	for _, q := range reqs {
		if strings.HasSuffix(q, name) {
			writes++
		}
	}
	elapsed := time.Since(start)
	if maxWrites := 1 + int(elapsed/interval) + 1; writes > maxWrites {
		t.Errorf("%d writes of one Event in %v with an interval of %v: %v", writes, elapsed, interval, reqs)
	}
	for seq := uint64(22); seq <= 23; seq++ {
		p.Record(refusal(seq))
	}
	eventually(t, "count 22", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 22 })
}

// A restarted plugin receives the agent's ring again: what the previous
// process posted is not posted twice, and the occurrences it had not
// seen are added to the same Event.
func TestARestartedPluginDoesNotPostTwice(t *testing.T) {
	r := newRig(t)
	p1, stop1 := r.poster(t, time.Millisecond)
	fenced := Report{AgentStarted: agentStart, Seq: 4, Reason: "DiskFenced", Type: "Warning", Volume: "pvc-2",
		Device: "/dev/sdd", Message: "volume pvc-2: the reservation on /dev/sdd was lost; I/O stopped"}
	for _, seq := range []uint64{2, 3, 5} {
		p1.Record(refusal(seq))
	}
	p1.Record(fenced)
	name := EventName("worker-1", refusal(1))
	eventually(t, "the first process's Events", func() bool {
		ev, _ := r.api.snapshot()
		return ev[name].Count == 3 && len(ev) == 2
	})
	eventually(t, "the first process's writes answered", func() bool { return r.res.get("created") == 2 })
	stop1()

	// The second process: the agent's ring replays 2..5, then a new
	// refusal 9 comes.
	p2, _ := r.poster(t, time.Millisecond)
	for _, seq := range []uint64{2, 3, 5} {
		p2.Record(refusal(seq))
	}
	p2.Record(fenced)
	eventually(t, "the replay reconciled", func() bool { return r.res.get("already_posted") == 4 })
	p2.Record(refusal(9))
	eventually(t, "count 4", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 4 })
	time.Sleep(50 * time.Millisecond)
	ev, reqs := r.api.snapshot()
	if len(ev) != 2 || ev[name].Count != 4 || ev[EventName("worker-1", fenced)].Count != 1 {
		t.Errorf("Events after the restart %v; want the refusal counted 4 times, the fence once", ev)
	}
	if ev[name].Annotations[annSeq] != "9" || !ev[name].FirstTimestamp.Time.Equal(sec(refusal(2).Time)) {
		t.Errorf("annotations %v first %v", ev[name].Annotations, ev[name].FirstTimestamp)
	}
	if r.res.get("created") != 2 {
		t.Errorf("created %d Events, want 2: %v", r.res.get("created"), reqs)
	}

	// An agent that restarted (a later start time, sequence numbers from
	// 1 again) reporting the same refusal counts on the same Event.
	again := refusal(1)
	again.AgentStarted = agentStart.Add(time.Hour)
	p2.Record(again)
	eventually(t, "count 5", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 5 })
}

// The replay may still be arriving when the restarted plugin has read the
// Event back: the rest of it is not counted again.
func TestReplayArrivingAfterTheEventWasReadIsNotCounted(t *testing.T) {
	r := newRig(t)
	p1, stop1 := r.poster(t, time.Millisecond)
	for _, seq := range []uint64{2, 3, 5} {
		p1.Record(refusal(seq))
	}
	name := EventName("worker-1", refusal(1))
	eventually(t, "count 3", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 3 })
	eventually(t, "answered", func() bool { return r.res.get("created") == 1 })
	stop1()
	p2, _ := r.poster(t, time.Millisecond)
	p2.Record(refusal(2))
	eventually(t, "the Event read back", func() bool { return r.res.get("already_posted") == 1 })
	p2.Record(refusal(3))
	p2.Record(refusal(5))
	p2.Record(refusal(6))
	eventually(t, "count 4", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count >= 4 })
	time.Sleep(50 * time.Millisecond)
	if ev, _ := r.api.snapshot(); ev[name].Count != 4 || ev[name].Annotations[annSeq] != "6" {
		t.Errorf("count %d seq %s after the replay 2, 3, 5 and the new 6; want 4 and 6", ev[name].Count, ev[name].Annotations[annSeq])
	}
	if r.res.get("already_posted") != 3 {
		t.Errorf("already_posted %d, want 3", r.res.get("already_posted"))
	}
}

// With the API server unreachable or slow, Record returns at once, the
// failure is logged once, and the Events are posted with their full
// counts when it answers again.
func TestAPIDownDoesNotBlock(t *testing.T) {
	r := newRig(t)
	hold := make(chan struct{})
	r.api.set(func(f *fakeAPI) { f.hold = hold })
	p, _ := r.poster(t, time.Millisecond)
	start := time.Now()
	for seq := uint64(1); seq <= 1000; seq++ {
		p.Record(refusal(seq))
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("1000 Records took %v with the API server hanging", d)
	}
	r.api.set(func(f *fakeAPI) { f.hold, f.answer = nil, http.StatusServiceUnavailable })
	close(hold)
	eventually(t, "failures", func() bool { return r.res.get("failed") >= 3 })
	if n := strings.Count(r.log.String(), "Kubernetes Events cannot be posted"); n != 1 {
		t.Errorf("the failure is logged %d times, want once:\n%s", n, r.log)
	}
	r.api.set(func(f *fakeAPI) { f.answer = 0 })
	name := EventName("worker-1", refusal(1))
	eventually(t, "count 1000", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 1000 })
	eventually(t, "the recovery logged", func() bool { return strings.Contains(r.log.String(), "Kubernetes Events are posted again") })
}

// An Event the API server refuses as invalid is given up at once and does
// not hold up the others.
func TestInvalidEventDoesNotHoldUpTheOthers(t *testing.T) {
	r := newRig(t)
	bad := refusal(1)
	bad.Volume = "pvc-bad"
	r.api.set(func(f *fakeAPI) { f.invalid = EventName("worker-1", bad) })
	p, _ := r.poster(t, time.Millisecond)
	p.Record(bad)
	p.Record(refusal(2))
	eventually(t, "the good Event", func() bool { ev, _ := r.api.snapshot(); return len(ev) == 1 })
	time.Sleep(100 * time.Millisecond)
	_, reqs := r.api.snapshot()
	if n := strings.Count(strings.Join(reqs, "\n"), EventName("worker-1", bad)); n != 1 {
		t.Errorf("the invalid Event was sent %d times: %v", n, reqs)
	}
	if !strings.Contains(r.log.String(), "refused a Kubernetes Event as invalid") {
		t.Errorf("log:\n%s", r.log)
	}
}

// Missing RBAC: the log says what to grant, once, and never shows the
// token.
func TestForbiddenSaysWhatToGrant(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.answer = http.StatusForbidden })
	p, _ := r.poster(t, time.Millisecond)
	p.Record(refusal(1))
	eventually(t, "failures", func() bool { return r.res.get("failed") >= 3 })
	out := r.log.String()
	if !strings.Contains(out, "HTTP 403") || !strings.Contains(out, "create, get and patch on events, and get on persistentvolumeclaims, in every namespace (ClusterRole vco-csi-node-events") {
		t.Errorf("the log does not say what to grant:\n%s", out)
	}
	if strings.Count(out, "HTTP 403") != 1 {
		t.Errorf("logged more than once:\n%s", out)
	}
	if strings.Contains(out, testToken) || strings.Contains(out, "c2VjcmV0") {
		t.Errorf("the token reached the log:\n%s", out)
	}
}

// The projected token rotates: each request reads it again. An old token
// the API server no longer accepts is an error that names no token.
func TestTokenIsReadForEachRequest(t *testing.T) {
	r := newRig(t)
	p, _ := r.poster(t, time.Millisecond)
	p.Record(refusal(1))
	eventually(t, "the Event", func() bool { return r.res.get("created") == 1 })
	const rotated = "rotated-token-value"
	r.api.set(func(f *fakeAPI) { f.token = rotated })
	p.Record(refusal(2))
	eventually(t, "a 401", func() bool { return r.res.get("failed") >= 1 })
	if out := r.log.String(); !strings.Contains(out, "HTTP 401") || strings.Contains(out, testToken) {
		t.Errorf("log:\n%s", out)
	}
	if err := os.WriteFile(r.token, []byte(rotated), 0o600); err != nil {
		t.Fatal(err)
	}
	name := EventName("worker-1", refusal(1))
	eventually(t, "count 2 with the new token", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 2 })
}

// An Event the API server deleted (--event-ttl) is made again.
func TestExpiredEventIsMadeAgain(t *testing.T) {
	r := newRig(t)
	p, _ := r.poster(t, time.Millisecond)
	p.Record(refusal(1))
	name := EventName("worker-1", refusal(1))
	eventually(t, "the Event", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 1 })
	r.api.set(func(f *fakeAPI) { delete(f.events, name) })
	p.Record(refusal(2))
	eventually(t, "made again", func() bool { ev, _ := r.api.snapshot(); return ev[name].Count == 2 })
	eventually(t, "two creations", func() bool { return r.res.get("created") == 2 })
}

// Beyond MaxSeries waiting Events, new ones are dropped (counted, logged
// once), never queued without bound; written ones make room.
func TestWaitingEventsAreBounded(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.answer = http.StatusServiceUnavailable })
	p, err := New(Config{Node: "worker-1", Server: r.srv.URL, TokenFile: r.token, Client: r.srv.Client(),
		Log: slog.New(slog.NewTextHandler(r.log, nil)), Observe: r.res.observe, MaxSeries: 3})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		rep := refusal(uint64(i + 1))
		rep.Volume = fmt.Sprintf("pvc-%d", i)
		p.Record(rep)
	}
	if r.res.get("dropped") != 2 || strings.Count(r.log.String(), "dropping new ones") != 1 {
		t.Errorf("dropped %d, log:\n%s", r.res.get("dropped"), r.log)
	}
}

func TestEventName(t *testing.T) {
	a, b := refusal(1), refusal(2)
	b.Time = b.Time.Add(time.Hour)
	if EventName("n", a) != EventName("n", b) {
		t.Error("the same refusal at another time or sequence has another name")
	}
	c := refusal(1)
	c.HolderNode = "worker-3"
	if EventName("n", a) == EventName("n", c) || EventName("n", a) == EventName("m", a) {
		t.Error("another holder or node has the same name")
	}
	for _, long := range []string{strings.Repeat("a", 253), strings.Repeat("a", 231) + ".b" + strings.Repeat("c", 20)} {
		if n := EventName(long, a); len(n) > 253 || strings.Contains(n, "..") {
			t.Errorf("name %q of %d characters", n, len(n))
		}
	}
}

func TestTruncate(t *testing.T) {
	s := strings.Repeat("é", 600) // 1200 bytes
	got := truncate(s, maxMessage)
	if len(got) > maxMessage || !strings.HasSuffix(got, "…") || !strings.HasPrefix(s, strings.TrimSuffix(got, "…")) {
		t.Errorf("truncated to %d bytes: %q", len(got), got[len(got)-10:])
	}
	if truncate("short", maxMessage) != "short" {
		t.Error("short message changed")
	}
}

func TestInClusterOutsideAPod(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := InCluster("n", t.TempDir(), Config{}); err != ErrNotInCluster {
		t.Errorf("err %v, want ErrNotInCluster", err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	if _, err := InCluster("n", t.TempDir(), Config{}); err == nil || !strings.Contains(err.Error(), "CA") {
		t.Errorf("without a CA file: %v", err)
	}
}

// A proxy in front of the API server whose error pages echo the request's
// headers: the token straddling the 512th byte, where the page is cut, or
// whole in a Status message, never reaches the log in any piece.
func TestEchoedTokenNeverLogged(t *testing.T) {
	const head = "<html><head><title>502 Bad Gateway</title></head><body><pre>"
	for _, tc := range []struct {
		name string
		page func(auth string) (string, []byte)
	}{
		{"page cut across the token", func(auth string) (string, []byte) {
			pad := strings.Repeat("x", 512-len(head)-len("X-Pad: \nAuthorization: Bearer ")-len(testToken)/2)
			return "text/html", []byte(head + "X-Pad: " + pad + "\nAuthorization: " + auth + "\n</pre></body></html>")
		}},
		{"Status message", func(auth string) (string, []byte) {
			b, _ := json.Marshal(metav1.Status{Status: "Failure", Code: 502, Message: "upstream said no to " + auth})
			return "application/json", b
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			proxy := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				ct, b := tc.page(req.Header.Get("Authorization"))
				w.Header().Set("Content-Type", ct)
				w.WriteHeader(http.StatusBadGateway)
				w.Write(b)
			}))
			defer proxy.Close()
			p, err := New(Config{Node: "worker-1", Server: proxy.URL, TokenFile: r.token, Client: proxy.Client(),
				Log: slog.New(slog.NewTextHandler(r.log, nil)), Observe: r.res.observe,
				Interval: time.Millisecond, Retry: 20 * time.Millisecond, MaxRetry: 50 * time.Millisecond, Timeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { p.Run(ctx); close(done) }()
			defer func() { cancel(); <-done }()
			p.Record(refusal(1))
			eventually(t, "a failure", func() bool { return r.res.get("failed") >= 1 })
			out := r.log.String()
			if !strings.Contains(out, "HTTP 502") {
				t.Fatalf("the failure is not logged:\n%s", out)
			}
			parts := strings.Split(testToken, ".")
			for i := 0; i+8 <= len(testToken); i++ {
				parts = append(parts, testToken[i:i+8])
			}
			for _, piece := range parts {
				if strings.Contains(out, piece) {
					t.Fatalf("%q of the token reached the log:\n%s", piece, out)
				}
			}
		})
	}
}
