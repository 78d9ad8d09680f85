package scenarios

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// leaseData is where the volume's data starts on a disk fenced by the
// on-disk lease (fence/lease DataOffset).
const leaseData = 1 << 20

// volumeToken is `vco-agent volume token --json`.
type volumeToken struct {
	Content      string `json:"content"`
	LUKSUUID     string `json:"luks_uuid"`
	Device       string `json:"device"`
	Detail       string `json:"detail"`
	TransitToken *struct {
		Mount      string `json:"mount"`
		KeyName    string `json:"key_name"`
		KeyVersion int    `json:"key_version"`
		Ciphertext string `json:"ciphertext"`
	} `json:"transit_token"`
}

// stageReply is `vco-agent volume stage --json`.
type stageReply struct {
	Device    string `json:"device"`
	Fencing   string `json:"fencing"`
	Formatted bool   `json:"formatted"`
}

// TestEncryptedVolumeInGuest stages an encrypted volume for real: the
// agent daemon in a guest fences a blank virtio-blk disk with the on-disk
// lease and formats LUKS2 on the data area after it, with the
// wrapped passphrase in its token, maps it with the guest kernel's
// dm-crypt, makes and mounts the filesystem; the node plugin's part
// (wrapping a new passphrase, unwrapping it from the token for later
// stages) is played by this test against the FAKE transit engine of
// package transittest, since no Vault can run here. Then: the data on the
// disk is ciphertext, a mapping held by another mount is not closed, the
// volume restages with the unwrapped passphrase after unstaging and after
// an agent restart, and grows online.
func TestEncryptedVolumeInGuest(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	l := agentLab(t, ctx)
	img := filepath.Join(t.TempDir(), "enc.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 256<<20); err != nil {
		t.Fatal(err)
	}
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 512,
		Disks: []lab.Disk{{ID: "enc", Kind: lab.VirtioBlk, File: img, Serial: "vol-enc"}}})
	if err != nil {
		t.Fatal(err)
	}
	g := gs[0]
	disk, err := g.WaitDiskBySerial(ctx, "vol-enc")
	if err != nil {
		t.Fatal(err)
	}
	startAgent(t, ctx, g)

	// The node plugin's transit engine (FAKE) and a new passphrase.
	vault := transittest.New()
	vault.Rotate("vco-volumes")
	vault.Rotate("vco-volumes")
	vault.StaticToken("hvs.lab")
	srv := httptest.NewServer(vault)
	defer srv.Close()
	tc, err := transit.New(transit.Config{Address: srv.URL, Token: "hvs.lab"})
	if err != nil {
		t.Fatal(err)
	}
	raw := make([]byte, 32)
	rand.Read(raw)
	pass := base64.RawStdEncoding.EncodeToString(raw)
	ct, err := tc.Encrypt(ctx, "vco-volumes", []byte(pass))
	if err != nil {
		t.Fatal(err)
	}

	s := &encStory{t: t, ctx: ctx, g: g, img: img}
	s.stage = append([]string{"volume", "stage", encVol, "--staging", encStaging, "--passphrase-file", "/run/pw"}, encLoc...)
	s.firstStageFormats(pass, ct)
	got := s.tokenUnwrapsToThePassphrase(tc, pass, ct)
	sum := s.dataIsCiphertextOnTheDisk()
	s.busyMappingIsNotClosed()
	s.restagesWithTheUnwrappedPassphrase(got, sum)
	s.growsOnline(disk.Name, sum)
	stopAgent(t, ctx, g)
	cryptsetupReadsTheHeader(t, img, pass)
}

// The encrypted volume, its staging path and where the agent finds its
// disk.
const encVol, encStaging = "vol-enc", "/var/lib/kubelet/plugins/kubernetes.io/csi/cloud.whitesky.csi/enc/globalmount"

var encLoc = []string{"--serial", "vol-enc"}

// encStory is TestEncryptedVolumeInGuest's guest, disk image and stage
// command (without the format flags).
type encStory struct {
	t     *testing.T
	ctx   context.Context
	g     *lab.Guest
	img   string
	stage []string
}

func (s *encStory) sh(script string) string {
	s.t.Helper()
	out, err := s.g.MustSh(s.ctx, script)
	if err != nil {
		s.t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// dataSum is the checksum of the data the story writes.
func (s *encStory) dataSum() string {
	s.t.Helper()
	return s.sh(fmt.Sprintf("cat %s/marker %s/data | sha256sum | cut -d' ' -f1", encStaging, encStaging))
}

// firstStageFormats: the blank disk's token says so; the first stage,
// with the passphrase and its wrapped form, fences with the lease,
// formats LUKS2, maps it with dm-crypt aes-xts-plain64 and mounts ext4.
func (s *encStory) firstStageFormats(pass string, ct transit.Ciphertext) {
	t, ctx, g := s.t, s.ctx, s.g
	t.Helper()
	var tok volumeToken
	if err := agentJSON(ctx, g, &tok, append([]string{"volume", "token", encVol}, encLoc...)...); err != nil || tok.Content != "VOLUME_CONTENT_BLANK" {
		t.Fatalf("token of the blank disk: %+v %v", tok, err)
	}
	s.sh(fmt.Sprintf("printf %%s '%s' > /run/pw && printf %%s '%s' > /run/wrapped", pass, ct.Text))
	first := append(append([]string{}, s.stage...), "--format-if-blank", "--wrapped-file", "/run/wrapped",
		"--transit-key", "vco-volumes", "--transit-key-version", strconv.Itoa(ct.Version))
	var st stageReply
	if err := agentJSON(ctx, g, &st, first...); err != nil || !st.Formatted || st.Device != "/dev/mapper/vco-vol-enc" || st.Fencing != "FENCING_METHOD_DISK_LEASE" {
		t.Fatalf("first stage: %+v %v", st, err)
	}
	t.Logf("staged: %+v", st)
	if got := s.sh("vco-agent luks status vco-vol-enc"); !strings.Contains(got, `"crypt aes-xts-plain64 - 0 `) {
		t.Fatalf("the mapping is not dm-crypt aes-xts-plain64: %s", got)
	}
	if got := s.sh("blkid -p -s TYPE -o value /dev/mapper/vco-vol-enc; grep ' " + encStaging + " ' /proc/mounts | cut -d' ' -f1"); got != "ext4\n/dev/mapper/vco-vol-enc" {
		t.Fatalf("filesystem and mount: %q", got)
	}
}

// tokenUnwrapsToThePassphrase does what the node plugin does before a
// later stage: read the token, unwrap it. It returns the unwrapped
// passphrase.
func (s *encStory) tokenUnwrapsToThePassphrase(tc *transit.Client, pass string, ct transit.Ciphertext) []byte {
	t, ctx := s.t, s.ctx
	t.Helper()
	var tok volumeToken
	if err := agentJSON(ctx, s.g, &tok, append([]string{"volume", "token", encVol}, encLoc...)...); err != nil ||
		tok.Content != "VOLUME_CONTENT_LUKS2" || tok.TransitToken == nil || tok.TransitToken.Ciphertext != ct.Text ||
		tok.TransitToken.KeyVersion != 2 || tok.TransitToken.KeyName != "vco-volumes" {
		t.Fatalf("token of the formatted volume: %+v %v", tok, err)
	}
	got, err := tc.Decrypt(ctx, tok.TransitToken.KeyName, tok.TransitToken.Ciphertext)
	if err != nil || string(got) != pass {
		t.Fatalf("the token does not unwrap to the passphrase: %v", err)
	}
	return got
}

// dataIsCiphertextOnTheDisk writes a marker the disk must not show in
// clear, and random data; it returns their checksum.
func (s *encStory) dataIsCiphertextOnTheDisk() string {
	t := s.t
	t.Helper()
	marker := "LAB-PLAINTEXT-MARKER-0123456789"
	s.sh(fmt.Sprintf("for i in $(seq 2000); do echo %s; done > %s/marker && dd if=/dev/urandom of=%s/data bs=1M count=8 2>/dev/null && sync", marker, encStaging, encStaging))
	sum := s.dataSum()
	// A virtio-blk disk has no reservations: the lease area comes first,
	// LUKS2 after it.
	if b, err := os.ReadFile(s.img); err != nil || bytes.Contains(b, []byte(marker)) || !bytes.HasPrefix(b, []byte("VCOLEASE")) ||
		!bytes.HasPrefix(b[leaseData:], []byte("LUKS\xba\xbe")) {
		t.Fatalf("the disk holds the data in clear, or not the lease area and then a LUKS2 header (%v)", err)
	}
	return sum
}

// busyMappingIsNotClosed: a mapping something else still holds is not
// closed; the agent says what holds it, and unstages once it is let go.
func (s *encStory) busyMappingIsNotClosed() {
	t, ctx, g := s.t, s.ctx, s.g
	t.Helper()
	s.sh("mkdir -p /mnt/other && mount /dev/mapper/vco-vol-enc /mnt/other")
	err := agentJSON(ctx, g, nil, "volume", "unstage", encVol, "--staging", encStaging)
	var ce *cliError
	if !errors.As(err, &ce) || !strings.Contains(ce.stderr, "FailedPrecondition") || !strings.Contains(ce.stderr, "busy") || !strings.Contains(ce.stderr, "mounted at /mnt/other") {
		t.Fatalf("unstage with the mapping mounted elsewhere: %v", err)
	}
	s.sh("umount /mnt/other")
	if err := agentJSON(ctx, g, nil, "volume", "unstage", encVol, "--staging", encStaging); err != nil {
		t.Fatal(err)
	}
	s.sh("! test -e /dev/mapper/vco-vol-enc && ! grep -q ' " + encStaging + " ' /proc/mounts")
}

// restagesWithTheUnwrappedPassphrase: restaged with the unwrapped
// passphrase (no format flags), the volume has the same header and
// filesystem, the same data; a restarted agent keeps the staged volume,
// and the stage retried by kubelet finds it intact and formats nothing.
func (s *encStory) restagesWithTheUnwrappedPassphrase(got []byte, sum string) {
	t, ctx, g := s.t, s.ctx, s.g
	t.Helper()
	s.sh(fmt.Sprintf("printf %%s '%s' > /run/pw", got))
	var st stageReply
	if err := agentJSON(ctx, g, &st, s.stage...); err != nil || st.Formatted {
		t.Fatalf("restage: %+v %v", st, err)
	}
	if s.dataSum() != sum {
		t.Fatal("the data changed across unstage and restage")
	}
	stopAgent(t, ctx, g)
	startAgent(t, ctx, g)
	if err := agentJSON(ctx, g, &st, s.stage...); err != nil || st.Formatted || st.Device != "/dev/mapper/vco-vol-enc" {
		t.Fatalf("stage retried after an agent restart: %+v %v", st, err)
	}
}

// growsOnline grows the disk under the mounted volume: the mapping and
// the filesystem follow online, with the data intact; then the volume is
// filled further and unstaged.
func (s *encStory) growsOnline(diskName, sum string) {
	t, ctx, g := s.t, s.ctx, s.g
	t.Helper()
	before, _ := strconv.Atoi(s.sh("df -Pk " + encStaging + " | tail -n1 | awk '{print $2}'"))
	if _, err := g.QMP().Execute(ctx, "block_resize", map[string]any{"node-name": "bd-enc", "size": 512 << 20}); err != nil {
		t.Fatal(err)
	}
	s.sh(fmt.Sprintf("for i in $(seq 100); do [ $(cat /sys/block/%s/size) = %d ] && exit 0; sleep 0.2; done; exit 1", diskName, 512<<20/512))
	var exp struct {
		Capacity string `json:"capacity_bytes"`
	}
	if err := agentJSON(ctx, g, &exp, "volume", "expand", encVol, "--path", encStaging, "--required-bytes", strconv.Itoa(400<<20)); err != nil {
		t.Fatal(err)
	}
	if exp.Capacity != strconv.Itoa(512<<20-leaseData-16<<20) {
		t.Fatalf("expanded to %s bytes, want the disk less the lease area and the 16 MiB LUKS2 header", exp.Capacity)
	}
	after, _ := strconv.Atoi(s.sh("df -Pk " + encStaging + " | tail -n1 | awk '{print $2}'"))
	if after < before+200<<10 {
		t.Fatalf("the filesystem grew from %d to %d KiB", before, after)
	}
	if s.dataSum() != sum {
		t.Fatal("the data changed across the online growth")
	}
	s.sh(fmt.Sprintf("dd if=/dev/urandom of=%s/more bs=1M count=100 2>/dev/null && sync", encStaging))
	if err := agentJSON(ctx, g, nil, "volume", "unstage", encVol, "--staging", encStaging); err != nil {
		t.Fatal(err)
	}
}

// cryptsetupReadsTheHeader: cryptsetup, the reference, reads what the
// agent wrote (the LUKS2 header, copied out from behind the lease area)
// and accepts the passphrase.
func cryptsetupReadsTheHeader(t *testing.T, img, pass string) {
	t.Helper()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	hdr := filepath.Join(t.TempDir(), "luks-header.img")
	if err := os.WriteFile(hdr, b[leaseData:leaseData+16<<20], 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("cryptsetup", "luksDump", hdr).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "vco-transit") || !strings.Contains(string(out), "argon2id") {
		t.Fatalf("cryptsetup luksDump: %v\n%s", err, out)
	}
	cs := exec.Command("cryptsetup", "open", "--test-passphrase", "--key-file", "-", hdr)
	cs.Stdin = strings.NewReader(pass)
	if out, err := cs.CombinedOutput(); err != nil {
		t.Fatalf("cryptsetup does not accept the passphrase: %v %s", err, out)
	}
}
