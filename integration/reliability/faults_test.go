package reliability

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/drivername"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
)

const (
	testJWT  = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJyZWxpYWJpbGl0eSJ9.cmVsaWFiaWxpdHktc2lnbmF0dXJlLXNlY3JldA"
	hostUUID = "4c4c4544-0042-3510-8052-b4c04f4a4d32"
	hostLoc  = "ch-lug-1"
)

// faultProxy stands between the API client and the simulator and injects
// what the simulator's own fault switches do not: bursts of a given
// status, 429 with Retry-After, requests that take effect only after the
// client gave up on them, and a detach that the API reports as failed and
// that happens a little later. It is test scaffolding around the real
// simulator.
type faultProxy struct {
	sim *sim.Server

	mu       sync.Mutex
	burst    int // the next burst requests matching burstOn get burstCode
	burstOn  string
	burstCo  int
	retryAft string
	// echoAuth puts the request's Authorization header into a burst's
	// answer, as a misconfigured proxy might.
	echoAuth bool
	// echoAt, when set, makes a burst's answer an HTML error page that
	// echoes every request header, the Authorization header's value
	// starting at byte echoAt: a proxy's error page.
	echoAt int
	// slowOn requests are held for slowFor, then served by the simulator
	// after the client has given up.
	slowOn  string
	slowFor time.Duration
	// lateDetach: a detach answers 504 and is carried out lateBy later.
	lateDetach bool
	lateBy     time.Duration
	late       sync.WaitGroup
	injected   map[string]int
}

func match(on string, r *http.Request) bool {
	m, p, _ := strings.Cut(on, " ")
	return (m == "*" || m == r.Method) && strings.Contains(r.URL.Path, p)
}

func (f *faultProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	if f.burst > 0 && match(f.burstOn, r) {
		f.burst--
		code, ra, echo, at := f.burstCo, f.retryAft, f.echoAuth, f.echoAt
		f.injected[fmt.Sprintf("HTTP %d", code)]++
		f.mu.Unlock()
		if ra != "" {
			w.Header().Set("Retry-After", ra)
		}
		if at > 0 {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(code)
			w.Write(headerPage(code, r, at))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		if echo {
			fmt.Fprintf(w, `{"message":"injected %d for %s"}`, code, r.Header.Get("Authorization"))
		} else {
			fmt.Fprintf(w, `{"message":"injected %d"}`, code)
		}
		return
	}
	if f.slowOn != "" && match(f.slowOn, r) {
		d := f.slowFor
		f.slowOn = ""
		f.injected["request that takes effect after the client's timeout"]++
		f.mu.Unlock()
		body, _ := io.ReadAll(r.Body)
		// Held until the client gives up on it, then carried out.
		select {
		case <-r.Context().Done():
		case <-time.After(d):
		}
		r2 := r.Clone(context.Background())
		r2.Body = io.NopCloser(bytes.NewReader(body))
		f.sim.ServeHTTP(httptest.NewRecorder(), r2)
		return
	}
	if f.lateDetach && r.Method == http.MethodDelete && strings.Contains(r.URL.Path, "/vms/") {
		f.lateDetach = false
		d := f.lateBy
		f.injected["detach answered 504 and done late"]++
		f.late.Add(1)
		f.mu.Unlock()
		r2 := r.Clone(context.Background())
		go func() {
			defer f.late.Done()
			time.Sleep(d)
			f.sim.ServeHTTP(httptest.NewRecorder(), r2)
		}()
		w.WriteHeader(http.StatusGatewayTimeout)
		fmt.Fprint(w, `{"message":"gateway timeout"}`)
		return
	}
	f.mu.Unlock()
	f.sim.ServeHTTP(w, r)
}

// headerPage is a proxy's error page for code that echoes r's headers,
// padded so that the Authorization header's value starts at byte at (or
// as near after it as the page's head allows).
func headerPage(code int, r *http.Request, at int) []byte {
	head := fmt.Sprintf("<html><head><title>%d %s</title></head><body><h1>%s</h1><pre>", code, http.StatusText(code), http.StatusText(code))
	const auth = "\nAuthorization: "
	pad := max(0, at-len(head)-len("X-Pad: ")-len(auth))
	var b strings.Builder
	b.WriteString(head + "X-Pad: " + strings.Repeat("-", pad) + auth + r.Header.Get("Authorization") + "\n")
	keys := slices.Sorted(maps.Keys(r.Header))
	for _, k := range keys {
		if k != "Authorization" {
			fmt.Fprintf(&b, "%s: %s\n", k, strings.Join(r.Header[k], ", "))
		}
	}
	b.WriteString("</pre></body></html>\n")
	return []byte(b.String())
}

func (f *faultProxy) set(fn func(f *faultProxy)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

type csiEnv struct {
	sim   *sim.Server
	proxy *faultProxy
	ctrl  csi.ControllerClient
	node  csi.NodeClient
	logs  *bytes.Buffer
	logMu *sync.Mutex
}

func newCSIEnv(t *testing.T) *csiEnv { return newCSIEnvWith(t, nil, "") }

// newCSIEnvWith serves the plugin in all modes when agent is set, its
// node service confined to kubelet.
func newCSIEnvWith(t *testing.T, agent driver.NodeAgent, kubelet string) *csiEnv {
	t.Helper()
	dir := t.TempDir()
	seed := sim.DefaultSeed()
	seed.HostVM.ReferenceID, seed.HostVM.Location = hostUUID, hostLoc
	s, err := sim.New(sim.Options{Customer: "acme", Token: testJWT, StateFile: filepath.Join(dir, "sim.json"), Seed: seed, Backend: sim.BookkeepingBackend{}})
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{sim: s, injected: map[string]int{}}
	hs := httptest.NewServer(p)
	t.Cleanup(func() { p.late.Wait(); hs.Close() })
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte(testJWT+"\n"), 0o600)
	api, err := cloud.New(cloud.Config{BaseURL: hs.URL + "/api/1", Customer: "acme", TokenFile: tok,
		BackoffBase: time.Millisecond, BackoffMax: 20 * time.Millisecond, MaxAttempts: 5, CallTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	mode := driver.ModeController
	if agent != nil {
		mode = driver.ModeAll
	}
	d, err := driver.New(driver.Config{Name: drivername.FromPortal("try.whitesky.cloud"), Version: "test", Mode: mode,
		Cloud: api, DefaultLocation: hostLoc, AttachPoll: 5 * time.Millisecond, AttachTimeout: 3 * time.Second,
		Agent: agent, KubeletRoot: kubelet})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "csi.sock")
	ln, err := driver.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	e := &csiEnv{sim: s, proxy: p, logs: &bytes.Buffer{}, logMu: &sync.Mutex{}}
	srv := d.NewGRPCServer(slog.New(slog.NewTextHandler(lockedWriter{e.logMu, e.logs}, &slog.HandlerOptions{Level: slog.LevelDebug})))
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.ctrl = csi.NewControllerClient(conn)
	e.node = csi.NewNodeClient(conn)
	return e
}

func createReq(name string, gib int64) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{Name: name,
		CapacityRange: &csi.CapacityRange{RequiredBytes: gib << 30},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}}
}

// untilOK retries a CSI call as the external-provisioner and attacher do,
// and returns the codes of the failures on the way.
func untilOK(t *testing.T, what string, fn func(ctx context.Context) error) []codes.Code {
	t.Helper()
	var seen []codes.Code
	for i := 0; i < 20; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := fn(ctx)
		cancel()
		if err == nil {
			return seen
		}
		st := status.Convert(err)
		if st.Code() == codes.Internal || st.Code() == codes.Unknown || len(st.Message()) < 15 {
			t.Errorf("%s: %v: not a code a CO can act on, or no clear message", what, err)
		}
		seen = append(seen, st.Code())
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s: still failing after 20 tries: %v", what, seen)
	return nil
}

// TestCloudFaults drives the CSI controller against the simulator through
// every kind of API fault and checks each call's outcome and the
// simulator's state: one disk per volume name, no attachment left behind.
func TestCloudFaults(t *testing.T) {
	e := newCSIEnv(t)
	faults := 0
	inject := func(fn func(f *faultProxy)) { e.proxy.set(fn); faults++ }

	// A short 5xx burst on create is absorbed by the client's retries.
	inject(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo = 3, "POST /disks", 503 })
	v1, err := e.ctrl.CreateVolume(context.Background(), createReq("pvc-burst", 1))
	if err != nil {
		t.Fatalf("create through a 3-request 503 burst: %v", err)
	}
	// A burst longer than the client's attempts reaches the CO as
	// Unavailable, and the CO's retry finds or makes the one disk.
	inject(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo = 12, "* /disks", 500 })
	var v2 *csi.CreateVolumeResponse
	seen := untilOK(t, "create through a long 500 burst", func(ctx context.Context) error {
		r, err := e.ctrl.CreateVolume(ctx, createReq("pvc-long-burst", 1))
		v2 = r
		return err
	})
	if len(seen) == 0 || seen[0] != codes.Unavailable {
		t.Errorf("long 500 burst: codes %v, want Unavailable first", seen)
	}
	// 429 with Retry-After.
	inject(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo, f.retryAft = 2, "* /", 429, "0" })
	if _, err := e.ctrl.CreateVolume(context.Background(), createReq("pvc-429", 1)); err != nil {
		t.Fatalf("create through 429s: %v", err)
	}
	e.proxy.set(func(f *faultProxy) { f.retryAft = "" })
	// 403 on create: PermissionDenied naming the cause; nothing made.
	e.sim.SetFaults(sim.Faults{ForbidCreate: true})
	faults++
	_, err = e.ctrl.CreateVolume(context.Background(), createReq("pvc-forbidden", 1))
	if st := status.Convert(err); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "403") && !strings.Contains(strings.ToLower(st.Message()), "forbidden") && !strings.Contains(st.Message(), "permission") {
		t.Errorf("create under 403: %v, want PermissionDenied with the reason", err)
	}
	e.sim.SetFaults(sim.Faults{})
	// A create that times out on the client and happens anyway: the CO's
	// retry must find it, not make a second disk.
	inject(func(f *faultProxy) { f.slowOn, f.slowFor = "POST /disks", 30*time.Second })
	var v3 *csi.CreateVolumeResponse
	untilOK(t, "create that lands after the timeout", func(ctx context.Context) error {
		r, err := e.ctrl.CreateVolume(ctx, createReq("pvc-slow", 1))
		v3 = r
		return err
	})
	if _, err := e.ctrl.CreateVolume(context.Background(), createReq("pvc-slow", 1)); err != nil {
		t.Fatalf("create again after the late one landed: %v", err)
	}
	// Publish through 502s, then a detach that fails and happens late.
	for _, v := range []*csi.CreateVolumeResponse{v1, v2, v3} {
		id := v.GetVolume().GetVolumeId()
		cap := createReq("x", 1).VolumeCapabilities[0]
		inject(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo = 2, "POST /vms/", 502 })
		untilOK(t, "publish "+id, func(ctx context.Context) error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: hostUUID, VolumeCapability: cap})
			return err
		})
		inject(func(f *faultProxy) { f.lateDetach, f.lateBy = true, 300*time.Millisecond })
		untilOK(t, "unpublish "+id, func(ctx context.Context) error {
			_, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: hostUUID})
			return err
		})
	}
	e.proxy.late.Wait()
	// Delete through a burst.
	for _, v := range []*csi.CreateVolumeResponse{v1, v2} {
		id := v.GetVolume().GetVolumeId()
		inject(func(f *faultProxy) { f.burst, f.burstOn, f.burstCo = 7, "DELETE /disks", 503 })
		untilOK(t, "delete "+id, func(ctx context.Context) error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		})
	}

	checkCloudFaultsEndState(t, e)
	e.proxy.mu.Lock()
	var kinds []string
	n := 0
	for k, c := range e.proxy.injected {
		kinds = append(kinds, fmt.Sprintf("%s x%d", k, c))
		n += c
	}
	e.proxy.mu.Unlock()
	t.Logf("cloud faults: %d injected responses (%s) over %d fault settings; no duplicate disk, no leaked attachment", n, strings.Join(kinds, ", "), faults)
	figures.add("cloud API fault responses injected", n+1)
	figures.add("cloud API duplicate disks or leaked attachments", 0)
	figures.note("Cloud API faults", fmt.Sprintf("%s, and 403 on create from the simulator's forbid_create. Every CSI controller call "+
		"either succeeded (on the client's retry or the CO's) or failed with Unavailable / PermissionDenied and a sentence; the simulator then held "+
		"exactly one disk per volume name and no attachment.", strings.Join(kinds, ", ")))
}

// checkCloudFaultsEndState: the simulator's state after TestCloudFaults:
// one disk per name, none attached, the deleted ones gone, the forbidden
// one never made.
func checkCloudFaultsEndState(t *testing.T, e *csiEnv) {
	t.Helper()
	st := e.sim.Snapshot()
	names := map[string]int{}
	for _, d := range st.Disks {
		names[d.Name]++
		if len(d.Attachments) != 0 {
			t.Errorf("disk %d (%s) still attached: %+v", d.ID, d.Name, d.Attachments[0])
		}
	}
	for n, c := range names {
		if c > 1 {
			t.Errorf("%d disks named %s", c, n)
		}
	}
	for _, n := range []string{"pvc-burst", "pvc-long-burst", "pvc-forbidden"} {
		if names[n] != 0 {
			t.Errorf("disk %s exists after delete or refusal", n)
		}
	}
	if names["pvc-429"] != 1 || names["pvc-slow"] != 1 {
		t.Errorf("disks by name: %v", names)
	}
}
