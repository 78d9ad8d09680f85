package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// stagedHeaders is a FAKE agent of encrypted volumes staged here: each
// volume's token, whose ciphertext is "vault:vN:pass".
type stagedHeaders map[string]luks2.TransitToken

func (s stagedHeaders) EncryptedVolumes(context.Context) ([]string, error) {
	return []string{"a", "b"}, nil
}

func (s stagedHeaders) StagedVolumeToken(_ context.Context, v string) (driver.VolumeToken, error) {
	t, ok := s[v]
	if !ok {
		return driver.VolumeToken{}, errors.New("not staged here")
	}
	return driver.VolumeToken{Content: driver.ContentLUKS2, Token: &t}, nil
}

func (s stagedHeaders) UpdateVolumeToken(_ context.Context, v string, _ []byte, _, with luks2.TransitToken) (driver.VolumeToken, error) {
	s[v] = with
	return driver.VolumeToken{Content: driver.ContentLUKS2, Token: &with}, nil
}

// toV2 is a FAKE transit engine whose newest key version is 2.
type toV2 struct{}

func (toV2) Encrypt(context.Context, string, []byte) (transit.Ciphertext, error) {
	return transit.Ciphertext{}, errors.New("not used")
}
func (toV2) Decrypt(context.Context, string, string) ([]byte, error) { return []byte("pass"), nil }
func (toV2) Rewrap(context.Context, string, string) (transit.Ciphertext, error) {
	return transit.Ciphertext{Text: "vault:v2:pass", Version: 2}, nil
}

// `vco-csi rewrap` prints a line per volume, every encrypted volume staged
// here when none is named, and exits 1 when one failed.
func TestRewrapPrintsALinePerVolume(t *testing.T) {
	tok := func(v int) luks2.TransitToken {
		return luks2.TransitToken{KeyName: "k", KeyVersion: v, Ciphertext: "vault:v" + string(rune('0'+v)) + ":pass"}
	}
	a := stagedHeaders{"a": tok(1), "b": tok(2)}
	var out, errs bytes.Buffer
	if code := rewrapVolumes(context.Background(), a, toV2{}, nil, &out, &errs); code != 0 {
		t.Fatalf("exit %d: %s%s", code, out.String(), errs.String())
	}
	want := "a: rewrapped: transit key k version 1 -> 2\nb: already the newest: transit key k version 2\n"
	if out.String() != want || a["a"].KeyVersion != 2 {
		t.Fatalf("output %q, want %q; token a %+v", out.String(), want, a["a"])
	}
	out.Reset()
	if code := rewrapVolumes(context.Background(), a, toV2{}, []string{"c"}, &out, &errs); code != 1 || !strings.HasPrefix(out.String(), "c: FAILED: not staged here") {
		t.Fatalf("a volume not staged here: exit %d, %q", code, out.String())
	}
}
