package cleartext

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
)

func TestAllowed(t *testing.T) {
	for _, tc := range []struct {
		u               string
		plain, insecure bool
	}{
		{"https://try.whitesky.cloud", true, true},
		{"https://10.0.0.1:8200", true, true},
		{"http://127.0.0.1:8080", true, true},
		{"http://127.3.4.5", true, true},
		{"http://[::1]:8200", true, true},
		{"http://[::ffff:127.0.0.1]:8200", true, true},
		{"http://localhost:8200", true, true},
		// Only the exact spelling: any other is proxied by Go and the
		// resolver (HTTP_PROXY would see the credential in clear).
		{"http://LOCALHOST.", false, true},
		{"http://localhost.", false, true},
		{"http://try.whitesky.cloud", false, true},
		{"http://10.0.2.100:8200", false, true},
		{"http://localhost.example.net", false, true},
		{"http://128.0.0.1", false, true},
		{"ftp://127.0.0.1", false, false},
		{"try.whitesky.cloud", false, false},
	} {
		u, err := url.Parse(tc.u)
		if err != nil {
			t.Fatal(err)
		}
		if got := Allowed(u, false); got != tc.plain {
			t.Errorf("Allowed(%s, false) = %v, want %v", tc.u, got, tc.plain)
		}
		if got := Allowed(u, true); got != tc.insecure {
			t.Errorf("Allowed(%s, true) = %v, want %v", tc.u, got, tc.insecure)
		}
		if got := Clear(u); got != (u.Scheme == "http" && !tc.plain) {
			t.Errorf("Clear(%s) = %v", tc.u, got)
		}
	}
}

// TestRedirectToHTTP: an https server that redirects (307, body and
// headers resent) to an http one, even on loopback, is not followed; the
// http server never sees the request. A redirect that stays on the same
// http host and port is followed.
func TestRedirectToHTTP(t *testing.T) {
	var reached atomic.Int32
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		if r.URL.Path == "/again" {
			http.Redirect(w, r, "/done", http.StatusTemporaryRedirect)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer plain.Close()
	tls := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, plain.URL+"/stolen?token="+r.Header.Get("Authorization"), http.StatusTemporaryRedirect)
	}))
	defer tls.Close()
	c := tls.Client()
	c.CheckRedirect = CheckRedirect
	req, _ := http.NewRequest(http.MethodPost, tls.URL+"/login", strings.NewReader(`{"jwt":"secret"}`))
	req.Header.Set("Authorization", "Bearer secret")
	_, err := c.Do(req)
	if err == nil || !strings.Contains(err.Error(), "refused a redirect from "+tls.URL+" to "+plain.URL) {
		t.Fatalf("https -> http redirect: %v, want it refused", err)
	}
	if n := reached.Load(); n != 0 {
		t.Fatalf("the http server got %d requests", n)
	}
	// net/http wraps it in a url.Error naming the redirect's whole URL;
	// the clients keep only the cause, which names scheme and host.
	var ue *url.Error
	if !errors.As(err, &ue) || strings.Contains(ue.Err.Error(), "stolen") {
		t.Errorf("the refusal repeats the redirect's path: %v", err)
	}
	resp, err := c.Post(plain.URL+"/again", "application/json", strings.NewReader("{}"))
	if err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("http redirect on the same host: %v %v", resp, err)
	}
	resp.Body.Close()
}
