package volume

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// rewrapped is what the transit engine's rewrap of wrapped would give
// after the key's rotation: the same passphrase under version 4.
var rewrapped = luks2.TransitToken{Mount: "transit", KeyName: "vco-volumes", KeyVersion: 4, Ciphertext: "vault:v4:bmV3ZXItd3JhcA"}

// UpdateVolumeToken rewrites the token of an encrypted volume staged
// here, mounted and in use, in place; cryptsetup reads the new token and
// the passphrase still opens the volume. It writes nothing for a volume
// not staged here, a token that changed since it was read, or a
// passphrase that does not open the volume.
func TestUpdateVolumeTokenRewritesTheTokenOfAStagedVolumeOnly(t *testing.T) {
	needRoot(t)
	needCryptsetup(t)
	e := newEnvWith(t, nil)
	e.crypt = newHostLUKS(t)
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 337)
	req := encReq(e, "vol-rw", img, "rw")

	_, err := e.m.UpdateVolumeToken(ctx, "vol-rw", []byte(secret), wrapped, rewrapped)
	wantCode(t, err, codes.FailedPrecondition, "not staged on this node")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	_, err = e.m.UpdateVolumeToken(ctx, "vol-rw", []byte("not the passphrase"), wrapped, rewrapped)
	wantCode(t, err, codes.FailedPrecondition, "does not open the volume")
	stale := wrapped
	stale.Ciphertext = "vault:v3:b2xkZXI"
	_, err = e.m.UpdateVolumeToken(ctx, "vol-rw", []byte(secret), stale, rewrapped)
	wantCode(t, err, codes.Aborted, "changed since it was read")
	if d := dumpLUKS(t, dev); d.Tokens["0"]["ciphertext"] != wrapped.Ciphertext {
		t.Fatalf("a refused rewrite changed the token: %v", d.Tokens)
	}

	res, err := e.m.UpdateVolumeToken(ctx, "vol-rw", []byte(secret), wrapped, rewrapped)
	if err != nil || res.Token == nil || res.Token.Ciphertext != rewrapped.Ciphertext || res.Token.KeyVersion != 4 {
		t.Fatalf("rewrite of the staged volume's token: %+v, %v", res, err)
	}
	if d := dumpLUKS(t, dev); d.Tokens["0"]["ciphertext"] != rewrapped.Ciphertext || d.Tokens["0"]["key_version"] != float64(4) {
		t.Fatalf("cryptsetup reads the token as %v", d.Tokens["0"])
	}
	if !isMounted(t, req.StagingPath) {
		t.Fatal("the volume is no longer mounted after its token was rewritten")
	}
	if err := e.m.Unstage(ctx, "vol-rw", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	again := req
	again.FormatLUKS, again.Token = false, nil
	if _, err := e.m.Stage(ctx, again); err != nil {
		t.Fatalf("staged again with the same passphrase after the rewrite: %v", err)
	}
}

// A token rewrite is refused, before any device is opened, for a volume
// that is not an encrypted one staged here, not read-only, under a fence
// this node holds.
func TestTokenWritableOnlyForAWritableFencedEncryptedStage(t *testing.T) {
	ok := Claim{Volume: "v", Phase: PhaseStaged, Encrypted: true, State: StateHeld}
	if err := tokenWritable("v", &ok); err != nil {
		t.Fatalf("an encrypted volume staged and held here: %v", err)
	}
	for name, mod := range map[string]func(*Claim){
		"interrupted":  func(c *Claim) { c.Phase = PhaseInterrupted },
		"plain":        func(c *Claim) { c.Encrypted = false },
		"lost":         func(c *Claim) { c.State = StateLost },
		"missing disk": func(c *Claim) { c.Missing = true },
		"read-only":    func(c *Claim) { c.ReadOnly = true },
	} {
		c := ok
		mod(&c)
		if err := tokenWritable("v", &c); err == nil {
			t.Errorf("%s: a token rewrite was allowed", name)
		}
	}
	if err := tokenWritable("v", nil); err == nil {
		t.Error("a volume without a record: a token rewrite was allowed")
	}
}
