package driver

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
)

// headerAgent is a FAKE TokenRewriter: one staged volume whose header
// holds tok and opens with pass (the real agent's checks are
// agent/volume's; here only what Rewrap sends is looked at).
type headerAgent struct {
	tok     luks2.TransitToken
	pass    []byte
	content Content
	updates int
}

func (h *headerAgent) StagedVolumeToken(context.Context, string) (VolumeToken, error) {
	t := h.tok
	return VolumeToken{Content: h.content, Token: &t}, nil
}

func (h *headerAgent) UpdateVolumeToken(_ context.Context, _ string, pass []byte, replaces, with luks2.TransitToken) (VolumeToken, error) {
	h.updates++
	if !bytes.Equal(pass, h.pass) || replaces.Ciphertext != h.tok.Ciphertext {
		return VolumeToken{}, errors.New("the fake header refuses")
	}
	h.tok = with
	return VolumeToken{Content: ContentLUKS2, Token: &with}, nil
}

// versions is a FAKE transit engine: ciphertext "vault:vN:<passphrase>",
// rewrap to version latest; lying makes the rewrap wrap another
// passphrase, refuse makes it answer 403.
type versions struct {
	latest        int
	lying, refuse bool
}

func (v *versions) Encrypt(context.Context, string, []byte) (transit.Ciphertext, error) {
	return transit.Ciphertext{}, errors.New("not used")
}

func (v *versions) Decrypt(_ context.Context, _, ct string) ([]byte, error) {
	_, p, _ := strings.Cut(strings.TrimPrefix(ct, "vault:v"), ":")
	return []byte(p), nil
}

func (v *versions) Rewrap(_ context.Context, key, ct string) (transit.Ciphertext, error) {
	if v.refuse {
		return transit.Ciphertext{}, &transit.Error{Address: "https://kb", Op: "rewrap", Key: key, Status: 403, Errors: []string{"permission denied"}}
	}
	p, _ := v.Decrypt(context.Background(), key, ct)
	if v.lying {
		p = []byte("another")
	}
	return transit.Ciphertext{Text: "vault:v" + string(rune('0'+v.latest)) + ":" + string(p), Version: v.latest}, nil
}

func newHeader() *headerAgent {
	return &headerAgent{tok: luks2.TransitToken{Mount: "transit", KeyName: "k", KeyVersion: 1, Ciphertext: "vault:v1:secret"},
		pass: []byte("secret"), content: ContentLUKS2}
}

func TestRewrapStoresANewerWrapOfTheSamePassphraseOnly(t *testing.T) {
	ctx := context.Background()
	h := newHeader()
	r, err := Rewrap(ctx, h, &versions{latest: 2}, "v")
	if err != nil || r.From != 1 || r.To != 2 || h.tok.KeyVersion != 2 || h.tok.Ciphertext != "vault:v2:secret" || h.tok.KeyName != "k" {
		t.Fatalf("rewrap after a rotation: %+v, %v; header token %+v", r, err, h.tok)
	}
	if r, err := Rewrap(ctx, h, &versions{latest: 2}, "v"); err != nil || r.To != 2 || h.updates != 1 {
		t.Fatalf("rewrap at the newest version: %+v, %v, %d updates; want nothing written", r, err, h.updates)
	}

	h = newHeader()
	_, err = Rewrap(ctx, h, &versions{latest: 2, lying: true}, "v")
	if err == nil || !strings.Contains(err.Error(), "unwraps to another passphrase") || h.updates != 0 {
		t.Fatalf("a rewrap of another passphrase: %v, %d updates; want a refusal and nothing written", err, h.updates)
	}
	_, err = Rewrap(ctx, h, &versions{latest: 2, refuse: true}, "v")
	if err == nil || !strings.Contains(err.Error(), "rewrap/<transitKey>") || h.updates != 0 {
		t.Fatalf("a refused rewrap: %v; want the policy named", err)
	}
	h.content = ContentBlank
	if _, err = Rewrap(ctx, h, &versions{latest: 2}, "v"); err == nil || !strings.Contains(err.Error(), "nothing to rewrap") || h.updates != 0 {
		t.Fatalf("a volume without a header: %v", err)
	}
}
