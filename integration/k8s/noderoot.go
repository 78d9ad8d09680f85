package k8s

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// NodePackages are what a worker needs beside the lab's Debian root: the
// container runtime the kubelet talks to, its OCI runtime, the CNI
// plugins for pod networks and iptables for their masquerading and the
// cluster service address (Debian 12's own packages), and xfsprogs, which
// the vco-agent package recommends for xfs volumes (the image installs the
// .deb with dpkg, which installs no recommends; the storage suite's xfs
// patterns failed without it).
var NodePackages = []string{"containerd", "runc", "containernetworking-plugins", "iptables", "iproute2", "xfsprogs"}

// NodeRoot returns the worker root: base's root file system with
// NodePackages installed by apt in a chroot (from the mirror the root's
// sources.list names), kept beside base's tar as bookworm-k8s-node.tar.
// Its package stays base's: the vco-agent .deb goes in when the image is
// made (lab.DebianImageWith).
func NodeRoot(ctx context.Context, base *lab.DebianRoot, log io.Writer) (*lab.DebianRoot, error) {
	st, err := os.Stat(base.Tar)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(base.Tar)
	out := filepath.Join(dir, "bookworm-k8s-node.tar")
	stamp := fmt.Sprintf("%s %d %d\n%s\n", base.Tar, st.Size(), st.ModTime().UnixNano(), strings.Join(NodePackages, " "))
	if b, err := os.ReadFile(out + ".inputs"); err == nil && string(b) == stamp {
		if _, err := os.Stat(out); err == nil {
			return &lab.DebianRoot{Tar: out, Deb: base.Deb}, nil
		}
	}
	unlock, err := lab.LockFile(filepath.Join(dir, ".bookworm-k8s-node.lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()
	if b, err := os.ReadFile(out + ".inputs"); err == nil && string(b) == stamp {
		return &lab.DebianRoot{Tar: out, Deb: base.Deb}, nil
	}
	fmt.Fprintf(log, "k8s: making the worker root (%s from Debian's mirror, in a chroot of %s), about a minute\n",
		strings.Join(NodePackages, ", "), base.Tar)
	start := time.Now()
	work, err := os.MkdirTemp(dir, ".k8s-node-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	root := filepath.Join(work, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, err
	}
	run := func(name string, args ...string) error {
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive"}
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, lab.LastLines(string(b), 30))
		}
		return nil
	}
	if err := run("tar", "--numeric-owner", "-C", root, "-xf", base.Tar); err != nil {
		return nil, err
	}
	resolv, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		return nil, err
	}
	rc := filepath.Join(root, "etc", "resolv.conf")
	_ = os.Remove(rc)
	if err := os.WriteFile(rc, resolv, 0o644); err != nil {
		return nil, err
	}
	// /proc is mounted in a mount namespace of the script's own, so it
	// goes away with it whatever happens.
	script := fmt.Sprintf(`set -e
mount -t proc proc %[1]s/proc
chroot %[1]s apt-get update -q
chroot %[1]s apt-get install -y -q --no-install-recommends %[2]s
chroot %[1]s apt-get clean
rm -rf %[1]s/var/lib/apt/lists/*
umount %[1]s/proc`, root, strings.Join(NodePackages, " "))
	if err := run("unshare", "--mount", "--propagation", "private", "sh", "-c", script); err != nil {
		return nil, fmt.Errorf("installing the worker packages: %w", err)
	}
	_ = os.Remove(rc)
	if err := run("tar", "--numeric-owner", "-C", root, "-cf", out+".tmp", "."); err != nil {
		return nil, err
	}
	if err := os.Rename(out+".tmp", out); err != nil {
		return nil, err
	}
	if err := os.WriteFile(out+".inputs", []byte(stamp), 0o644); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "k8s: worker root %s made in %s\n", out, time.Since(start).Round(time.Second))
	return &lab.DebianRoot{Tar: out, Deb: base.Deb}, nil
}

// GuestBusybox is where the workers' image carries the host's static
// busybox: the node plugin's image has no shell, so the check of what
// its container can read copies this into the plugin's own directory
// and runs it there with kubectl exec, as code that took over the plugin
// could.
const GuestBusybox = "/usr/local/lib/vco-lab/busybox"

// hostBusybox is the static busybox the lab's initramfs is made from.
func hostBusybox() (string, error) { return exec.LookPath("busybox") }
