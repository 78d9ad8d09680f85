package udev

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// The rules against real virtio-blk and QEMU SCSI disks in a lab guest
// (the guest tier: skipped unless VCO_LAB is set, as make test-udev-lab
// does): udevadm, scsi_id and the stock rules are the ones `make deps`
// unpacks into .tools/udev, copied into the guest with their libraries.
func TestRulesInGuest(t *testing.T) {
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	u := findGuestUdevTools(t)
	// ldd, run by the lab for every host tool, finds libsystemd-shared
	// here; the lab then copies it to the same path in the guest.
	t.Setenv("LD_LIBRARY_PATH", u.libs)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cfg, err := lab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cfg.HostTools = append(append([]string{}, lab.DefaultHostTools...), u.udevadm, u.scsiID)
	l, err := lab.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	dir := t.TempDir()
	disks := []lab.Disk{
		{ID: "data", Kind: lab.VirtioBlk, File: diskImage(t, dir, "data"), Serial: "4711"},
		{ID: "boot", Kind: lab.VirtioBlk, File: diskImage(t, dir, "boot", "sfdisk", "--quiet"), Serial: "4712"},
		{ID: "scsi", Kind: lab.SCSIHD, File: diskImage(t, dir, "scsi"), Serial: "4713"},
		{ID: "scratch", Kind: lab.VirtioBlk, File: diskImage(t, dir, "scratch"), Serial: "lab-scratch"},
		{ID: "ext4", Kind: lab.VirtioBlk, File: diskImage(t, dir, "ext4", "mkfs.ext4", "-q", "-F"), Serial: "4715"},
	}
	gs, err := l.StartGuests(ctx, lab.GuestConfig{Name: "udev", MemMB: 512, Disks: disks})
	if err != nil {
		t.Fatal(err)
	}
	g := &udevGuest{t: t, ctx: ctx, g: gs[0], tools: u}
	defer func() {
		if t.Failed() {
			t.Logf("console:\n%s", g.g.ConsoleTail(30))
		}
	}()
	g.installRules()

	for _, serial := range []string{"4711", "4713", "4715"} {
		if p := g.test(serial); p["VCO_DATA_DISK"] != "1" || !hidden(p) {
			t.Errorf("data disk with serial %s not hidden: %v", serial, p)
		}
	}
	if p := g.test("4713"); p["ID_VENDOR"] != "QEMU" || p["ID_SCSI_SERIAL"] != "4713" && p["ID_SERIAL_SHORT"] != "4713" {
		t.Errorf("the SCSI disk was not matched by its SCSI identity: %v", p)
	}
	if p := g.test("4712"); p["ID_PART_TABLE_TYPE"] != "gpt" || p["VCO_DATA_DISK"] != "" || hidden(p) {
		t.Errorf("a disk with a partition table (a boot disk) was treated as a data disk: %v", p)
	}
	if p := g.test("lab-scratch"); p["VCO_DATA_DISK"] != "" || hidden(p) {
		t.Errorf("a disk whose serial is not a disk id was treated as a data disk: %v", p)
	}
	g.claimedIsReady("4711")
}

// claimedIsReady: a data disk claimed by the agent is ready again.
func (g *udevGuest) claimedIsReady(serial string) {
	g.t.Helper()
	p := g.test(serial)
	g.sh(fmt.Sprintf("mkdir -p %[1]s && touch %[1]s/%[2]s", uevent.ClaimedDir, p["kernel-name"]))
	if p := g.test(serial); p["VCO_DATA_DISK"] != "1" || p["SYSTEMD_READY"] != "" || p["UDISKS_IGNORE"] != "" {
		g.t.Errorf("claimed data disk still hidden: %v", p)
	}
}

// hidden reports whether udev's properties hide a disk from systemd and
// udisks.
func hidden(p map[string]string) bool { return p["SYSTEMD_READY"] == "0" && p["UDISKS_IGNORE"] == "1" }

// guestUdevTools are the host's udevadm, scsi_id and stock rules (under root)
// and the directory of their libraries.
type guestUdevTools struct {
	root, udevadm, scsiID, libs string
}

// findGuestUdevTools finds the tools `make deps` unpacks into .tools/udev, or
// under VCO_UDEV_ROOT.
func findGuestUdevTools(t *testing.T) guestUdevTools {
	t.Helper()
	root, err := filepath.Abs("../../.tools/udev")
	if err != nil {
		t.Fatal(err)
	}
	if r := os.Getenv("VCO_UDEV_ROOT"); r != "" {
		root = r
	}
	u := guestUdevTools{root: root, udevadm: filepath.Join(root, "bin/udevadm"), scsiID: filepath.Join(root, "lib/udev/scsi_id"),
		libs: filepath.Join(root, "usr/lib/x86_64-linux-gnu/systemd")}
	for _, p := range []string{u.udevadm, u.scsiID, u.libs} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%v (run make deps-udev)", err)
		}
	}
	return u
}

// diskImage makes a 64 MiB image in dir, prepared by the command prepare
// (with the image's path as its last argument) if one is given: sfdisk
// writes a GPT with one partition.
func diskImage(t *testing.T, dir, name string, prepare ...string) string {
	t.Helper()
	p := filepath.Join(dir, name+".img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 64<<20); err != nil {
		t.Fatal(err)
	}
	if len(prepare) > 0 {
		cmd := exec.Command(prepare[0], append(prepare[1:], p)...)
		if prepare[0] == "sfdisk" {
			cmd.Stdin = strings.NewReader("label: gpt\n,32MiB\n")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v %s", prepare, err, out)
		}
	}
	return p
}

// udevGuest is the lab guest the rules are tested in.
type udevGuest struct {
	t     *testing.T
	ctx   context.Context
	g     *lab.Guest
	tools guestUdevTools
}

func (g *udevGuest) sh(script string) string {
	g.t.Helper()
	out, err := g.g.MustSh(g.ctx, script)
	if err != nil {
		g.t.Fatal(err)
	}
	return out
}

// installRules copies scsi_id, the stock rules and ours into the guest.
func (g *udevGuest) installRules() {
	t, root, scsiID := g.t, g.tools.root, g.tools.scsiID
	t.Helper()
	g.sh("mkdir -p /usr/lib/udev/rules.d /lib/udev /etc/udev && cp " + scsiID + " /usr/lib/udev/scsi_id && cp " + scsiID + " /lib/udev/scsi_id")
	for _, f := range []string{filepath.Join(root, "lib/udev/rules.d/50-udev-default.rules"), filepath.Join(root, "lib/udev/rules.d/60-persistent-storage.rules"), RulesFile} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		r, err := g.g.Exec().RunInput(g.ctx, time.Minute, b, "sh", "-c", "cat > /usr/lib/udev/rules.d/"+filepath.Base(f))
		if err != nil || r.Exit != 0 {
			t.Fatalf("copying %s into the guest: %v %v", f, err, r)
		}
	}
}

// test runs `udevadm test --action=add` on the disk with serial and
// returns the properties it printed, with the disk's kernel name under
// "kernel-name"; udev must not complain about our rules.
func (g *udevGuest) test(serial string) map[string]string {
	t := g.t
	t.Helper()
	wctx, wcancel := context.WithTimeout(g.ctx, time.Minute)
	d, err := g.g.WaitDiskBySerial(wctx, serial)
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	out := g.sh(fmt.Sprintf("LD_LIBRARY_PATH=%s %s test --action=add /sys/class/block/%s 2>&1", g.tools.libs, g.tools.udevadm, d.Name))
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, RulesFile) && (strings.Contains(l, "nvalid") || strings.Contains(l, "rror")) {
			t.Errorf("udev complains about our rules: %s", l)
		}
	}
	p := parseProps(out)
	if p["DEVNAME"] != "/dev/"+d.Name {
		t.Fatalf("udevadm test printed no properties for %s:\n%s", d.Name, out)
	}
	p["kernel-name"] = d.Name
	return p
}
