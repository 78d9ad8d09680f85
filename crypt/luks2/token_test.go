package luks2

import (
	"strings"
	"testing"
)

func TestTransitTokenCheck(t *testing.T) {
	ok := TransitToken{Mount: "transit", KeyName: "vco-volumes", KeyVersion: 3, Ciphertext: "vault:v3:c2VjcmV0"}
	if err := ok.Check(); err != nil {
		t.Fatalf("a transit engine's token: %v", err)
	}
	noMount := ok
	noMount.Mount = ""
	if err := noMount.Check(); err != nil {
		t.Fatalf("a token without a mount (the default transit mount): %v", err)
	}
	for _, c := range []struct {
		name string
		edit func(*TransitToken)
		want string
	}{
		{"no key", func(t *TransitToken) { t.KeyName = "" }, "names no key"},
		{"version 0", func(t *TransitToken) { t.KeyVersion, t.Ciphertext = 0, "vault:v0:abc" }, "not a version"},
		{"negative version", func(t *TransitToken) { t.KeyVersion = -1 }, "not a version"},
		{"other version", func(t *TransitToken) { t.KeyVersion = 2 }, "key version 2"},
		{"version prefix of another", func(t *TransitToken) { t.KeyVersion, t.Ciphertext = 1, "vault:v12:abc" }, "key version 1"},
		{"plain text", func(t *TransitToken) { t.Ciphertext = "plain" }, "not a transit ciphertext"},
		{"prefix only", func(t *TransitToken) { t.Ciphertext = "vault:v3:" }, "not a transit ciphertext"},
		{"empty ciphertext", func(t *TransitToken) { t.Ciphertext = "" }, "not a transit ciphertext"},
	} {
		tok := ok
		c.edit(&tok)
		err := tok.Check()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Check() = %v, want an error saying %q", c.name, err, c.want)
		}
	}
}
