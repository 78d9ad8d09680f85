package cloud_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// proxyChild names, in the environment of the test binary run again, the
// API URL the child process calls through its environment's proxy.
const proxyChild = "VCO_TEST_CLOUD_PROXY_CHILD_URL"

// An API URL over plain http is allowed without --insecure-allow-http
// only because it names this host's loopback: nothing then leaves the
// host in clear. But the client's transport takes HTTP_PROXY from the
// environment (a controller behind an egress proxy has it), and net/http
// bypasses the proxy for "localhost" and loopback IPs only: "LOCALHOST"
// and "localhost." are loopback to cleartext.Allowed but not to the
// proxy rule, so the request, its Bearer JWT with it, goes to the proxy
// over plain http. The proxy's environment is read once per process: the
// calls are made by the test binary run again with HTTP_PROXY set.
func TestALoopbackHTTPURLIsNotSentThroughAProxy(t *testing.T) {
	if raw := os.Getenv(proxyChild); raw != "" {
		proxyChildCall(t, raw)
		return
	}
	var mu sync.Mutex
	var got []string
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.RequestURI+" Authorization: "+r.Header.Get("Authorization"))
		mu.Unlock()
		http.Error(w, "proxy", http.StatusBadGateway)
	}))
	defer proxy.Close()
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`[]`))
	}))
	defer api.Close()
	port := strings.TrimPrefix(api.URL, "http://127.0.0.1:")
	for _, host := range []string{"localhost", "LOCALHOST", "localhost.", "127.0.0.1"} {
		raw := "http://" + host + ":" + port + "/api/1"
		t.Run(host, func(t *testing.T) {
			mu.Lock()
			got = nil
			mu.Unlock()
			cmd := exec.Command(os.Args[0], "-test.run=^TestALoopbackHTTPURLIsNotSentThroughAProxy$", "-test.count=1")
			cmd.Env = append(os.Environ(), proxyChild+"="+raw, "HTTP_PROXY="+proxy.URL, "http_proxy="+proxy.URL, "NO_PROXY=", "no_proxy=")
			out, err := cmd.CombinedOutput()
			t.Logf("the call to %s: %v\n%s", raw, err, out)
			mu.Lock()
			defer mu.Unlock()
			if len(got) > 0 {
				t.Errorf("the API URL %s, allowed as loopback, was sent to the proxy %s in clear: %q", raw, proxy.URL, got)
			}
		})
	}
}

// proxyChildCall is the child's part: one call to the API at raw.
func proxyChildCall(t *testing.T, raw string) {
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte(jwt+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(raw)
	c, err := cloud.New(cloud.Config{BaseURL: raw, Customer: customer, TokenFile: tok, MaxAttempts: 1})
	if err != nil {
		t.Fatalf("cloud.New(%s): %v", u, err)
	}
	_, err = c.ListLocations(context.Background())
	fmt.Println("ListLocations:", err)
}
