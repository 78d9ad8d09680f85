package udev

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// udevTools is a udevadm and the stock rules it comes with: the system's
// when udev is installed, else the copy `make deps` unpacks (without
// installing or starting anything) into .tools/udev.
type udevTools struct {
	udevadm string
	libs    string // LD_LIBRARY_PATH for an unpacked copy
	rules   string // directory with 60-persistent-storage.rules
}

func findUdev(t *testing.T) udevTools {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for a mount namespace and a loop device")
	roots := []string{os.Getenv("VCO_UDEV_ROOT"), "../../.tools/udev"}
	for _, r := range roots {
		if r == "" {
			continue
		}
		bin := filepath.Join(r, "bin/udevadm")
		if _, err := os.Stat(bin); err == nil {
			abs, _ := filepath.Abs(r)
			return udevTools{udevadm: filepath.Join(abs, "bin/udevadm"),
				libs:  filepath.Join(abs, "usr/lib/x86_64-linux-gnu/systemd"),
				rules: filepath.Join(abs, "lib/udev/rules.d")}
		}
	}
	if p, err := exec.LookPath("udevadm"); err == nil {
		return udevTools{udevadm: p, rules: "/usr/lib/udev/rules.d"}
	}
	t.Skip("no udevadm: run `make deps` (it unpacks one into .tools/udev)")
	return udevTools{}
}

// udevTest runs `udevadm test --action=add` for dev with our rules, the
// stock 50-udev-default and 60-persistent-storage rules, and extra rules
// (a site's 59-*.rules), in a private mount namespace: /run, /dev and the
// rules directories are fresh tmpfs there, so udevadm's database, links
// and permission changes never reach the host. claimed creates the
// agent's claim marker first. It returns the device properties udev would
// store.
func udevTest(t *testing.T, u udevTools, dev string, extra string, claimed bool) (map[string]string, string) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	name := filepath.Base(dev)
	rules := t.TempDir()
	for _, f := range []string{"50-udev-default.rules", "60-persistent-storage.rules"} {
		b, err := os.ReadFile(filepath.Join(u.rules, f))
		if err != nil {
			t.Fatalf("stock rules: %v", err)
		}
		if err := os.WriteFile(filepath.Join(rules, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ours, err := os.ReadFile(RulesFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rules, RulesFile), ours, 0o644); err != nil {
		t.Fatal(err)
	}
	if extra != "" {
		if err := os.WriteFile(filepath.Join(rules, "59-site.rules"), []byte(extra), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	marker := ""
	if claimed {
		marker = fmt.Sprintf("mkdir -p %[1]s && touch %[1]s/%[2]s", uevent.ClaimedDir, name)
	}
	script := fmt.Sprintf(`set -e
mount --make-rprivate /
for d in /etc/udev/rules.d /usr/lib/udev/rules.d /usr/local/lib/udev/rules.d /lib/udev/rules.d; do
  if [ -d "$d" ]; then mount -t tmpfs tmpfs "$d"; fi
done
mount -t tmpfs tmpfs /run
mkdir -p /run/udev/rules.d
cp %[1]s/*.rules /run/udev/rules.d/
%[2]s
mount -t tmpfs tmpfs /dev
mknod /dev/%[3]s b %[4]d %[5]d
mknod /dev/null c 1 3
exec %[6]s test --action=add /sys/class/block/%[3]s
`, rules, marker, name, unix.Major(st.Rdev), unix.Minor(st.Rdev), u.udevadm)
	cmd := exec.Command("unshare", "--mount", "sh", "-c", script)
	if u.libs != "" {
		cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+u.libs)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("udevadm test: %v\n%s", err, out)
	}
	props := parseProps(string(out))
	if props["DEVNAME"] != "/dev/"+name {
		t.Fatalf("udevadm test printed no properties for %s:\n%s", name, out)
	}
	return props, string(out)
}

// parseProps reads the KEY=VALUE lines udevadm test prints at its end.
func parseProps(out string) map[string]string {
	props := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(l, "="); ok && k != "" && strings.ToUpper(k) == k && !strings.ContainsAny(k, " :/") {
			props[k] = v
		}
	}
	return props
}

func loop(t *testing.T) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 8<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// The rules, run by a real udevadm on a real block device: they parse
// cleanly, leave a device that is not a data disk alone, mark a data disk
// until the agent's claim marker exists, and then leave it ready.
//
// A loop device is not a cloud disk, so the site override (VCO_DATA_DISK=1
// from an earlier rules file) stands in for the virtio/SCSI match here;
// that match itself is exercised against real virtio-blk and virtio-scsi
// disks in the QEMU lab.
// The rules look for the claim marks where the agent writes them.
func TestRulesUseTheAgentsClaimMarks(t *testing.T) {
	b, err := os.ReadFile(RulesFile)
	if err != nil {
		t.Fatal(err)
	}
	if want := `TEST=="` + uevent.ClaimedDir + `/%k"`; !strings.Contains(string(b), want) {
		t.Fatalf("%s does not test %s", RulesFile, want)
	}
}

func TestRulesWithUdevadm(t *testing.T) {
	u := findUdev(t)
	dev := loop(t)
	name := filepath.Base(dev)
	site := fmt.Sprintf("SUBSYSTEM==\"block\", KERNEL==\"%s\", ENV{VCO_DATA_DISK}=\"1\"\n", name)

	props, out := udevTest(t, u, dev, "", false)
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, RulesFile) && (strings.Contains(l, "nvalid") || strings.Contains(l, "gnoring") || strings.Contains(l, "rror")) {
			t.Errorf("udev complains about our rules: %s", l)
		}
	}
	if !strings.Contains(out, RulesFile) {
		t.Fatalf("udevadm did not read %s:\n%s", RulesFile, out)
	}
	if _, ok := props["SYSTEMD_READY"]; ok || props["VCO_DATA_DISK"] != "" {
		t.Fatalf("a loop device was treated as a data disk: %v", props)
	}

	props, _ = udevTest(t, u, dev, site, false)
	if props["VCO_DATA_DISK"] != "1" || props["SYSTEMD_READY"] != "0" || props["UDISKS_IGNORE"] != "1" {
		t.Fatalf("unclaimed data disk: %v", props)
	}

	props, _ = udevTest(t, u, dev, site, true)
	if props["VCO_DATA_DISK"] != "1" {
		t.Fatalf("claimed data disk lost its mark: %v", props)
	}
	if _, ok := props["SYSTEMD_READY"]; ok {
		t.Fatalf("claimed data disk still hidden: %v", props)
	}
	if _, ok := props["UDISKS_IGNORE"]; ok {
		t.Fatalf("claimed data disk still hidden from udisks: %v", props)
	}

	// A site's VCO_DATA_DISK=0 wins.
	props, _ = udevTest(t, u, dev, strings.Replace(site, `="1"`, `="0"`, 1), false)
	if _, ok := props["SYSTEMD_READY"]; ok {
		t.Fatalf("excluded disk marked: %v", props)
	}
}
