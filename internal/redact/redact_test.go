package redact

import (
	"fmt"
	"strings"
	"testing"
)

const (
	header    = "eyJhbGciOiJSUzI1NiIsImtpZCI6InRlc3QifQ"
	payload   = "eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6Y3NpLWRyaXZlcjp2Y28tY3NpLW5vZGUifQ"
	signature = "c2lnbmF0dXJlLW9mLXRoZS10b2tlbi10aGF0LW11c3Qtc3RheS1zZWNyZXQ"
	token     = header + "." + payload + "." + signature
)

// pieces are the runs of token that must not survive: each part of 4
// bytes or more and every 8-byte window across the whole token.
func pieces(tok string) []string {
	var p []string
	for _, part := range strings.Split(tok, ".") {
		if len(part) >= 4 {
			p = append(p, part)
		}
	}
	for i := 0; i+8 <= len(tok); i++ {
		p = append(p, tok[i:i+8])
	}
	return p
}

func leaked(t *testing.T, what, got, tok string) {
	t.Helper()
	for _, p := range pieces(tok) {
		if strings.Contains(got, p) {
			t.Fatalf("%s: %q of the token survives in %q", what, p, got)
		}
	}
}

// TestEchoCutAcrossToken: an echo whose 200-byte cut falls inside the
// token at every offset keeps no piece of it, known or not.
func TestEchoCutAcrossToken(t *testing.T) {
	const head = "<html><body>400 Bad Request Authorization: Bearer "
	for start := max(len(head), 200-len(token)+1); start < 200; start++ {
		body := head[:len(head)-len("Authorization: Bearer ")] + strings.Repeat("x", start-len(head)) +
			"Authorization: Bearer " + token + "\nUser-Agent: Go-http-client/1.1</body></html>"
		for _, secrets := range [][]string{{token}, nil} {
			got := Echo([]byte(body), 200, secrets...)
			leaked(t, "cut at 200", got, token)
			if len(got) > 200+len("...") {
				t.Fatalf("echo of %d bytes, want at most 203", len(got))
			}
		}
	}
}

// TestTextCutShort: a token the echo itself cut short (a proxy that
// truncates, a read limit) leaves nothing behind, with or without the
// secret known, and with no "Bearer " before it.
func TestTextCutShort(t *testing.T) {
	for n := 4; n < len(token); n++ {
		s := `{"message":"bad request: jwt=` + token[:n]
		got := Text(s, token)
		leaked(t, fmt.Sprintf("known, cut after %d bytes", n), got, token[:n])
		if !strings.HasSuffix(got, "jwt="+Mark) {
			t.Fatalf("known, cut after %d bytes: %q", n, got)
		}
		if n >= len("eyJ")+4 {
			leaked(t, fmt.Sprintf("unknown, cut after %d bytes", n), Text(s), token[:n])
		}
	}
}

func TestTextShapes(t *testing.T) {
	vault := "hvs.CAESIJ0ncBm3fq1Pv9WzXbyRtK2Q"
	for _, tc := range []struct{ in, want string }{
		{"Authorization: bearer abc.def+/=", "Authorization: Bearer [redacted]"},
		{"X-Vault-Token: " + vault, "X-Vault-Token: [redacted]"},
		{`{"x-vault-token":"s.legacytoken"}`, `{"x-vault-token":"[redacted]"}`},
		{"token " + vault + " refused", "token [redacted] refused"},
		{"got " + header + "." + payload + ". Next", "got [redacted]. Next"},
		{"signature " + signature, "signature " + signature},
	} {
		if got := Text(tc.in); got != tc.want {
			t.Errorf("Text(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	// Known, the signature alone and the vault token's body alone go.
	if got := Text("sig "+signature, token); strings.Contains(got, signature) {
		t.Errorf("the signature survives: %q", got)
	}
	if got := Text("id CAESIJ0ncBm3fq1Pv9WzXbyRtK2Q", vault); strings.Contains(got, "CAESIJ") {
		t.Errorf("the vault token's body survives: %q", got)
	}
}

// TestTextKeepsTheRest: what an operator needs from an error page stays.
func TestTextKeepsTheRest(t *testing.T) {
	for _, s := range []string{
		"503 Service Unavailable from proxy try.whitesky.cloud: upstream connect error",
		"dial tcp 10.0.2.100:8200: connection refused",
		"permission denied on key vco-csi-volumes (transit-prod-1)",
		"the credential in /etc/vco-csi/cloud/jwt was rejected",
		"the bearer token was rejected",
		`WWW-Authenticate: Bearer realm="kubernetes"`,
	} {
		if got := Text(s, token, "hvs.CAESIJ0ncBm3fq1Pv9WzXbyRtK2Q"); got != s {
			t.Errorf("Text(%q) = %q, want it unchanged", s, got)
		}
	}
}

func TestCut(t *testing.T) {
	if got := Cut("ééé", 3); got != "é..." {
		t.Errorf("Cut splits a character: %q", got)
	}
	if got := Cut("abc", 3); got != "abc" {
		t.Errorf("Cut of a short text: %q", got)
	}
}
