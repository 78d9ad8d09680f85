package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/csi/kubeevents"
	"github.com/whitesky-cloud/vco-storage/csi/metrics"
)

// The node plugin's wiring of its Kubernetes Events: the API server named
// by the pod's environment, its CA and the token from the ServiceAccount
// directory, the agent's API over its socket. The API server is a FAKE
// (httptest with TLS; no Kubernetes runs here) that records the Events;
// the agent is its real API server and event bus without volumes.
func TestKubeEventsFromThePod(t *testing.T) {
	var mu sync.Mutex
	var posted []corev1.Event
	var auth []string
	api := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/api/v1/namespaces/shop/persistentvolumeclaims/data-web-0" {
			json.NewEncoder(w).Encode(corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "data-web-0", Namespace: "shop", UID: "5d2e8c1a"}})
			return
		}
		var e corev1.Event
		json.NewDecoder(r.Body).Decode(&e)
		mu.Lock()
		posted, auth = append(posted, e), append(auth, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(e)
	}))
	defer api.Close()
	u, _ := url.Parse(api.URL)
	host, port, _ := net.SplitHostPort(u.Host)
	t.Setenv("KUBERNETES_SERVICE_HOST", host)
	t.Setenv("KUBERNETES_SERVICE_PORT", port)
	sa := t.TempDir()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: api.Certificate().Raw})
	if err := os.WriteFile(filepath.Join(sa, "ca.crt"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sa, "token"), []byte("sa-token-value\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	bus, c := eventAgent(t)

	var logs syncBuffer
	mx := metrics.New()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	users := &kubeevents.Users{}
	startKubeEvents(ctx, slog.New(slog.NewTextHandler(&logs, nil)), mx, c.AgentClient, "worker-1", sa, users)
	// The node service tells users the claim of a volume it stages.
	users.Staging("ch-gen-1/42", "42", kubeevents.Object{Namespace: "shop", Name: "data-web-0"})
	bus.Publish(events.Event{Type: events.DiskRefused, Volume: "ch-gen-1/42", Device: "/dev/sdb", HolderNode: "worker-2", Reason: "held-by-another-node",
		Message: "disk /dev/sdb is attached to this node while worker-2 holds it by SCSI-3 PR; it is set read-only and nothing is mounted"})
	// Counted once the API server's answer is read.
	created := func() bool {
		rec := httptest.NewRecorder()
		mx.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		return strings.Contains(rec.Body.String(), `vco_csi_kube_events_total{result="created"} 2`)
	}
	for deadline := time.Now().Add(5 * time.Second); !created(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no Event counted as created")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(posted) != 2 || posted[0].Reason != "DiskRefused" || posted[0].InvolvedObject.Name != "worker-1" || posted[0].Type != "Warning" ||
		!strings.Contains(posted[0].Message, "worker-2 holds it") {
		t.Fatalf("posted %+v", posted)
	}
	claim := corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: "shop", Name: "data-web-0", UID: "5d2e8c1a"}
	if posted[1].InvolvedObject != claim || posted[1].Namespace != "shop" || posted[1].Message != posted[0].Message {
		t.Errorf("the Event on the claim: %+v", posted[1])
	}
	if want := "POST /api/v1/namespaces/shop/events Bearer sa-token-value"; auth[1] != want {
		t.Errorf("request %q, want %q", auth[1], want)
	}
	if want := "POST /api/v1/namespaces/default/events Bearer sa-token-value"; auth[0] != want {
		t.Errorf("request %q, want %q", auth[0], want)
	}
	if !strings.Contains(logs.String(), "posting vco-agent's events as Kubernetes Events") || strings.Contains(logs.String(), "sa-token-value") {
		t.Errorf("log:\n%s", logs.String())
	}
}

// Outside a pod, or without the node's name, the plugin says once that it
// posts no Events and goes on.
func TestKubeEventsOff(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	// Outside a pod (the lab's node plugins) that is no warning, even
	// without a node name.
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	startKubeEvents(context.Background(), log, metrics.New(), nil, "", t.TempDir(), &kubeevents.Users{})
	t.Setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	startKubeEvents(context.Background(), log, metrics.New(), nil, "", t.TempDir(), &kubeevents.Users{})
	out := logs.String()
	if strings.Count(out, "not posted as Kubernetes Events") != 2 || !strings.Contains(out, `level=INFO msg="vco-agent's events are not posted as Kubernetes Events; they are in the node's journal and `+"`vco-agent events`"+`" reason="not in a Kubernetes pod`) ||
		!strings.Contains(out, `level=WARN`) || !strings.Contains(out, "no node name") {
		t.Errorf("log:\n%s", out)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// eventAgent is the agent's real API server and event bus, without
// volumes, on a socket of its own, and a client of it.
func eventAgent(t *testing.T) (*events.Bus, *client.Client) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kev")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	bus := events.NewBus(256, 64, nil)
	srv := server.New(server.Options{Version: "test", Bus: bus, Policy: peercred.Policy{GID: -1}, Log: slog.New(slog.DiscardHandler)}).NewGRPC()
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return bus, c
}
