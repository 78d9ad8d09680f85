package dmcrypt_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// guestTools are the host programs the dm-crypt guest test needs besides
// busybox: cryptsetup as the reference implementation and the ext4 tools.
var guestTools = []string{"/usr/sbin/cryptsetup", "/usr/sbin/mke2fs", "/usr/sbin/resize2fs"}

type cryptGuest struct {
	t   *testing.T
	ctx context.Context
	g   *lab.Guest
}

func (c *cryptGuest) sh(script string) string {
	c.t.Helper()
	out, err := c.g.MustSh(c.ctx, script)
	if err != nil {
		c.t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// shErr runs a script that must succeed and returns its stdout and stderr.
func (c *cryptGuest) shErr(script string) (string, string) {
	c.t.Helper()
	r, err := c.g.Sh(c.ctx, script)
	if err != nil {
		c.t.Fatal(err)
	}
	if r.Exit != 0 {
		c.t.Fatalf("%q failed: %s", script, r)
	}
	return strings.TrimSpace(r.Stdout), strings.TrimSpace(r.Stderr)
}

// shFail runs a script that must fail and returns its stderr.
func (c *cryptGuest) shFail(script string) string {
	c.t.Helper()
	r, err := c.g.Sh(c.ctx, script)
	if err != nil {
		c.t.Fatal(err)
	}
	if r.Exit == 0 {
		c.t.Fatalf("%q succeeded: %s", script, r)
	}
	return r.Stderr
}

// diskBySerial finds the guest's device node for a virtio-blk serial.
func (c *cryptGuest) disk(serial string) string {
	c.t.Helper()
	wctx, cancel := context.WithTimeout(c.ctx, time.Minute)
	defer cancel()
	d, err := c.g.WaitDiskBySerial(wctx, serial)
	if err != nil {
		c.t.Fatal(err)
	}
	return "/dev/" + d.Name
}

// Real dm-crypt in a guest kernel of the QEMU lab (the guest tier: skipped
// unless VCO_LAB is set, as make test-crypt-lab does): format with vco-agent
// and open through luks.go, use a filesystem, check cryptsetup reads the
// same data through its own mapping, grow the disk and luks.go's mapping
// online, open the volume with its primary header damaged (our reader,
// from the secondary copy), and open a volume cryptsetup formatted,
// read-write through luks.go and read-only through crypt/dmcrypt.
func TestDMCryptInGuest(t *testing.T) {
	if ok, _ := lab.GuestTierEnabled(); !ok {
		t.Skip("guest tier: boots a QEMU guest; run it with 'make test-crypt-lab' (sets " + lab.GuestTierEnv + "=1)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	l := newCryptLab(ctx, t)
	defer l.Close()

	ours, theirs := cryptImages(t)
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "crypt", MemMB: 512, Disks: []lab.Disk{
		{ID: "ours", Kind: lab.VirtioBlk, File: ours, Serial: "crypt-ours"},
		{ID: "theirs", Kind: lab.VirtioBlk, File: theirs, Serial: "crypt-theirs"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	c := &cryptGuest{t: t, ctx: ctx, g: gs[0]}
	defer func() {
		if t.Failed() {
			t.Logf("console:\n%s", c.g.ConsoleTail(30))
		}
	}()
	dev := c.disk("crypt-ours")
	theirDev := c.disk("crypt-theirs")
	c.sh("printf 'our secret' > /tmp/pw && printf 'their secret' > /tmp/pw2 && mkdir -p /mnt/a /mnt/b /run/cryptsetup")

	sum := c.formatOpenAndWrite(dev)
	c.cryptsetupReadsOurData(dev, sum)
	c.growOnline(dev, sum)
	c.openWithTheDamagedPrimaryHeader(dev, sum)
	c.openTheirsReadWriteAndReadOnly(theirDev)
}

// newCryptLab starts the lab with the host tools the guest needs.
func newCryptLab(ctx context.Context, t *testing.T) *lab.Lab {
	t.Helper()
	cfg, err := lab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cfg.HostTools = append(append([]string{}, lab.DefaultHostTools...), guestTools...)
	l, err := lab.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// cryptImages makes the guest's two 64 MiB disk images: ours, blank, and
// theirs, formatted by cryptsetup on the host with "their secret".
func cryptImages(t *testing.T) (ours, theirs string) {
	t.Helper()
	dir := t.TempDir()
	ours = filepath.Join(dir, "ours.img")
	theirs = filepath.Join(dir, "theirs.img")
	for _, p := range []string{ours, theirs} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	cs := exec.Command("cryptsetup", "luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--pbkdf", "argon2id",
		"--pbkdf-force-iterations", "4", "--pbkdf-memory", "8192", "--pbkdf-parallel", "1", "--sector-size", "512", theirs)
	cs.Stdin = strings.NewReader("their secret")
	if out, err := cs.CombinedOutput(); err != nil {
		t.Fatalf("cryptsetup luksFormat on the host: %v %s", err, out)
	}
	return ours, theirs
}

// luksStatus is what vco-agent luks status prints.
type luksStatus struct {
	Length uint64 `json:"length"`
	Table  string `json:"table"`
	DevNo  uint64 `json:"devno"`
}

func (c *cryptGuest) status(name string) luksStatus {
	c.t.Helper()
	var st luksStatus
	if err := json.Unmarshal([]byte(c.sh("vco-agent luks status "+name)), &st); err != nil {
		c.t.Fatal(err)
	}
	return st
}

// formatOpenAndWrite formats dev with vco-agent, opens it through luks.go
// as ours, refuses a second open under the same name and a wrong
// passphrase, writes 4 MiB through an ext4 filesystem, refuses to close it
// while mounted, and closes it. It returns the data's checksum.
func (c *cryptGuest) formatOpenAndWrite(dev string) string {
	t := c.t
	t.Helper()
	kdf := "--kdf-time 4 --kdf-memory 8192 --kdf-threads 1"
	// Format, open, mkfs, write.
	c.sh(fmt.Sprintf("vco-agent luks format %s --passphrase-file /tmp/pw %s", dev, kdf))
	// luks.go unlocks and maps it (the CLI says on stderr when it is not).
	if got, errs := c.shErr(fmt.Sprintf("vco-agent luks open %s ours --passphrase-file /tmp/pw", dev)); got != "/dev/mapper/ours" || errs != "" {
		t.Fatalf("open printed %q, stderr %q", got, errs)
	}
	if st := c.status("ours"); st.Length != 48<<20 || !strings.HasPrefix(st.Table, "crypt aes-xts-plain64 - 0 ") || !strings.HasSuffix(st.Table, " 32768 1 sector_size:4096") {
		t.Fatalf("status %+v", st)
	}
	c.sh("test -b /dev/mapper/ours")
	// The same name twice, a wrong passphrase: refused, nothing left behind.
	if errs := c.shFail(fmt.Sprintf("vco-agent luks open %s ours --passphrase-file /tmp/pw", dev)); !strings.Contains(errs, "already exists") {
		t.Fatalf("second open under the same name: %s", errs)
	}
	if errs := c.shFail(fmt.Sprintf("vco-agent luks open %s other --passphrase-file /tmp/pw2", dev)); !strings.Contains(errs, "no keyslot accepts") {
		t.Fatalf("open with a wrong passphrase: %s", errs)
	}
	c.sh("! test -e /dev/mapper/other && vco-agent luks close other")
	c.sh("/usr/sbin/mke2fs -q -t ext4 /dev/mapper/ours && mount /dev/mapper/ours /mnt/a && dd if=/dev/urandom of=/mnt/a/data bs=1M count=4 2>/dev/null && sync")
	sum := c.sh("sha256sum /mnt/a/data | cut -d' ' -f1")

	// Closing a mounted volume fails and names the mount.
	errs := c.shFail("vco-agent luks close --timeout 1s ours")
	if !strings.Contains(errs, "busy") || !strings.Contains(errs, "mounted at /mnt/a") {
		t.Fatalf("close while mounted: %s", errs)
	}
	c.sh("umount /mnt/a && vco-agent luks close ours && ! test -e /dev/mapper/ours")
	return sum
}

// cryptsetupReadsOurData: cryptsetup's own mapping of our volume reads the
// same data.
func (c *cryptGuest) cryptsetupReadsOurData(dev, sum string) {
	c.t.Helper()
	c.sh(fmt.Sprintf("/usr/sbin/cryptsetup open --disable-locks --key-file /tmp/pw %s cs && mount /dev/mapper/cs /mnt/b", dev))
	if got := c.sh("sha256sum /mnt/b/data | cut -d' ' -f1"); got != sum {
		c.t.Fatalf("cryptsetup reads %s, we wrote %s", got, sum)
	}
	c.sh("umount /mnt/b && /usr/sbin/cryptsetup close cs")
}

// growOnline reopens the volume (luks.go's mapping), then grows the disk
// and the mapping online, fs mounted: the filesystem grows, the data stays.
func (c *cryptGuest) growOnline(dev, sum string) {
	t := c.t
	t.Helper()
	if _, errs := c.shErr(fmt.Sprintf("vco-agent luks open %s ours --passphrase-file /tmp/pw && mount /dev/mapper/ours /mnt/a", dev)); errs != "" {
		t.Fatalf("reopen: %s", errs)
	}
	if got := c.sh("sha256sum /mnt/a/data | cut -d' ' -f1"); got != sum {
		t.Fatal("data changed across close and reopen")
	}
	before := c.sh("df -k /mnt/a | tail -n1 | awk '{print $2}'")
	if _, err := c.g.QMP().Execute(c.ctx, "block_resize", map[string]any{"node-name": "bd-ours", "size": 128 << 20}); err != nil {
		t.Fatal(err)
	}
	name := strings.TrimPrefix(dev, "/dev/")
	c.sh(fmt.Sprintf("for i in $(seq 50); do [ $(cat /sys/block/%s/size) = 262144 ] && exit 0; sleep 0.2; done; exit 1", name))
	if got := c.sh("vco-agent luks resize ours"); got != fmt.Sprintf("ours: %d bytes", 112<<20) {
		t.Fatalf("resize printed %q", got)
	}
	c.sh("/usr/sbin/resize2fs /dev/mapper/ours >/dev/null 2>&1")
	after := c.sh("df -k /mnt/a | tail -n1 | awk '{print $2}'")
	b, _ := strconv.Atoi(before)
	a, _ := strconv.Atoi(after)
	if a < b+60<<10 {
		t.Fatalf("filesystem grew from %d to %d KiB", b, a)
	}
	if got := c.sh("sha256sum /mnt/a/data | cut -d' ' -f1"); got != sum {
		t.Fatal("data changed across the online resize")
	}
	c.sh("dd if=/dev/urandom of=/mnt/a/more bs=1M count=40 2>/dev/null && sync && umount /mnt/a && vco-agent luks close ours")
}

// openWithTheDamagedPrimaryHeader: with a damaged primary header luks.go
// cannot read it, our reader opens the volume from the secondary copy and
// says so; the data is there and the header is left as it was.
func (c *cryptGuest) openWithTheDamagedPrimaryHeader(dev, sum string) {
	t := c.t
	t.Helper()
	c.sh(fmt.Sprintf("printf garbage | dd of=%s bs=1 seek=4106 conv=notrunc 2>/dev/null && sync", dev))
	hdr := c.sh(fmt.Sprintf("head -c 32768 %s | sha256sum", dev))
	got, errs := c.shErr(fmt.Sprintf("vco-agent luks open %s ours --passphrase-file /tmp/pw", dev))
	if got != "/dev/mapper/ours" || !strings.Contains(errs, "header is damaged") || !strings.Contains(errs, "secondary copy") || !strings.Contains(errs, "unlocked by crypt/luks2") {
		t.Fatalf("open with a damaged primary header printed %q, stderr %q", got, errs)
	}
	c.sh("mount /dev/mapper/ours /mnt/a")
	if got := c.sh("sha256sum /mnt/a/data | cut -d' ' -f1"); got != sum {
		t.Fatal("the data read through the secondary header differs")
	}
	c.sh("umount /mnt/a && vco-agent luks close ours")
	if c.sh(fmt.Sprintf("head -c 32768 %s | sha256sum", dev)) != hdr {
		t.Fatal("opening rewrote the damaged header")
	}
}

// openTheirsReadWriteAndReadOnly: a volume cryptsetup formatted opens with
// our code, discards on; what we write there cryptsetup reads back. Read
// only, luks.go cannot, crypt/dmcrypt maps it and refuses writes.
func (c *cryptGuest) openTheirsReadWriteAndReadOnly(theirDev string) {
	t := c.t
	t.Helper()
	c.sh(fmt.Sprintf("vco-agent luks open %s theirs --passphrase-file /tmp/pw2 --allow-discards", theirDev))
	if st := c.status("theirs"); !strings.HasSuffix(st.Table, " 32768 1 allow_discards") || st.Length != 48<<20 {
		t.Fatalf("status %+v", st)
	}
	c.sh("dd if=/dev/urandom of=/tmp/blob bs=1M count=3 2>/dev/null && dd if=/tmp/blob of=/dev/mapper/theirs bs=1M conv=fsync 2>/dev/null")
	c.sh("vco-agent luks close theirs")
	// Read-only: luks.go cannot, crypt/dmcrypt maps it.
	if _, errs := c.shErr(fmt.Sprintf("vco-agent luks open %s ro --passphrase-file /tmp/pw2 --readonly", theirDev)); !strings.Contains(errs, "read-only") {
		t.Fatalf("read-only open, stderr %q", errs)
	}
	var ro struct {
		ReadOnly bool `json:"read_only"`
	}
	if err := json.Unmarshal([]byte(c.sh("vco-agent luks status ro")), &ro); err != nil || !ro.ReadOnly {
		t.Fatalf("read-only mapping: %+v %v", ro, err)
	}
	c.shFail("dd if=/dev/zero of=/dev/mapper/ro bs=4096 count=1 conv=fsync 2>/dev/null")
	c.sh("vco-agent luks close ro")
	c.sh(fmt.Sprintf("/usr/sbin/cryptsetup open --disable-locks --key-file /tmp/pw2 %s cs2", theirDev))
	if c.sh("head -c 3145728 /dev/mapper/cs2 | sha256sum | cut -d' ' -f1") != c.sh("sha256sum /tmp/blob | cut -d' ' -f1") {
		t.Fatal("cryptsetup reads different data from the volume we mapped")
	}
	c.sh("/usr/sbin/cryptsetup close cs2")
}
