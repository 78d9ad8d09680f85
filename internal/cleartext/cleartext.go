// Package cleartext decides where a client may send credentials over plain
// http: to a loopback address, or anywhere only when an explicit, insecure
// option says so; and it keeps a redirect from taking them there.
package cleartext

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
)

// Option is the command-line name of the insecure option, which the
// simulator's and the lab's set-ups give (docs/security.md).
const Option = "--insecure-allow-http"

// Loopback reports whether host, a URL's Hostname(), is a loopback
// address (127.0.0.0/8, ::1) or "localhost".
func Loopback(host string) bool {
	if host == "localhost" {
		// Only this spelling: it is the one name Go's HTTP proxy rule
		// (and the resolver's) keeps off any proxy.
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// Allowed reports whether credentials may be sent to u: over https always,
// over http to a loopback address, or to any host when insecure is set.
// Any other scheme is refused.
func Allowed(u *url.URL, insecure bool) bool {
	switch u.Scheme {
	case "https":
		return true
	case "http":
		return insecure || Loopback(u.Hostname())
	}
	return false
}

// Clear reports whether u is http to a host that is not a loopback
// address: what Allowed lets through only with the insecure option, and
// what is logged loudly when it does.
func Clear(u *url.URL) bool { return u.Scheme == "http" && !Loopback(u.Hostname()) }

// maxRedirects is net/http's own limit, which a CheckRedirect replaces.
const maxRedirects = 10

// CheckRedirect is an http.Client's CheckRedirect that follows a redirect
// to https, and to http only on the same host and port as an http request
// before it (a loopback address, or a host the insecure option allowed).
// A redirect from https to http, or to another host over http, is refused:
// the request's headers and, for 307 and 308, its body (a token, a JWT, a
// passphrase) would go with it in clear.
func CheckRedirect(req *http.Request, via []*http.Request) error {
	if len(via) >= maxRedirects {
		return fmt.Errorf("stopped after %d redirects", maxRedirects)
	}
	if req.URL.Scheme == "https" {
		return nil
	}
	prev := via[len(via)-1].URL
	if req.URL.Scheme == "http" && prev.Scheme == "http" && strings.EqualFold(prev.Host, req.URL.Host) {
		return nil
	}
	return errors.New("refused a redirect from " + origin(prev) + " to " + origin(req.URL) +
		": the request's credentials would go with it over plain http")
}

// origin is u's scheme and host: never its path or query, where a hostile
// server's redirect could put anything.
func origin(u *url.URL) string { return u.Scheme + "://" + u.Host }
