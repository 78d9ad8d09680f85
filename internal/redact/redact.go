// Package redact cuts credentials out of text that came from elsewhere (an
// HTTP answer's body, a transport error) before that text goes into an
// error, a log line or an Event. A server, or a proxy in front of it, may
// echo the request it got, headers and body included, and may cut that
// echo short anywhere.
package redact

import (
	"regexp"
	"strings"
	"unicode/utf8"
)

// Mark stands where a credential was.
const Mark = "[redacted]"

// minPart is the shortest dot-separated part of a secret that is replaced
// on its own; minStart the shortest start of a secret recognised at the
// end of a text cut short.
const (
	minPart  = 8
	minStart = 4
)

var (
	// bearer is an Authorization header's credential, whatever it is (8
	// bytes or more: "the bearer token was rejected" stays as it is).
	bearer = regexp.MustCompile(`(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}`)
	// vaultHeader is the value of an echoed X-Vault-Token header.
	vaultHeader = regexp.MustCompile(`(?i)(x-vault-token["']?\s*[:=]\s*["']?)[A-Za-z0-9._-]+`)
	// jwt is a JWT, or the start of one: a base64url JSON object (which
	// always begins "eyJ", the encoding of `{"`) and up to two more
	// dot-separated base64url segments, any of them cut short.
	jwt = regexp.MustCompile(`eyJ[A-Za-z0-9_-]{4,}(\.[A-Za-z0-9_-]+){0,2}`)
	// vaultToken is a Vault or OpenBao token of the current forms
	// (service, batch, recovery).
	vaultToken = regexp.MustCompile(`\bhv[sbr]\.[A-Za-z0-9_-]{8,}`)
)

// Text is s with credentials replaced by Mark: each of secrets; each
// dot-separated part of a secret of at least 8 bytes (a JWT's header,
// payload and signature; a Vault token's body); a start of a secret of at
// least 4 bytes that ends s (an echo cut short); and, known or not, every
// "Bearer <credential>", every X-Vault-Token header's value, every
// JWT-shaped run, whole or cut short, and every Vault token.
func Text(s string, secrets ...string) string {
	for _, sec := range secrets {
		s = known(s, sec)
	}
	s = bearer.ReplaceAllString(s, "Bearer "+Mark)
	s = vaultHeader.ReplaceAllString(s, "${1}"+Mark)
	s = jwt.ReplaceAllString(s, Mark)
	return vaultToken.ReplaceAllString(s, Mark)
}

// known replaces one secret, its long parts and a start of it ending s.
func known(s, sec string) string {
	sec = strings.TrimSpace(sec)
	if len(sec) < 4 {
		return s
	}
	s = strings.ReplaceAll(s, sec, Mark)
	s = wrapped(s, sec)
	// The start before the parts: once a part is replaced, the rest of a
	// start that ends s is no longer recognisable as one.
	for n := min(len(sec)-1, len(s)); n >= minStart; n-- {
		if strings.HasSuffix(s, sec[:n]) {
			s = s[:len(s)-n] + Mark
			break
		}
	}
	for _, part := range strings.Split(sec, ".") {
		if len(part) >= minPart && part != sec {
			s = strings.ReplaceAll(s, part, Mark)
		}
	}
	return s
}

// wrapped replaces sec where white space (a line wrapped by a proxy's
// page) splits it.
func wrapped(s, sec string) string {
	if !strings.ContainsAny(s, " \t\r\n") {
		return s
	}
	var b strings.Builder
	for i, r := range sec {
		if i > 0 {
			b.WriteString(`\s*`)
		}
		b.WriteString(regexp.QuoteMeta(string(r)))
	}
	re, err := regexp.Compile(b.String())
	if err != nil {
		return s
	}
	return re.ReplaceAllLiteralString(s, Mark)
}

// Echo is what of an HTTP answer's body may go into an error: trimmed,
// redacted (Text), then cut to at most max bytes and marked "..." when
// cut. Redaction comes first so that the cut never splits a credential
// into pieces that no longer match it.
func Echo(body []byte, max int, secrets ...string) string {
	return Cut(Text(strings.TrimSpace(string(body)), secrets...), max)
}

// Cut is s shortened to at most max bytes, on a character boundary,
// followed by "..." when anything was cut.
func Cut(s string, max int) string {
	if len(s) <= max {
		return s
	}
	n := max
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}
