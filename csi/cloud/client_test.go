package cloud_test

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
)

const customer = "acme"

// A JWT-shaped credential: the test checks that neither it nor its
// signature part leaks.
const jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjc2kifQ.c2lnbmF0dXJlLXNlY3JldC12YWx1ZQ"

type env struct {
	sim    *sim.Server
	srv    *httptest.Server
	client *cloud.Client
	tokens string
	// seen records the Authorization header of every request.
	mu   sync.Mutex
	seen []string
	// intercept, if set, answers instead of the simulator when it returns true.
	intercept func(w http.ResponseWriter, r *http.Request) bool
}

func newEnv(t *testing.T, mod func(*cloud.Config)) *env {
	t.Helper()
	dir := t.TempDir()
	s, err := sim.New(sim.Options{Customer: customer, Token: jwt, StateFile: filepath.Join(dir, "state.json"), Seed: sim.DefaultSeed()})
	if err != nil {
		t.Fatal(err)
	}
	e := &env{sim: s, tokens: filepath.Join(dir, "token")}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.seen = append(e.seen, r.Header.Get("Authorization"))
		ic := e.intercept
		e.mu.Unlock()
		if ic != nil && ic(w, r) {
			return
		}
		s.ServeHTTP(w, r)
	}))
	t.Cleanup(e.srv.Close)
	if err := os.WriteFile(e.tokens, []byte(jwt+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := cloud.Config{BaseURL: e.srv.URL + "/api/1", Customer: customer, TokenFile: e.tokens,
		BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	c, err := cloud.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.client = c
	return e
}

func (e *env) setIntercept(f func(w http.ResponseWriter, r *http.Request) bool) {
	e.mu.Lock()
	e.intercept = f
	e.mu.Unlock()
}

func (e *env) requests() int { e.mu.Lock(); defer e.mu.Unlock(); return len(e.seen) }

func TestDiskLifecycle(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	c := e.client

	id := createAndResizeDisk(ctx, t, c)
	// VMs, attach with a PCI address, refusal of a second VM.
	attachRefuseSecondVMAndDetach(ctx, t, c, id)
	checkDiskNotes(ctx, t, c, id)
	// Snapshots and clone.
	snapshotCloneAndDeleteAll(ctx, t, c, id)
}

// createAndResizeDisk creates pvc-1 in ch-lug-1, finds it by ID (only in
// its own location) and by name, resizes it to 5 GiB and returns its ID.
func createAndResizeDisk(ctx context.Context, t *testing.T, c *cloud.Client) int64 {
	t.Helper()
	locs, err := c.ListLocations(ctx)
	if err != nil || len(locs) != 3 || locs[0] != "ch-lug-1" {
		t.Fatalf("locations = %v, %v", locs, err)
	}
	id, err := c.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: "pvc-1", Description: "d", SizeGiB: 3, IOPS: 500, Type: cloud.DiskTypeData})
	if err != nil {
		t.Fatal(err)
	}
	d, err := c.GetDisk(ctx, "ch-lug-1", id)
	if err != nil || d.Name != "pvc-1" || d.SizeGiB != 3 || d.IOTune == nil || d.IOTune.IOPS != 500 || d.VMID != 0 {
		t.Fatalf("disk = %+v, %v", d, err)
	}
	if _, err := c.GetDisk(ctx, "ch-gen-1", id); !errors.Is(err, cloud.ErrNotFound) {
		t.Fatalf("disk from another location: %v, want ErrNotFound", err)
	}
	if f, err := c.FindDiskByName(ctx, "ch-lug-1", "pvc-1"); err != nil || f == nil || f.ID != id {
		t.Fatalf("find by name = %+v, %v", f, err)
	}
	if err := c.ResizeDisk(ctx, "ch-lug-1", id, 5); err != nil {
		t.Fatal(err)
	}
	if d, _ := c.GetDisk(ctx, "ch-lug-1", id); d.SizeGiB != 5 {
		t.Fatalf("size after resize = %d", d.SizeGiB)
	}
	return id
}

// attachRefuseSecondVMAndDetach attaches disk id to the first VM of the
// first cloudspace with a PCI slot, checks that a second VM and a delete
// are refused while it is attached, and detaches it (once).
func attachRefuseSecondVMAndDetach(ctx context.Context, t *testing.T, c *cloud.Client, id int64) {
	t.Helper()
	css, err := c.ListCloudspaces(ctx)
	if err != nil || len(css) != 3 || css[0].Location != "ch-lug-1" {
		t.Fatalf("cloudspaces = %+v, %v", css, err)
	}
	vms, err := c.ListVMs(ctx, css[0].ID)
	if err != nil || len(vms) != 2 || vms[0].ReferenceID == "" {
		t.Fatalf("vms = %+v, %v", vms, err)
	}
	if err := c.AttachDisk(ctx, css[0].ID, vms[0].ID, id); err != nil {
		t.Fatal(err)
	}
	vd, err := c.ListVMDisks(ctx, css[0].ID, vms[0].ID)
	if err != nil || len(vd) != 1 || vd[0].ID != id || vd[0].PCISlot == 0 {
		t.Fatalf("vm disks = %+v, %v", vd, err)
	}
	if d, _ := c.GetDisk(ctx, "ch-lug-1", id); d.VMID != vms[0].ID || d.CloudspaceID != css[0].ID {
		t.Fatalf("attached disk = %+v", d)
	}
	err = c.AttachDisk(ctx, css[0].ID, vms[1].ID, id)
	if !errors.Is(err, cloud.ErrConflict) {
		t.Fatalf("attach to a second VM: %v, want ErrConflict", err)
	}
	if err := c.DeleteDisk(ctx, "ch-lug-1", id); !errors.Is(err, cloud.ErrConflict) {
		t.Fatalf("delete attached disk: %v, want ErrConflict", err)
	}
	if err := c.DetachDisk(ctx, css[0].ID, vms[0].ID, id); err != nil {
		t.Fatal(err)
	}
	if err := c.DetachDisk(ctx, css[0].ID, vms[0].ID, id); !errors.Is(err, cloud.ErrNotFound) {
		t.Fatalf("second detach: %v, want ErrNotFound", err)
	}
}

// checkDiskNotes sets a note twice under one key: the second replaces the
// first. A note added under the same key then stands beside it.
func checkDiskNotes(ctx context.Context, t *testing.T, c *cloud.Client, id int64) {
	t.Helper()
	if err := c.SetDiskNote(ctx, "ch-lug-1", id, "holder", "a"); err != nil {
		t.Fatal(err)
	}
	if err := c.SetDiskNote(ctx, "ch-lug-1", id, "holder", "b"); err != nil {
		t.Fatal(err)
	}
	notes, err := c.ListDiskNotes(ctx, "ch-lug-1", id)
	if err != nil || len(notes) != 1 || notes[0].Content != "b" {
		t.Fatalf("notes = %+v, %v", notes, err)
	}
	if err := c.AddDiskNote(ctx, "ch-lug-1", id, "holder", "c"); err != nil {
		t.Fatal(err)
	}
	notes, err = c.ListDiskNotes(ctx, "ch-lug-1", id)
	if err != nil || len(notes) != 2 || notes[0].Content != "b" || notes[1].Content != "c" || notes[1].Title != "holder" {
		t.Fatalf("notes after an add = %+v, %v", notes, err)
	}
}

// snapshotCloneAndDeleteAll snapshots disk id, clones the snapshot, checks
// that a disk with a snapshot is not deleted, then deletes the snapshot
// and both disks and finds the location empty.
func snapshotCloneAndDeleteAll(ctx context.Context, t *testing.T, c *cloud.Client, id int64) {
	t.Helper()
	snap, err := c.CreateSnapshot(ctx, "ch-lug-1", id, "snap-a")
	if err != nil || snap == "" {
		t.Fatalf("snapshot = %q, %v", snap, err)
	}
	snaps, err := c.ListSnapshots(ctx, "ch-lug-1", id)
	if err != nil || len(snaps) != 1 || snaps[0].ID != snap || snaps[0].Name != "snap-a" || snaps[0].CreationTime == 0 {
		t.Fatalf("snapshots = %+v, %v", snaps, err)
	}
	clone, err := c.CloneSnapshot(ctx, "ch-lug-1", id, snap, "pvc-2", "clone")
	if err != nil || clone == 0 || clone == id {
		t.Fatalf("clone = %d, %v", clone, err)
	}
	if d, err := c.GetDisk(ctx, "ch-lug-1", clone); err != nil || d.SizeGiB != 5 || d.Name != "pvc-2" {
		t.Fatalf("clone disk = %+v, %v", d, err)
	}
	if err := c.DeleteDisk(ctx, "ch-lug-1", id); !errors.Is(err, cloud.ErrConflict) {
		t.Fatalf("delete disk with snapshot: %v, want ErrConflict", err)
	}
	if err := c.DeleteSnapshot(ctx, "ch-lug-1", id, snap); err != nil {
		t.Fatal(err)
	}
	for _, x := range []int64{id, clone} {
		if err := c.DeleteDisk(ctx, "ch-lug-1", x); err != nil {
			t.Fatal(err)
		}
	}
	if disks, err := c.ListDisks(ctx, "ch-lug-1"); err != nil || len(disks) != 0 {
		t.Fatalf("disks left = %+v, %v", disks, err)
	}
}

func TestStatePersistsAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state.json")
	open := func() *cloud.Client {
		s, err := sim.New(sim.Options{Customer: customer, StateFile: state, Seed: sim.DefaultSeed()})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(s)
		t.Cleanup(srv.Close)
		tok := filepath.Join(dir, "tok")
		os.WriteFile(tok, []byte("x.y.z"), 0o600)
		c, err := cloud.New(cloud.Config{BaseURL: srv.URL + "/api/1", Customer: customer, TokenFile: tok})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	id, err := open().CreateDisk(context.Background(), "nl-ams-1", cloud.DiskSpec{Name: "keep", SizeGiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := open().GetDisk(context.Background(), "nl-ams-1", id)
	if err != nil || d.Name != "keep" {
		t.Fatalf("after restart: %+v, %v", d, err)
	}
}

func TestTokenReloadedWhenFileChanges(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	if _, err := e.client.ListLocations(ctx); err != nil {
		t.Fatal(err)
	}
	// Rotate. (The simulator still expects the old one and answers 401;
	// what matters here is what the client sent.)
	const rotated = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyb3RhdGVkIn0.bmV3LXNpZ25hdHVyZS12YWx1ZQ"
	if err := os.WriteFile(e.tokens, []byte(rotated), 0o600); err != nil {
		t.Fatal(err)
	}
	future := time.Now().Add(time.Minute)
	os.Chtimes(e.tokens, future, future)
	if _, err := e.client.ListLocations(ctx); !errors.Is(err, cloud.ErrUnauthorized) {
		t.Fatalf("err = %v, want ErrUnauthorized from the simulator", err)
	}
	e.mu.Lock()
	last := e.seen[len(e.seen)-1]
	e.mu.Unlock()
	if last != "Bearer "+rotated {
		t.Fatalf("after rotation the client sent %q", last)
	}
}

func TestRetriesOnlyServerErrorsAndRateLimits(t *testing.T) {
	e := newEnv(t, func(c *cloud.Config) { c.MaxAttempts = 4 })
	ctx := context.Background()

	// 503 every time: all attempts used, then ErrUnavailable.
	e.sim.SetFaults(sim.Faults{ErrorRate: 1})
	before := e.requests()
	_, err := e.client.ListLocations(ctx)
	if !errors.Is(err, cloud.ErrUnavailable) || e.requests()-before != 4 {
		t.Fatalf("503s: err=%v after %d requests, want ErrUnavailable after 4", err, e.requests()-before)
	}
	e.sim.SetFaults(sim.Faults{})

	// 429 twice, then the simulator answers.
	var n atomic.Int32
	e.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if n.Add(1) <= 2 {
			w.WriteHeader(http.StatusTooManyRequests)
			return true
		}
		return false
	})
	if _, err := e.client.ListLocations(ctx); err != nil || n.Load() != 3 {
		t.Fatalf("429s: err=%v after %d requests", err, n.Load())
	}

	// 404 and 400 are final at once.
	e.setIntercept(nil)
	before = e.requests()
	if _, err := e.client.GetDisk(ctx, "ch-lug-1", 999); !errors.Is(err, cloud.ErrNotFound) || e.requests()-before != 1 {
		t.Fatalf("404: err=%v after %d requests", err, e.requests()-before)
	}
	before = e.requests()
	if _, err := e.client.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: "x", SizeGiB: 0}); !errors.Is(err, cloud.ErrInvalid) || e.requests()-before != 1 {
		t.Fatalf("400: err=%v after %d requests", err, e.requests()-before)
	}
}

func TestRateLimitedIsTyped(t *testing.T) {
	e := newEnv(t, func(c *cloud.Config) { c.MaxAttempts = 2 })
	e.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		w.WriteHeader(http.StatusTooManyRequests)
		return true
	})
	if _, err := e.client.ListLocations(context.Background()); !errors.Is(err, cloud.ErrRateLimited) {
		t.Fatalf("err = %v, want ErrRateLimited", err)
	}
}

func TestCreateRetryDoesNotDuplicate(t *testing.T) {
	e := newEnv(t, nil)
	// The first create reaches the simulator, but its answer is lost as a
	// 502 from a proxy; the retry must find the disk, not make a second.
	var once atomic.Bool
	e.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/disks") && once.CompareAndSwap(false, true) {
			e.sim.ServeHTTP(httptest.NewRecorder(), r)
			w.WriteHeader(http.StatusBadGateway)
			return true
		}
		return false
	})
	id, err := e.client.CreateDisk(context.Background(), "ch-gen-1", cloud.DiskSpec{Name: "once", SizeGiB: 1})
	if err != nil || id == 0 {
		t.Fatalf("create = %d, %v", id, err)
	}
	disks, _ := e.client.ListDisks(context.Background(), "ch-gen-1")
	if len(disks) != 1 || disks[0].ID != id {
		t.Fatalf("disks = %+v, want exactly disk %d", disks, id)
	}
}

func TestForbiddenCreateNamesLocationGrant(t *testing.T) {
	e := newEnv(t, nil)
	e.sim.SetFaults(sim.Faults{ForbidCreate: true})
	_, err := e.client.CreateDisk(context.Background(), "nl-ams-1", cloud.DiskSpec{Name: "x", SizeGiB: 1})
	if !errors.Is(err, cloud.ErrForbidden) || !strings.Contains(err.Error(), "location-scoped grant on location nl-ams-1") {
		t.Fatalf("err = %v", err)
	}
}

func TestCredentialNeverInErrors(t *testing.T) {
	e := newEnv(t, func(c *cloud.Config) { c.MaxAttempts = 1 })
	// A misbehaving server that echoes the request's credential back.
	for _, code := range []int{400, 401, 403, 500} {
		e.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			w.WriteHeader(code)
			w.Write([]byte(`{"message":"bad request with header ` + r.Header.Get("Authorization") + `"}`))
			return true
		})
		_, err := e.client.ListLocations(context.Background())
		if err == nil {
			t.Fatalf("HTTP %d: no error", code)
		}
		sig := jwt[strings.LastIndexByte(jwt, '.')+1:]
		if strings.Contains(err.Error(), jwt) || strings.Contains(err.Error(), sig) {
			t.Fatalf("HTTP %d: error text carries the credential: %v", code, err)
		}
		if !strings.Contains(err.Error(), "[redacted]") {
			t.Fatalf("HTTP %d: echoed credential was not replaced: %v", code, err)
		}
	}
	// A bad credential file path is named, its content is not.
	os.WriteFile(e.tokens, []byte(""), 0o600)
	future := time.Now().Add(time.Hour)
	os.Chtimes(e.tokens, future, future)
	_, err := e.client.ListLocations(context.Background())
	if !errors.Is(err, cloud.ErrUnauthorized) || !strings.Contains(err.Error(), e.tokens) {
		t.Fatalf("empty credential: %v", err)
	}
}

func TestEveryCallHasADeadline(t *testing.T) {
	e := newEnv(t, func(c *cloud.Config) { c.CallTimeout = 50 * time.Millisecond })
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(10 * time.Second)})
	// No deadline on the context: the client's own bounds the call.
	_, err := e.client.ListLocations(context.Background())
	if !errors.Is(err, cloud.ErrUnavailable) || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("err = %v, want a deadline error", err)
	}
}

func TestCustomCA(t *testing.T) {
	s, err := sim.New(sim.Options{Customer: customer, Seed: sim.DefaultSeed()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewTLSServer(s)
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	os.WriteFile(ca, pemBytes, 0o600)
	tok := filepath.Join(dir, "tok")
	os.WriteFile(tok, []byte("a.b.c"), 0o600)

	withCA, err := cloud.New(cloud.Config{BaseURL: srv.URL + "/api/1", Customer: customer, TokenFile: tok, CAFile: ca})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := withCA.ListLocations(context.Background()); err != nil {
		t.Fatalf("with the CA: %v", err)
	}
	without, _ := cloud.New(cloud.Config{BaseURL: srv.URL + "/api/1", Customer: customer, TokenFile: tok, MaxAttempts: 1})
	if _, err := without.ListLocations(context.Background()); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("without the CA: %v, want a certificate error", err)
	}
}

// TestSnapshotDetailCreationTime: the snapshot endpoint's creation_time
// is a string in the API's schema; the number the list uses, an RFC 3339
// time, and none at all are read too.
func TestSnapshotDetailCreationTime(t *testing.T) {
	for _, tc := range []struct {
		body string
		want int64 // 0: none reported
	}{
		{`{"snapshot_id":"s","creation_time":"1764560000","disks":[{"disk_id":7}]}`, 1764560000},
		{`{"snapshot_id":"s","creation_time":1764560000}`, 1764560000},
		{`{"snapshot_id":"s","creation_time":"2025-12-01T03:33:20Z"}`, 1764560000},
		{`{"snapshot_id":"s","creation_time":""}`, 0},
		{`{"snapshot_id":"s"}`, 0},
		{`{"snapshot_id":"s","creation_time":null}`, 0},
	} {
		var d cloud.SnapshotDetail
		if err := json.Unmarshal([]byte(tc.body), &d); err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		got, ok := d.Created()
		if ok != (tc.want != 0) || (ok && got.Unix() != tc.want) {
			t.Errorf("%s: created %v, %v; want %d", tc.body, got, ok, tc.want)
		}
	}
	var d cloud.SnapshotDetail
	_ = json.Unmarshal([]byte(`{"disks":[{"disk_id":7}]}`), &d)
	if !d.HasDisk(7) || d.HasDisk(8) {
		t.Errorf("HasDisk: %+v", d)
	}
}

// TestCreateSizeGB: the create call's disk_size (documented in GB) for a
// disk of n GiB holds n GiB read as GB or as GiB, and is the least that does.
func TestCreateSizeGB(t *testing.T) {
	const gb, gib = int64(1_000_000_000), int64(1) << 30
	for n := int64(1); n <= 64<<10; n++ {
		c := cloud.CreateSizeGB(n)
		if c*gb < n*gib || (c-1)*gb >= n*gib || c < n {
			t.Fatalf("%d GiB: disk_size %d GB", n, c)
		}
	}
	if c := cloud.CreateSizeGB(10); c != 11 {
		t.Errorf("10 GiB: disk_size %d, want 11 GB", c)
	}
}

// pieces are the runs of a token that must not reach an error text: each
// of its parts and every 8-byte window across it.
func pieces(tok string) []string {
	p := strings.Split(tok, ".")
	for i := 0; i+8 <= len(tok); i++ {
		p = append(p, tok[i:i+8])
	}
	return p
}

// TestProxyEchoCutAcrossToken: a proxy's error page that echoes the
// request's headers, with the credential straddling the 200th byte where
// the echo is cut, leaves no piece of the credential in the error, at
// every offset of the cut.
func TestProxyEchoCutAcrossToken(t *testing.T) {
	e := newEnv(t, func(c *cloud.Config) { c.MaxAttempts = 1 })
	const head = "<html><head><title>502 Bad Gateway</title></head><body><pre>upstream failed; request was\n"
	for start := 200 - len(jwt) + 1; start < 200; start++ {
		e.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			pad := strings.Repeat("x", start-len(head)-len("X-Pad: \nAuthorization: "))
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(http.StatusBadGateway)
			w.Write([]byte(head + "X-Pad: " + pad + "\nAuthorization: " + r.Header.Get("Authorization") +
				"\nUser-Agent: " + r.Header.Get("User-Agent") + "\n</pre></body></html>"))
			return true
		})
		_, err := e.client.ListLocations(context.Background())
		if !errors.Is(err, cloud.ErrUnavailable) || !strings.Contains(err.Error(), "502 Bad Gateway") {
			t.Fatalf("token at byte %d: %v, want the proxy's 502 with its title", start, err)
		}
		for _, p := range pieces(jwt) {
			if strings.Contains(err.Error(), p) {
				t.Fatalf("token at byte %d, cut at 200: %q of the credential is in the error: %v", start, p, err)
			}
		}
	}
}

// TestHTTPOnlyToLoopback: an API URL of plain http to another host is
// refused unless InsecureAllowHTTP says otherwise; to a loopback address
// it is accepted.
func TestHTTPOnlyToLoopback(t *testing.T) {
	tok := filepath.Join(t.TempDir(), "tok")
	os.WriteFile(tok, []byte(jwt), 0o600)
	for _, tc := range []struct {
		url      string
		insecure bool
		refused  string
	}{
		{"http://try.whitesky.cloud/api/1", false, "is http to try.whitesky.cloud, which is not a loopback address"},
		{"http://10.0.2.100:8080/api/1", false, "--insecure-allow-http"},
		{"ftp://try.whitesky.cloud/api/1", true, "not an absolute http(s) URL"},
		{"http://10.0.2.100:8080/api/1", true, ""},
		{"http://127.0.0.1:8080/api/1", false, ""},
		{"http://[::1]:8080/api/1", false, ""},
		{"http://localhost:8080/api/1", false, ""},
		{"https://try.whitesky.cloud/api/1", false, ""},
	} {
		_, err := cloud.New(cloud.Config{BaseURL: tc.url, Customer: customer, TokenFile: tok, InsecureAllowHTTP: tc.insecure})
		if tc.refused == "" && err != nil || tc.refused != "" && (err == nil || !strings.Contains(err.Error(), tc.refused)) {
			t.Errorf("%s (insecure %v): %v, want refused %q", tc.url, tc.insecure, err, tc.refused)
		}
	}
}

// TestRedirectToHTTPCarriesNoCredential: an https API that redirects to
// plain http (here on the same loopback host, where net/http would keep
// the Authorization header) is not followed; the http server sees nothing.
func TestRedirectToHTTPCarriesNoCredential(t *testing.T) {
	var got atomic.Value
	got.Store("")
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Store("request with Authorization " + r.Header.Get("Authorization"))
		w.Write([]byte(`{"locations":[]}`))
	}))
	defer plain.Close()
	for _, code := range []int{http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, plain.URL+r.URL.Path, code)
		}))
		defer srv.Close()
		dir := t.TempDir()
		ca, tok := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "tok")
		os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600)
		os.WriteFile(tok, []byte(jwt), 0o600)
		c, err := cloud.New(cloud.Config{BaseURL: srv.URL + "/api/1", Customer: customer, TokenFile: tok, CAFile: ca, MaxAttempts: 1})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.ListLocations(context.Background())
		if err == nil || !strings.Contains(err.Error(), "refused a redirect from "+srv.URL+" to "+plain.URL) {
			t.Errorf("HTTP %d to http: %v, want the redirect refused", code, err)
		}
		if s := got.Load().(string); s != "" {
			t.Fatalf("HTTP %d: the http server got a %s", code, s)
		}
	}
}
