package lab

// Systemd guests: Debian 12 booted from a root disk, with the packaged
// vco-agent installed by dpkg, so systemd runs the agent under its real
// unit, socket, sandbox and syscall filter. They show what the busybox
// guests cannot: systemd restarting a killed agent, and the unit letting
// the agent do real disk work. The root is the debootstrap that the
// packaging check boots too (packaging/test/guest-root.sh makes it).

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"
)

// DebianRoot is what a systemd guest is made from.
type DebianRoot struct {
	// Tar is the debootstrapped bookworm root file system.
	Tar string
	// Deb is the vco-agent package for amd64, installed into it with dpkg.
	Deb string
	// UserData, when set, is a cloud-init NoCloud seed's user-data: the
	// image keeps cloud-init, the package's own enablement of its units is
	// undone, and the seed is what enables and configures the agent, as on
	// a node image built without running maintainer scripts. Unset, cloud-init
	// is masked (a minute of Python under TCG that would find no seed).
	UserData string
}

// SystemBoot is how a guest boots from a root disk of its own.
type SystemBoot struct {
	// Kernel and Initrd are the root's own, taken out of its /boot.
	Kernel, Initrd string
	// Root is a raw ext4 image of the whole root file system. Guests never
	// write to it (see qemuArgs), so several share it.
	Root string
}

// FindDebianRoot finds the root tar ($VCO_PKG_CACHE, default
// /var/cache/vco-packaging, bookworm-guest.tar) and the .deb
// ($VCO_AGENT_DEB, else the newest dist/vco-agent_*_amd64.deb under the
// working directory or this module's root). The error says what is
// missing and which make target makes it.
func FindDebianRoot() (*DebianRoot, error) {
	cache := os.Getenv("VCO_PKG_CACHE")
	if cache == "" {
		cache = "/var/cache/vco-packaging"
	}
	r := &DebianRoot{Tar: filepath.Join(cache, "bookworm-guest.tar"), Deb: os.Getenv("VCO_AGENT_DEB")}
	var missing []string
	if st, err := os.Stat(r.Tar); err != nil || st.Size() == 0 {
		missing = append(missing, fmt.Sprintf("no Debian guest root at %s ('make guest-root' debootstraps it, about 14 minutes once)", r.Tar))
	}
	if r.Deb == "" {
		_, file, _, _ := runtime.Caller(0)
		var best time.Time
		for _, dir := range []string{"dist", filepath.Join(filepath.Dir(file), "..", "..", "dist")} {
			debs, _ := filepath.Glob(filepath.Join(dir, "vco-agent_*_amd64.deb"))
			for _, d := range debs {
				if st, err := os.Stat(d); err == nil && st.ModTime().After(best) {
					r.Deb, best = d, st.ModTime()
				}
			}
		}
	}
	if r.Deb == "" {
		missing = append(missing, "no vco-agent_*_amd64.deb in dist/ and VCO_AGENT_DEB not set ('make packages' builds it)")
	} else if _, err := os.Stat(r.Deb); err != nil {
		missing = append(missing, fmt.Sprintf("the vco-agent package: %v", err))
	}
	if len(missing) > 0 {
		return nil, errors.New(strings.Join(missing, "; "))
	}
	return r, nil
}

// execUnit runs the lab's exec server as a service, so the host can run
// commands in the guest over virtio-serial as in the busybox guests.
const execUnit = `[Unit]
Description=vco-lab exec channel (commands from the lab host over virtio-serial)

[Service]
ExecStart=%s
Restart=always
RestartSec=1s

[Install]
WantedBy=multi-user.target
`

// quietUnits are masked in the image: periodic jobs that would only take
// CPU from the test under TCG, and cloud-init, which has no seed here.
var quietUnits = []string{
	"apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "e2scrub_reap.service",
	"fstrim.timer", "man-db.timer", "logrotate.timer", "dpkg-db-backup.timer",
	"cloud-init.service", "cloud-init-local.service", "cloud-config.service", "cloud-final.service",
}

// DebianImage returns the boot of a systemd guest made from root: the
// package installed, the lab's binaries that the package does not provide
// (the exec server, the CSI plugin) at their guest paths, the exec server
// enabled as a service, and files (guest path -> content) written last.
// The image is kept in the cache under a digest of all of these, so the
// next lab with the same inputs boots it without building (a build takes
// about a minute: unpacking the root, dpkg, mkfs.ext4 -d).
func (l *Lab) DebianImage(ctx context.Context, root *DebianRoot, files map[string]string) (*SystemBoot, error) {
	return l.DebianImageWith(ctx, "debian", root, files, nil)
}

// DebianImageWith is DebianImage with more host binaries (guest path ->
// host path) copied into the image, such as a kubelet: large files that
// the lab's busybox initramfs, which gets every binary of the lab's
// Config, must not carry. Images are cached under the cache directory's
// subdirectory name.
func (l *Lab) DebianImageWith(ctx context.Context, name string, root *DebianRoot, files, binaries map[string]string) (*SystemBoot, error) {
	bins := map[string]string{}
	for g, h := range l.cfg.Binaries {
		bins[g] = h
	}
	for g, h := range binaries {
		bins[g] = h
	}
	key, err := l.debianKey(root, files, bins)
	if err != nil {
		return nil, err
	}
	base := filepath.Join(l.cfg.CacheDir, name)
	if err := os.MkdirAll(base, 0o755); err != nil {
		return nil, err
	}
	unlock, err := lockFile(filepath.Join(base, "lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()
	dir := filepath.Join(base, key)
	sb := &SystemBoot{Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd.img"), Root: filepath.Join(dir, "root.img")}
	if _, err := os.Stat(sb.Root); err == nil {
		now := time.Now()
		_ = os.Chtimes(dir, now, now) // used: kept another imageKeep
		return sb, nil
	}
	// Images of other inputs are kept for a while: labs of different
	// kinds (the story's systemd guest, the Kubernetes workers, the
	// package check) run side by side and each boots its own. Those not
	// used for imageKeep go; a guest still booted from one keeps its open
	// file. Under the lock, a build directory is what a killed build left.
	old, _ := filepath.Glob(filepath.Join(base, "*", "root.img"))
	builds, _ := filepath.Glob(filepath.Join(base, ".build-*"))
	for _, o := range old {
		if st, err := os.Stat(filepath.Dir(o)); err == nil && time.Since(st.ModTime()) > imageKeep {
			_ = os.RemoveAll(filepath.Dir(o))
		}
	}
	for _, b := range builds {
		_ = os.RemoveAll(b)
	}
	tmp, err := os.MkdirTemp(base, ".build-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if err := l.buildDebian(ctx, root, files, bins, tmp); err != nil {
		return nil, fmt.Errorf("building the systemd guest image from %s and %s: %w", root.Tar, root.Deb, err)
	}
	if err := os.Rename(filepath.Join(tmp, "out"), dir); err != nil {
		return nil, err
	}
	return sb, nil
}

// imageKeep is how long an image nobody asked for stays in the cache.
const imageKeep = 12 * time.Hour

// debianKey is the digest of everything that goes into the image.
func (l *Lab) debianKey(root *DebianRoot, files, bins map[string]string) (string, error) {
	h := sha256.New()
	st, err := os.Stat(root.Tar)
	if err != nil {
		return "", err
	}
	// The tar is large and only ever replaced whole: its identity is enough.
	fmt.Fprintf(h, "tar %s %d %d\n%s\n%s\n%v\n%v\n", root.Tar, st.Size(), st.ModTime().UnixNano(),
		execUnit, l.cfg.ExecServer, quietUnits, debianExtra)
	hashFile := func(p string) error {
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		fmt.Fprintf(h, "file %s\n", p)
		_, err = io.Copy(h, f)
		return err
	}
	if err := hashFile(root.Deb); err != nil {
		return "", err
	}
	for _, g := range sortedKeys(bins) {
		fmt.Fprintf(h, "binary %s\n", g)
		if err := hashFile(bins[g]); err != nil {
			return "", err
		}
	}
	for _, g := range sortedKeys(files) {
		fmt.Fprintf(h, "extra %s\n%s\n", g, files[g])
	}
	if root.UserData != "" {
		fmt.Fprintf(h, "user-data\n%s\n%v\n%v\n", root.UserData, cloudInitFiles, packageUnitLinks)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

func sortedKeys(m map[string]string) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// debianExtra is written into every image: the root on the virtio disk
// the guest boots from, no cloud-init (no datasource to look for), and no
// fixed host name (systemd.hostname= on the kernel command line names the
// guest).
var debianExtra = map[string]string{
	"/etc/fstab":                     "/dev/vda / ext4 defaults 0 1\n",
	"/etc/cloud/cloud-init.disabled": "",
}

// cloudInitFiles are written instead of cloud-init.disabled when the root
// has a seed: only the NoCloud seed on the root file system is looked for,
// and the network stays the one the lab sets up.
var cloudInitFiles = map[string]string{
	"/etc/cloud/cloud.cfg.d/90-vco-lab.cfg": "datasource_list: [ NoCloud, None ]\nnetwork: {config: disabled}\n",
	"/var/lib/cloud/seed/nocloud/meta-data": "instance-id: vco-lab-node\n",
}

// packageUnitLinks are the links the package's postinst made to enable the
// agent; with a seed they are removed, so the seed's runcmd enables it.
var packageUnitLinks = []string{
	"etc/systemd/system/multi-user.target.wants/vco-agent.service",
	"etc/systemd/system/sockets.target.wants/vco-agent.socket",
}

func (l *Lab) buildDebian(ctx context.Context, root *DebianRoot, files, bins map[string]string, tmp string) error {
	rootfs, out := filepath.Join(tmp, "root"), filepath.Join(tmp, "out")
	for _, d := range []string{rootfs, out} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	if err := installPackage(ctx, root, rootfs); err != nil {
		return err
	}
	if err := copyBins(rootfs, bins); err != nil {
		return err
	}
	if err := l.writeFiles(rootfs, root, files); err != nil {
		return err
	}
	units := filepath.Join(rootfs, "etc", "systemd", "system")
	if err := enableUnits(units, root); err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(rootfs, "etc", "hostname"))
	if err := copyBoot(rootfs, out); err != nil {
		return err
	}
	return runTool(ctx, "mke2fs", "-q", "-t", "ext4", "-d", rootfs, "-L", "vco-lab-root", filepath.Join(out, "root.img"), "3G")
}

// runTool runs a host tool for the image's build.
func runTool(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"}
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, b)
	}
	return nil
}

// installPackage unpacks root's tree into rootfs and installs root's
// package there.
func installPackage(ctx context.Context, root *DebianRoot, rootfs string) error {
	// Numeric owners: the guest's users, not the host's, own its files.
	if err := runTool(ctx, "tar", "--numeric-owner", "-C", rootfs, "-xf", root.Tar); err != nil {
		return err
	}
	if err := copyFile(root.Deb, filepath.Join(rootfs, "tmp", "vco-agent.deb"), 0o644); err != nil {
		return err
	}
	if err := runTool(ctx, "chroot", rootfs, "dpkg", "-i", "/tmp/vco-agent.deb"); err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(rootfs, "tmp", "vco-agent.deb"))
	return nil
}

// copyBins copies bins (guest path -> host file) into rootfs, each
// unless the package installed its own.
func copyBins(rootfs string, bins map[string]string) error {
	for _, g := range sortedKeys(bins) {
		dst := filepath.Join(rootfs, g)
		if _, err := os.Lstat(dst); err == nil {
			continue // the package's own (vco-agent): that is what is under test
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := copyFile(bins[g], dst, 0o755); err != nil {
			return err
		}
	}
	return nil
}

// writeFiles writes the lab's own files, cloud-init's with a seed in
// root, and files (guest path -> content) into rootfs.
func (l *Lab) writeFiles(rootfs string, root *DebianRoot, files map[string]string) error {
	exe := make([]string, len(l.cfg.ExecServer))
	for i, a := range l.cfg.ExecServer {
		exe[i] = "'" + a + "'"
	}
	written := map[string]string{
		"/etc/systemd/system/vco-lab-exec.service": fmt.Sprintf(execUnit, strings.Join(exe, " ")),
	}
	for g, c := range debianExtra {
		written[g] = c
	}
	if root.UserData != "" {
		delete(written, "/etc/cloud/cloud-init.disabled")
		for g, c := range cloudInitFiles {
			written[g] = c
		}
		written["/var/lib/cloud/seed/nocloud/user-data"] = root.UserData
		for _, u := range packageUnitLinks {
			if err := os.Remove(filepath.Join(rootfs, u)); err != nil {
				return fmt.Errorf("the package did not enable its unit as expected: %w", err)
			}
		}
	}
	for g, c := range files {
		written[g] = c
	}
	for _, g := range sortedKeys(written) {
		p := filepath.Join(rootfs, g)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(written[g]), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// enableUnits enables the lab's exec server in units and masks the units
// the lab does not want (cloud-init's kept with a seed in root).
func enableUnits(units string, root *DebianRoot) error {
	if err := os.Symlink("../vco-lab-exec.service", filepath.Join(units, "multi-user.target.wants", "vco-lab-exec.service")); err != nil {
		return err
	}
	for _, u := range quietUnits {
		if root.UserData != "" && strings.HasPrefix(u, "cloud-") {
			continue
		}
		p := filepath.Join(units, u)
		_ = os.Remove(p)
		if err := os.Symlink("/dev/null", p); err != nil {
			return err
		}
	}
	return nil
}

// copyBoot copies the root's kernel and initrd out of rootfs into out.
func copyBoot(rootfs, out string) error {
	for _, k := range []struct{ glob, dst string }{{"vmlinuz-*", "vmlinuz"}, {"initrd.img-*", "initrd.img"}} {
		m, _ := filepath.Glob(filepath.Join(rootfs, "boot", k.glob))
		if len(m) != 1 {
			return fmt.Errorf("the root has %d files /boot/%s, want 1", len(m), k.glob)
		}
		if err := copyFile(m[0], filepath.Join(out, k.dst), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// StartSystemGuests boots guests from sb and waits until systemd has
// finished booting each (systemctl is-system-running --wait): then the
// package's units have started or failed.
func (l *Lab) StartSystemGuests(ctx context.Context, sb *SystemBoot, cfgs ...GuestConfig) ([]*Guest, error) {
	for i := range cfgs {
		cfgs[i].System = sb
	}
	gs, err := l.StartGuests(ctx, cfgs...)
	if err != nil {
		return nil, err
	}
	for _, g := range gs {
		r, err := g.Sh(ctx, "systemctl is-system-running --wait")
		if err != nil {
			return nil, fmt.Errorf("guest %s: waiting for systemd: %w", g.Name, err)
		}
		if st := strings.TrimSpace(r.Stdout); st != "running" && st != "degraded" {
			return nil, fmt.Errorf("guest %s: systemd finished booting %q: %s", g.Name, st, r)
		}
	}
	return gs, nil
}
