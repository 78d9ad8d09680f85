package main

// Directed reproduction, nineteenth adversarial round, of the lease
// commands' own in-use proof (leaseOptions.notInUse). It needs root to make
// a block device node (mknod) in a temporary directory and skips cleanly
// without it; the sysfs it reads is a fake tree laid out as the kernel's,
// and the device numbers are in the experimental range (240-254), which no
// mount of this host has.

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// `vco-agent lease release`, `acquire` and `clear` refuse a disk this node
// uses (notInUse), but read only the disk's own holders and mounts: a
// device stacked on a partition of the disk (lvm2's autoactivation of a
// PV a raw block volume's pod put there, a dm-crypt or md of an
// operator), listed by the kernel under /sys/class/block/vdb1/holders, is
// not seen, and clear zeroes (release and acquire give up) the lease of a
// disk this node still maps (P1). Control: the same holder on the disk
// itself is refused.
func TestAdv19LeaseCommandsMissAHolderStackedOnAPartitionOfTheDisk(t *testing.T) {
	dir := t.TempDir()
	disk := filepath.Join(dir, "vdb")
	if err := unix.Mknod(disk, unix.S_IFBLK|0o600, int(unix.Mkdev(242, 16))); err != nil {
		t.Skipf("cannot make a block device node (needs root): %v", err)
	}
	for _, dn := range []string{"242:16", "242:17"} {
		if at, err := inuse.Mounted(dn); err != nil || at != "" {
			t.Skipf("device %s is mounted on this host (%q, %v)", dn, at, err)
		}
	}
	sys := filepath.Join(dir, "sys")
	d := filepath.Join(sys, "devices", "virtual", "block", "vdb")
	part := filepath.Join(d, "vdb1")
	for _, p := range []string{filepath.Join(d, "holders"), filepath.Join(part, "holders"), filepath.Join(sys, "class", "block"), filepath.Join(sys, "block")} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for f, v := range map[string]string{"partition": "1\n", "dev": "242:17\n", "start": "2048\n"} {
		if err := os.WriteFile(filepath.Join(part, f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for link, to := range map[string]string{
		filepath.Join(sys, "class", "block", "vdb"):  "../../devices/virtual/block/vdb",
		filepath.Join(sys, "class", "block", "vdb1"): "../../devices/virtual/block/vdb/vdb1",
		filepath.Join(sys, "block", "vdb"):           "../devices/virtual/block/vdb",
	} {
		if err := os.Symlink(to, link); err != nil {
			t.Fatal(err)
		}
	}
	o := &leaseOptions{sysfsRoot: sys, stateDir: t.TempDir()}

	// Control: dm-3 on the disk itself is refused.
	if err := os.Mkdir(filepath.Join(d, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := o.notInUse(disk); err == nil || !strings.Contains(err.Error(), "dm-3") {
		t.Fatalf("control: dm-3 stacked on the disk: notInUse = %v, want a refusal naming dm-3", err)
	}
	if err := os.Remove(filepath.Join(d, "holders", "dm-3")); err != nil {
		t.Fatal(err)
	}
	if err := o.notInUse(disk); err != nil {
		t.Fatalf("control: nothing stacked: notInUse = %v, want nil", err)
	}

	// dm-3 on the disk's partition vdb1.
	if err := os.Mkdir(filepath.Join(part, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := o.notInUse(disk); err == nil || !strings.Contains(err.Error(), "dm-3") {
		t.Fatalf("dm-3 is stacked on vdb1, a partition of the disk, and notInUse = %v: the lease commands would give up (clear: zero) the lease of a disk this node maps", err)
	}
}
