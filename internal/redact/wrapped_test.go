package redact

import (
	"strings"
	"testing"
)

// An echo may wrap a long header value over lines (a text page of fixed
// width, a pretty-printer): the credential sent, known to Text, is then
// split by a newline at any place. Whatever is left must not give the
// credential back once the lines are joined again. A JWT's header and
// signature go whatever the place; a Vault token split within the 8 bytes
// after its "hvs." is not recognised at all, neither by its form nor as
// the known secret (its one long part is no longer whole), and both
// halves stay in the text.
func TestAKnownCredentialWrappedOverTwoLinesDoesNotSurvive(t *testing.T) {
	const (
		jwt   = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImFiYyJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6Y3NpIn0.c2lnbmF0dXJlLXNlY3JldC12YWx1ZS1sb25nZXI"
		vault = "hvs.CAESIJ3kQxZbV9yLq2Rk7wT0aPfUuGh1sNcDmE4oXiB8vYjA"
	)
	for _, tok := range []string{jwt, vault} {
		for i := 1; i < len(tok); i++ {
			echo := `{"method":"POST","headers":{"X-Vault-Token":["` + tok[:i] + "\n" + tok[i:] + `"],"Content-Type":["application/json"]}}`
			got := Text(echo, tok)
			if strings.Contains(strings.ReplaceAll(got, "\n", ""), tok) {
				t.Errorf("%s wrapped after byte %d survives redaction: %q", tok[:4], i, got)
			}
		}
	}
}
