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
	sh := func(script string) string {
		t.Helper()
		out, err := g.MustSh(ctx, script)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(out)
	}
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

	const vol, staging = "vol-enc", "/var/lib/kubelet/plugins/kubernetes.io/csi/cloud.whitesky.csi/enc/globalmount"
	loc := []string{"--serial", "vol-enc"}
	var tok volumeToken
	if err := agentJSON(ctx, g, &tok, append([]string{"volume", "token", vol}, loc...)...); err != nil || tok.Content != "VOLUME_CONTENT_BLANK" {
		t.Fatalf("token of the blank disk: %+v %v", tok, err)
	}
	sh(fmt.Sprintf("printf %%s '%s' > /run/pw && printf %%s '%s' > /run/wrapped", pass, ct.Text))
	stage := append([]string{"volume", "stage", vol, "--staging", staging, "--passphrase-file", "/run/pw"}, loc...)
	first := append(append([]string{}, stage...), "--format-if-blank", "--wrapped-file", "/run/wrapped",
		"--transit-key", "vco-volumes", "--transit-key-version", strconv.Itoa(ct.Version))
	var st stageReply
	if err := agentJSON(ctx, g, &st, first...); err != nil || !st.Formatted || st.Device != "/dev/mapper/vco-vol-enc" || st.Fencing != "FENCING_METHOD_DISK_LEASE" {
		t.Fatalf("first stage: %+v %v", st, err)
	}
	t.Logf("staged: %+v", st)
	if got := sh("vco-agent luks status vco-vol-enc"); !strings.Contains(got, `"crypt aes-xts-plain64 - 0 `) {
		t.Fatalf("the mapping is not dm-crypt aes-xts-plain64: %s", got)
	}
	if got := sh("blkid -p -s TYPE -o value /dev/mapper/vco-vol-enc; grep ' " + staging + " ' /proc/mounts | cut -d' ' -f1"); got != "ext4\n/dev/mapper/vco-vol-enc" {
		t.Fatalf("filesystem and mount: %q", got)
	}

	// What the node plugin does before a later stage: read the token,
	// unwrap it.
	if err := agentJSON(ctx, g, &tok, append([]string{"volume", "token", vol}, loc...)...); err != nil ||
		tok.Content != "VOLUME_CONTENT_LUKS2" || tok.TransitToken == nil || tok.TransitToken.Ciphertext != ct.Text ||
		tok.TransitToken.KeyVersion != 2 || tok.TransitToken.KeyName != "vco-volumes" {
		t.Fatalf("token of the formatted volume: %+v %v", tok, err)
	}
	got, err := tc.Decrypt(ctx, tok.TransitToken.KeyName, tok.TransitToken.Ciphertext)
	if err != nil || string(got) != pass {
		t.Fatalf("the token does not unwrap to the passphrase: %v", err)
	}

	// Data: a marker the disk must not show in clear.
	marker := "LAB-PLAINTEXT-MARKER-0123456789"
	sh(fmt.Sprintf("for i in $(seq 2000); do echo %s; done > %s/marker && dd if=/dev/urandom of=%s/data bs=1M count=8 2>/dev/null && sync", marker, staging, staging))
	sum := sh(fmt.Sprintf("cat %s/marker %s/data | sha256sum | cut -d' ' -f1", staging, staging))
	// A virtio-blk disk has no reservations: the lease area comes first,
	// LUKS2 after it.
	if b, err := os.ReadFile(img); err != nil || bytes.Contains(b, []byte(marker)) || !bytes.HasPrefix(b, []byte("VCOLEASE")) ||
		!bytes.HasPrefix(b[leaseData:], []byte("LUKS\xba\xbe")) {
		t.Fatalf("the disk holds the data in clear, or not the lease area and then a LUKS2 header (%v)", err)
	}

	// A mapping something else still holds is not closed; the agent says
	// what holds it, and unstages once it is let go.
	sh("mkdir -p /mnt/other && mount /dev/mapper/vco-vol-enc /mnt/other")
	err = agentJSON(ctx, g, nil, "volume", "unstage", vol, "--staging", staging)
	var ce *cliError
	if !errors.As(err, &ce) || !strings.Contains(ce.stderr, "FailedPrecondition") || !strings.Contains(ce.stderr, "busy") || !strings.Contains(ce.stderr, "mounted at /mnt/other") {
		t.Fatalf("unstage with the mapping mounted elsewhere: %v", err)
	}
	sh("umount /mnt/other")
	if err := agentJSON(ctx, g, nil, "volume", "unstage", vol, "--staging", staging); err != nil {
		t.Fatal(err)
	}
	sh("! test -e /dev/mapper/vco-vol-enc && ! grep -q ' " + staging + " ' /proc/mounts")

	// Restage with the unwrapped passphrase (no format flags): the same
	// header and filesystem, the same data.
	sh(fmt.Sprintf("printf %%s '%s' > /run/pw", got))
	if err := agentJSON(ctx, g, &st, stage...); err != nil || st.Formatted {
		t.Fatalf("restage: %+v %v", st, err)
	}
	if s := sh(fmt.Sprintf("cat %s/marker %s/data | sha256sum | cut -d' ' -f1", staging, staging)); s != sum {
		t.Fatal("the data changed across unstage and restage")
	}
	// A restarted agent keeps the staged volume; the stage retried by
	// kubelet finds it intact and formats nothing.
	stopAgent(t, ctx, g)
	startAgent(t, ctx, g)
	if err := agentJSON(ctx, g, &st, stage...); err != nil || st.Formatted || st.Device != "/dev/mapper/vco-vol-enc" {
		t.Fatalf("stage retried after an agent restart: %+v %v", st, err)
	}

	// Grow the disk under the mounted volume: the mapping and the
	// filesystem follow online.
	before, _ := strconv.Atoi(sh("df -Pk " + staging + " | tail -n1 | awk '{print $2}'"))
	if _, err := g.QMP().Execute(ctx, "block_resize", map[string]any{"node-name": "bd-enc", "size": 512 << 20}); err != nil {
		t.Fatal(err)
	}
	sh(fmt.Sprintf("for i in $(seq 100); do [ $(cat /sys/block/%s/size) = %d ] && exit 0; sleep 0.2; done; exit 1", disk.Name, 512<<20/512))
	var exp struct {
		Capacity string `json:"capacity_bytes"`
	}
	if err := agentJSON(ctx, g, &exp, "volume", "expand", vol, "--path", staging, "--required-bytes", strconv.Itoa(400<<20)); err != nil {
		t.Fatal(err)
	}
	if exp.Capacity != strconv.Itoa(512<<20-leaseData-16<<20) {
		t.Fatalf("expanded to %s bytes, want the disk less the lease area and the 16 MiB LUKS2 header", exp.Capacity)
	}
	after, _ := strconv.Atoi(sh("df -Pk " + staging + " | tail -n1 | awk '{print $2}'"))
	if after < before+200<<10 {
		t.Fatalf("the filesystem grew from %d to %d KiB", before, after)
	}
	if s := sh(fmt.Sprintf("cat %s/marker %s/data | sha256sum | cut -d' ' -f1", staging, staging)); s != sum {
		t.Fatal("the data changed across the online growth")
	}
	sh(fmt.Sprintf("dd if=/dev/urandom of=%s/more bs=1M count=100 2>/dev/null && sync", staging))
	if err := agentJSON(ctx, g, nil, "volume", "unstage", vol, "--staging", staging); err != nil {
		t.Fatal(err)
	}
	stopAgent(t, ctx, g)

	// cryptsetup, the reference, reads what the agent wrote (the LUKS2
	// header, copied out from behind the lease area).
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
