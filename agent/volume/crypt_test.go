package volume

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt/dmcrypttest"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// hostLUKS is the real LUKS (header formatting, inspection and the
// passphrase check run for real, and cryptsetup reads what it wrote) with
// dmcrypttest's FAKE mapping, labelled as such: this host's kernel has no
// device-mapper. Real dm-crypt is exercised by the guest test in
// integration/scenarios.
type hostLUKS struct {
	LUKS
	*dmcrypttest.LoopMapping
}

func newHostLUKS(t *testing.T) *hostLUKS {
	return &hostLUKS{LoopMapping: dmcrypttest.NewLoopMapping(t)}
}

// Open maps with the FAKE loop mapping and reports the header copy it
// read as crypt.Unlock does.
func (f *hostLUKS) Open(ctx context.Context, device, name string, pass []byte, ro bool) (Mapped, error) {
	p, err := f.LoopMapping.Open(ctx, device, name, pass, ro)
	if err != nil {
		return Mapped{}, err
	}
	v, err := luks2.Open(device, false)
	if err != nil {
		return Mapped{}, err
	}
	defer v.Close()
	return Mapped{Path: p, Reader: dmcrypttest.Reader, Source: v.Header.Source, HeaderDamage: v.Header.Damaged}, nil
}

func (f *hostLUKS) Close(ctx context.Context, name string) error {
	return f.LoopMapping.Close(ctx, name)
}

func (f *hostLUKS) Resize(ctx context.Context, name string) error {
	return f.LoopMapping.Resize(ctx, name)
}

func opened(c *hostLUKS) int  { n, _, _ := c.Counts(); return n }
func closed(c *hostLUKS) int  { _, n, _ := c.Counts(); return n }
func resized(c *hostLUKS) int { _, _, n := c.Counts(); return n }

const secret = "correct horse battery staple"

// wrapped is what the node plugin would have got from the transit engine
// for secret; the agent only stores it.
var wrapped = luks2.TransitToken{Mount: "transit", KeyName: "vco-volumes", KeyVersion: 3, Ciphertext: "vault:v3:c2VjcmV0LXdyYXBwZWQtYnktdGhlLXRyYW5zaXQtZW5naW5l"}

// isWrapped reports whether tok, read back from a header the agent
// formatted, is wrapped bound to the header's one keyslot, 0.
func isWrapped(tok *luks2.TransitToken) bool {
	want := wrapped
	want.Keyslots = []int{0}
	return tok != nil && reflect.DeepEqual(*tok, want)
}

func encReq(e *env, vol, img, staging string) StageRequest {
	r := e.stageReq(vol, img, staging)
	tok := wrapped
	r.Encrypted, r.Passphrase, r.FormatLUKS, r.Token = true, []byte(secret), true, &tok
	return r
}

// luksDump is cryptsetup's view of the header, as the interop oracle.
type luksDump struct {
	Keyslots map[string]struct {
		KDF struct {
			Type   string `json:"type"`
			Time   int    `json:"time"`
			Memory int    `json:"memory"`
			CPUs   int    `json:"cpus"`
		} `json:"kdf"`
	} `json:"keyslots"`
	Tokens   map[string]map[string]any `json:"tokens"`
	Segments map[string]struct {
		Encryption string `json:"encryption"`
	} `json:"segments"`
}

func dumpLUKS(t *testing.T, dev string) luksDump {
	t.Helper()
	out, err := exec.Command("cryptsetup", "luksDump", "--dump-json-metadata", dev).Output()
	if err != nil {
		t.Fatalf("cryptsetup luksDump %s: %v", dev, err)
	}
	var d luksDump
	if err := json.Unmarshal(out, &d); err != nil {
		t.Fatalf("luksDump JSON: %v\n%s", err, out)
	}
	return d
}

func needCryptsetup(t *testing.T) {
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Skip("cryptsetup (cryptsetup-bin, installed by make deps) is the interop oracle")
	}
}

func TestEncryptedVolumeIsFormattedOnceWithTheWrappedPassphrase(t *testing.T) {
	needRoot(t)
	needCryptsetup(t)
	crypt := newHostLUKS(t)
	e := newEnvWith(t, nil)
	e.crypt = crypt
	e.start()
	ctx := context.Background()
	// xfs: it grows online with the capabilities this host grants.
	img, dev := loop(t, 336)
	req := encReq(e, "vol-enc", img, "enc")
	req.FsType = "xfs"

	e.firstEncryptedStageFormatsTheLayers(ctx, req, dev)
	checkHeaderAsCryptsetupReadsIt(t, dev)
	// The token reads back through the API's method, staged or not.
	tok, err := e.m.VolumeToken(ctx, "vol-enc", req.Locator)
	if err != nil || tok.Kind != ContentLUKS2 || !isWrapped(tok.Token) || tok.UUID == "" {
		t.Fatalf("token of the staged volume: %+v %v", tok, err)
	}
	uuid := tok.UUID
	if c, _ := e.m.Store().Get("vol-enc"); !c.LUKSFormatted || c.LUKSFormatting {
		t.Fatalf("the record does not say this agent made the header: %+v", c)
	}

	e.retryExpandAndUnstageEncrypted(ctx, crypt, req, img, dev)
	e.wrongPassphraseThenRestageKeepsTheHeader(ctx, req, uuid)
	e.passphraseIsNowhere()

	// A failure after the mapping was opened closes it again: here the
	// volume comes back asking for ext4 on the xfs inside.
	if err := e.m.Unstage(ctx, "vol-enc", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	closedBefore := closed(crypt)
	wrongFS := req
	wrongFS.FsType = "ext4"
	_, err = e.m.Stage(ctx, wrongFS)
	wantCode(t, err, codes.FailedPrecondition, `carries "xfs"`)
	if closed(crypt) != closedBefore+1 || len(crypt.Mapped()) != 0 || isMounted(t, req.StagingPath) {
		t.Fatalf("after a failed stage: %d closes (was %d), mappings %v", closed(crypt), closedBefore, crypt.Mapped())
	}
}

// firstEncryptedStageFormatsTheLayers: the token of the blank dev says it
// is blank; the first encrypted stage formats it, mapped: LUKS2 on the
// disk, xfs on the mapping, mounted.
func (e *env) firstEncryptedStageFormatsTheLayers(ctx context.Context, req StageRequest, dev string) {
	t := e.t
	t.Helper()
	tok, err := e.m.VolumeToken(ctx, "vol-enc", req.Locator)
	if err != nil || tok.Kind != ContentBlank || tok.Token != nil || tok.Device != dev {
		t.Fatalf("token of a blank disk: %+v %v", tok, err)
	}
	res, err := e.m.Stage(ctx, req)
	if err != nil || !res.Formatted || res.Device == dev {
		t.Fatalf("encrypted stage: %+v %v", res, err)
	}
	if blkid(t, dev, "TYPE") != "crypto_LUKS" || blkid(t, res.Device, "TYPE") != "xfs" || !isMounted(t, req.StagingPath) {
		t.Fatalf("layers: disk %q, mapping %q", blkid(t, dev, "TYPE"), blkid(t, res.Device, "TYPE"))
	}
}

// checkHeaderAsCryptsetupReadsIt: cryptsetup reads the header: the
// documented cipher and KDF cost, and the token carrying the wrapped
// passphrase; the passphrase opens it.
func checkHeaderAsCryptsetupReadsIt(t *testing.T, dev string) {
	t.Helper()
	d := dumpLUKS(t, dev)
	ks, ok := d.Keyslots["0"]
	if !ok || len(d.Keyslots) != 1 || ks.KDF.Type != "argon2id" || ks.KDF.Time != luks2.DefaultKDF.Time ||
		ks.KDF.Memory != luks2.DefaultKDF.MemoryKiB || ks.KDF.CPUs != luks2.DefaultKDF.Threads {
		t.Fatalf("keyslots: %+v", d.Keyslots)
	}
	if d.Segments["0"].Encryption != "aes-xts-plain64" {
		t.Fatalf("segments: %+v", d.Segments)
	}
	if tk := d.Tokens["0"]; tk["type"] != "vco-transit" || tk["key_name"] != wrapped.KeyName || tk["ciphertext"] != wrapped.Ciphertext || tk["key_version"] != float64(3) {
		t.Fatalf("tokens: %+v", d.Tokens)
	}
	cs := exec.Command("cryptsetup", "open", "--test-passphrase", "--key-file", "-", dev)
	cs.Stdin = strings.NewReader(secret)
	if out, err := cs.CombinedOutput(); err != nil {
		t.Fatalf("cryptsetup does not accept the passphrase: %v %s", err, out)
	}
}

// retryExpandAndUnstageEncrypted: a retried stage opens nothing more; the
// disk grown, required_bytes is the disk's new size; the mapping is that
// less the LUKS2 header, and the expansion is still what was asked for,
// the filesystem grown; the unstage closes the mapping.
func (e *env) retryExpandAndUnstageEncrypted(ctx context.Context, crypt *hostLUKS, req StageRequest, img, dev string) {
	t := e.t
	t.Helper()
	os.WriteFile(filepath.Join(req.StagingPath, "data"), []byte("x"), 0o644)
	if res2, err := e.m.Stage(ctx, req); err != nil || res2.Formatted || opened(crypt) != 1 {
		t.Fatalf("retried encrypted stage: %+v %v (opened %d)", res2, err, opened(crypt))
	}
	if err := os.Truncate(img, 672<<20); err != nil {
		t.Fatal(err)
	}
	exec.Command("losetup", "-c", dev).Run()
	// required_bytes is the disk's new size; the mapping is that less the
	// LUKS2 header, and the expansion is still what was asked for.
	before, _ := e.m.Stats(ctx, "vol-enc", "")
	if n, err := e.m.Expand(ctx, "vol-enc", req.StagingPath, 672<<20); err != nil || n != 672<<20-16<<20 || resized(crypt) != 1 {
		t.Fatalf("expand: %d %v (resized %d)", n, err, resized(crypt))
	}
	if after, _ := e.m.Stats(ctx, "vol-enc", ""); after.TotalBytes <= before.TotalBytes {
		t.Fatalf("the filesystem on the mapping did not grow: %d -> %d bytes", before.TotalBytes, after.TotalBytes)
	}
	if err := e.m.Unstage(ctx, "vol-enc", req.StagingPath); err != nil || closed(crypt) != 1 {
		t.Fatalf("unstage: %v (closed %d)", err, closed(crypt))
	}
}

// wrongPassphraseThenRestageKeepsTheHeader: a wrong passphrase opens
// nothing and mounts nothing, and says where the right one is. The right
// one: not formatted again (same header, uuid), data there. The restage
// carries a different token: a header is never rewritten.
func (e *env) wrongPassphraseThenRestageKeepsTheHeader(ctx context.Context, req StageRequest, uuid string) {
	t := e.t
	t.Helper()
	bad := req
	bad.Passphrase = []byte("wrong")
	_, err := e.m.Stage(ctx, bad)
	wantCode(t, err, codes.FailedPrecondition, "opening LUKS2", "passphrase", "GetVolumeToken")
	if isMounted(t, req.StagingPath) {
		t.Fatal("mounted with a wrong passphrase")
	}
	again := req
	other := wrapped
	other.Ciphertext = "vault:v3:b3RoZXI"
	again.Token = &other
	if res, err := e.m.Stage(ctx, again); err != nil || res.Formatted {
		t.Fatalf("restage: %+v %v", res, err)
	}
	if _, err := os.Stat(filepath.Join(req.StagingPath, "data")); err != nil {
		t.Fatal(err)
	}
	if tok, err := e.m.VolumeToken(ctx, "vol-enc", req.Locator); err != nil || tok.UUID != uuid || !isWrapped(tok.Token) {
		t.Fatalf("the header changed on restage: %+v %v", tok, err)
	}
}

// passphraseIsNowhere: the passphrase is nowhere: not in the claim record
// of vol-enc, the log, or any event; the record says the volume is
// encrypted.
func (e *env) passphraseIsNowhere() {
	t := e.t
	t.Helper()
	b, _ := os.ReadFile(e.m.Store().file("vol-enc"))
	if bytes.Contains(b, []byte(secret)) || bytes.Contains(e.logs.Bytes(), []byte(secret)) {
		t.Fatal("the passphrase was written to the claim record or the log")
	}
	for _, ev := range e.bus.Recent() {
		if strings.Contains(fmt.Sprintf("%+v", ev), secret) {
			t.Fatalf("the passphrase is in an event: %+v", ev)
		}
	}
	if !strings.Contains(string(b), `"encrypted": true`) {
		t.Fatalf("record does not say the volume is encrypted: %s", b)
	}
}

func TestDataIsNeverGivenALUKSHeader(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, nil)
	e.crypt = newHostLUKS(t)
	e.start()
	ctx := context.Background()
	cases := []struct {
		name, want string
		prep       func(dev string)
	}{
		{"ext4", "ext2/ext3/ext4", func(dev string) { exec.Command("mkfs.ext4", "-q", dev).Run() }},
		{"dos-label", "DOS partition table", func(dev string) {
			f, _ := os.OpenFile(dev, os.O_WRONLY, 0)
			f.WriteAt([]byte{0x55, 0xaa}, 510)
			f.Close()
		}},
		{"bytes", "non-zero", func(dev string) {
			f, _ := os.OpenFile(dev, os.O_WRONLY, 0)
			f.WriteAt([]byte("someone's data"), 12345)
			f.Close()
		}},
	}
	for _, c := range cases {
		img, dev := loop(t, 64)
		c.prep(dev)
		before, _ := os.ReadFile(img)
		req := encReq(e, "vol-"+c.name, img, c.name)
		tok, err := e.m.VolumeToken(ctx, req.Volume, req.Locator)
		if err != nil || tok.Kind != ContentOther || tok.Detail == "" {
			t.Fatalf("%s: token: %+v %v", c.name, tok, err)
		}
		_, err = e.m.Stage(ctx, req)
		wantCode(t, err, codes.FailedPrecondition, "never formats over existing data")
		if !strings.Contains(strings.ToLower(err.Error()), strings.ToLower(c.want)) {
			t.Fatalf("%s: the refusal does not name what is there: %v", c.name, err)
		}
		after, _ := os.ReadFile(img)
		if !bytes.Equal(before, after) {
			t.Fatalf("%s: the device changed", c.name)
		}
		if cl, _ := e.m.Store().Get(req.Volume); cl != nil {
			t.Fatalf("%s: a refused first stage left a record: %+v", c.name, cl)
		}
		for _, ev := range e.bus.Recent() {
			if ev.Type == events.DiskClaimed && ev.Volume == req.Volume {
				t.Fatalf("%s: a refused encrypted stage was announced as claimed", c.name)
			}
		}
	}
}

func TestFirstEncryptedStageNeedsTheWrappedPassphrase(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, nil)
	e.crypt = newHostLUKS(t)
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 64)
	for _, c := range []struct {
		tok  *luks2.TransitToken
		want string
	}{
		{nil, "transit_token"},
		{&luks2.TransitToken{KeyName: "k", KeyVersion: 2, Ciphertext: "vault:v1:abc"}, "key version 2"},
		{&luks2.TransitToken{KeyName: "", KeyVersion: 1, Ciphertext: "vault:v1:abc"}, "names no key"},
		{&luks2.TransitToken{KeyName: "k", KeyVersion: 1, Ciphertext: "plain"}, "not a transit ciphertext"},
	} {
		req := encReq(e, "vol-t", img, "t")
		req.Token = c.tok
		_, err := e.m.Stage(ctx, req)
		wantCode(t, err, codes.InvalidArgument, c.want)
		if blkid(t, dev, "TYPE") != "" || isMounted(t, req.StagingPath) {
			t.Fatal("formatted or mounted without a valid wrapped passphrase")
		}
		if cl, _ := e.m.Store().Get("vol-t"); cl != nil {
			t.Fatalf("a refused first stage left a record: %+v", cl)
		}
	}
	// Without format_if_blank a blank device is not formatted either.
	req := encReq(e, "vol-t", img, "t")
	req.FormatLUKS = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "format_if_blank")
	if blkid(t, dev, "TYPE") != "" {
		t.Fatal("formatted without format_if_blank")
	}
}

// A crash can cut a stage short anywhere; the claim record says what this
// agent made, so the retry finishes without formatting twice and without
// formatting anything that is not its own.
func TestInterruptedEncryptedStageFormatsOnlyWhatItStarted(t *testing.T) {
	needRoot(t)
	crypt := newHostLUKS(t)
	e := newEnvWith(t, nil)
	e.crypt = crypt
	e.start()
	ctx := context.Background()
	claim := func(vol, img, staging string, formatting, formatted bool) {
		c := &Claim{Volume: vol, Locator: Locator{BackingFile: img}, StagingPath: e.staging(staging), FsType: "ext4",
			Encrypted: true, Phase: PhaseInterrupted, LUKSFormatting: formatting, LUKSFormatted: formatted}
		if err := e.m.Store().Put(c); err != nil {
			t.Fatal(err)
		}
	}

	// 1. The format completed, the record of it did not: the retry opens
	// the header it finds (same UUID), it does not format again.
	img, dev := loop(t, 64)
	proof, err := blank.Prove(ctx, dev)
	if err != nil {
		t.Fatal(err)
	}
	if err := (&LUKS{}).Format(ctx, proof, []byte(secret), wrapped); err != nil {
		t.Fatal(err)
	}
	first, _ := e.m.VolumeToken(ctx, "vol-1", Locator{BackingFile: img})
	claim("vol-1", img, "1", true, false)
	e.start() // the restarted agent
	res, err := e.m.Stage(ctx, encReq(e, "vol-1", img, "1"))
	if err != nil || !res.Formatted /* the filesystem */ {
		t.Fatalf("retry after a recorded-but-unconfirmed format: %+v %v", res, err)
	}
	if tok, _ := e.m.VolumeToken(ctx, "vol-1", Locator{}); tok.UUID != first.UUID {
		t.Fatal("the header was made again")
	}
	if c, _ := e.m.Store().Get("vol-1"); !c.LUKSFormatted || c.LUKSFormatting {
		t.Fatalf("record after the retry: %+v", c)
	}

	// 2. The format was cut short half-way (key material written, no
	// header yet): the record says the agent began it, so the retry
	// formats again over its own leftovers.
	img2, dev2 := loop(t, 64)
	f, _ := os.OpenFile(dev2, os.O_WRONLY, 0)
	f.WriteAt(bytes.Repeat([]byte{0xa5}, 4096), 32<<10)
	f.Close()
	claim("vol-2", img2, "2", true, false)
	e.start()
	if res, err := e.m.Stage(ctx, encReq(e, "vol-2", img2, "2")); err != nil || !res.Formatted || blkid(t, dev2, "TYPE") != "crypto_LUKS" {
		t.Fatalf("retry after a half-done format: %+v %v", res, err)
	}
	if !strings.Contains(e.logs.String(), "cut short") {
		t.Fatal("formatting over a half-done format is not logged")
	}

	// 3. The same bytes on a volume this agent never began to format:
	// refused.
	img3, dev3 := loop(t, 64)
	f, _ = os.OpenFile(dev3, os.O_WRONLY, 0)
	f.WriteAt(bytes.Repeat([]byte{0xa5}, 4096), 32<<10)
	f.Close()
	_, err = e.m.Stage(ctx, encReq(e, "vol-3", img3, "3"))
	wantCode(t, err, codes.FailedPrecondition, "never formats over existing data")

	// 4. The record says this agent made the header, the disk is blank:
	// the wrong disk, or a wiped one; reported, never formatted.
	img4, dev4 := loop(t, 64)
	claim("vol-4", img4, "4", false, true)
	e.start()
	_, err = e.m.Stage(ctx, encReq(e, "vol-4", img4, "4"))
	wantCode(t, err, codes.FailedPrecondition, "will not format it again")
	if blkid(t, dev4, "TYPE") != "" {
		t.Fatal("formatted a second time")
	}
}

func TestEncryptedVolumeWithoutLUKSSupportIsRefused(t *testing.T) {
	e := newEnv(t)
	img, dev := loop(t, 16)
	req := e.stageReq("vol-e", img, "e")
	req.Encrypted, req.Passphrase = true, []byte(secret)
	_, err := e.m.Stage(context.Background(), req)
	wantCode(t, err, codes.FailedPrecondition, "no LUKS2 support")
	if blkid(t, dev, "TYPE") != "" || isMounted(t, req.StagingPath) {
		t.Fatal("an encrypted volume was formatted or mounted without LUKS2")
	}
	_, err = e.m.VolumeToken(context.Background(), "vol-e", req.Locator)
	wantCode(t, err, codes.FailedPrecondition, "no LUKS2 support")
	req.Passphrase = nil
	_, err = e.m.Stage(context.Background(), req)
	wantCode(t, err, codes.InvalidArgument, "no passphrase")
}

// A volume whose primary LUKS2 header is damaged still stages (from the
// secondary copy), and the stage's event says so, naming the copy, so an
// operator can repair it; nothing is rewritten behind their back. The
// mapping is dmcrypttest's FAKE; which code unlocks such a volume for real
// is crypt's TestChooseReader and the guest test's.
func TestDamagedLUKS2HeaderStagesAndTheEventSaysSo(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, nil)
	e.crypt = newHostLUKS(t)
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 64)
	req := encReq(e, "vol-dmg", img, "dmg")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ev := e.event(events.DiskClaimed); strings.Contains(ev.Message, "damaged") {
		t.Fatalf("an intact header reported damaged: %s", ev.Message)
	}
	if err := e.m.Unstage(ctx, "vol-dmg", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("garbage"), 4096+10); err != nil { // the primary's JSON area
		t.Fatal(err)
	}
	f.Close()
	before, _ := os.ReadFile(img)
	req.FormatLUKS = false
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatalf("stage with a damaged primary header: %v", err)
	}
	ev := e.event(events.DiskClaimed)
	for _, want := range []string{"LUKS2 header is damaged", "primary header", "secondary copy", "vco-agent luks repair"} {
		if !strings.Contains(ev.Message, want) {
			t.Errorf("the stage's event does not say %q: %s", want, ev.Message)
		}
	}
	if err := e.m.Unstage(ctx, "vol-dmg", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	after, _ := os.ReadFile(img)
	if !bytes.Equal(before[:32<<10], after[:32<<10]) {
		t.Fatal("the damaged header was rewritten without being asked")
	}
}
