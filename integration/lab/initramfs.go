package lab

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
)

// DefaultModules are the guest kernel modules the lab loads: the virtio
// transports and the SCSI stack for scsi-block/scsi-hd disks, virtio-blk,
// the virtio-serial console that carries the exec channel, device-mapper
// and dm-crypt with the XTS/AES pieces LUKS2 needs, and the filesystems the
// agent formats.
var DefaultModules = []string{
	"virtio_pci", "virtio_console", "virtio_scsi", "scsi_mod", "sd_mod", "sg",
	"virtio_blk", "dm_mod", "dm_crypt", "xts", "aesni_intel", "algif_skcipher",
	"ext4", "xfs", "loop",
}

// DefaultHostTools are dynamically linked host programs copied into the
// guest with their libraries: sg3-utils is the reference implementation
// the lab checks reservations against, cryptsetup the one for LUKS2, and
// the filesystem tools are what the agent runs on a node.
var DefaultHostTools = []string{
	"/usr/bin/sg_persist", "/usr/bin/sg_inq", "/usr/bin/sg_turs", "/usr/bin/sg_readcap",
	"/usr/sbin/cryptsetup", "/usr/sbin/dmsetup",
	"/usr/sbin/mkfs.ext4", "/usr/sbin/resize2fs", "/usr/sbin/mkfs.xfs", "/usr/sbin/xfs_growfs",
	"/usr/sbin/blkid", "/usr/sbin/wipefs",
}

// InitramfsSpec says what goes into a guest's initramfs.
type InitramfsSpec struct {
	Kernel *Kernel
	// Modules to load at boot, by name; dependencies are added.
	Modules []string
	// Binaries maps a guest path to a static host binary copied there.
	// One of them must be the exec server named by ExecServer.
	Binaries map[string]string
	// ExecServer is the guest command line that serves the exec channel,
	// e.g. ["/bin/vco-lab", "guest-exec"]. init execs it as PID 1.
	ExecServer []string
	// HostTools are dynamically linked host programs copied to the same
	// path in the guest together with the shared libraries ldd lists.
	HostTools []string
}

// BuildInitramfs writes an uncompressed newc cpio archive to out.
func BuildInitramfs(ctx context.Context, spec InitramfsSpec, out string) error {
	if len(spec.ExecServer) == 0 {
		return fmt.Errorf("initramfs: no exec server command given")
	}
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("initramfs: busybox not found (install busybox-static): %w", err)
	}
	if err := requireStatic(busybox); err != nil {
		return err
	}
	mods, err := spec.Kernel.ModuleFiles(ctx, spec.Modules)
	if err != nil {
		return err
	}

	var buf bytes.Buffer
	w := newCpioWriter(&buf)
	for _, d := range []string{"proc", "sys", "dev", "run", "tmp", "mnt", "root", "etc", "var/lib", "usr/bin", "usr/sbin", "sbin"} {
		w.Dir(d, 0o755)
	}
	if err := addHostFile(w, "bin/busybox", busybox); err != nil {
		return err
	}
	w.Symlink("bin/sh", "busybox")

	if err := addModules(w, spec.Kernel.Root, mods); err != nil {
		return err
	}
	if err := addBinaries(ctx, w, spec); err != nil {
		return err
	}
	w.File("init", 0o755, []byte(initScript(spec.ExecServer)))
	if err := w.Close(); err != nil {
		return err
	}
	tmp := out + ".tmp"
	if err := os.WriteFile(tmp, buf.Bytes(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// addModules adds the kernel modules mods (files under the kernel tree
// root) and the list init loads them in.
func addModules(w *cpioWriter, root string, mods []string) error {
	var order strings.Builder
	for _, m := range mods {
		rel, err := filepath.Rel(root, m)
		if err != nil || strings.HasPrefix(rel, "..") {
			return fmt.Errorf("initramfs: module %s is outside the kernel tree %s", m, root)
		}
		if err := addHostFile(w, rel, m); err != nil {
			return err
		}
		fmt.Fprintf(&order, "/%s\n", rel)
	}
	w.File("etc/vco-lab/modules", 0o644, []byte(order.String()))
	return nil
}

// addBinaries adds the spec's static binaries and its host tools with the
// shared libraries they need.
func addBinaries(ctx context.Context, w *cpioWriter, spec InitramfsSpec) error {
	for guest, host := range spec.Binaries {
		if err := requireStatic(host); err != nil {
			return err
		}
		if err := addHostFile(w, guest, host); err != nil {
			return err
		}
	}
	libs := map[string]bool{}
	for _, tool := range spec.HostTools {
		deps, err := sharedLibs(ctx, tool)
		if err != nil {
			return err
		}
		if err := addHostFile(w, tool, tool); err != nil {
			return err
		}
		for _, l := range deps {
			if !libs[l] {
				libs[l] = true
				if err := addHostFile(w, l, l); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// initScript is the guest's PID 1 until it execs the exec server. Module
// load failures are logged, not fatal: a module the CPU cannot use (an
// accelerated cipher under TCG, say) must not stop the guest.
func initScript(server []string) string {
	q := make([]string, len(server))
	for i, a := range server {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return `#!/bin/sh
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /run
# Host tools keep their host paths; a checkout under /tmp brings its tools
# there, and a fresh tmpfs would hide them (the initramfs is writable).
[ -n "$(ls -A /tmp 2>/dev/null)" ] || mount -t tmpfs tmpfs /tmp
mkdir -p /dev/pts /run/lock
mount -t devpts devpts /dev/pts
while read -r m; do
	insmod "$m" >>/run/insmod.log 2>&1 || echo "insmod $m failed" >>/run/insmod.log
done </etc/vco-lab/modules
for a in $(cat /proc/cmdline); do
	case "$a" in vco.node=*) hostname "${a#vco.node=}" ;; esac
done
echo "vco-lab guest $(hostname) up" >/dev/kmsg
exec ` + strings.Join(q, " ") + "\n"
}

func addHostFile(w *cpioWriter, guest, host string) error {
	data, err := os.ReadFile(host)
	if err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	st, err := os.Stat(host)
	if err != nil {
		return err
	}
	w.File(guest, uint32(st.Mode().Perm()), data)
	return nil
}

// requireStatic refuses a dynamically linked binary for a slot that needs
// a static one: the guest has only the libraries HostTools bring.
func requireStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("initramfs: %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("initramfs: %s is dynamically linked; build it with CGO_ENABLED=0 (make build)", path)
		}
	}
	return nil
}

var lddLineRe = regexp.MustCompile(`(?:=>\s*)?(/\S+)\s+\(0x`)

// sharedLibs lists the absolute paths of the libraries ldd reports.
func sharedLibs(ctx context.Context, bin string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "ldd", bin).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w\n%s", bin, err, out)
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if m := lddLineRe.FindStringSubmatch(sc.Text()); m != nil {
			libs = append(libs, m[1])
		}
	}
	return libs, nil
}
