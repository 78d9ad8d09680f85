package inuse

// Directed reproductions, twentieth adversarial round, of the release
// guard's proof over the disk (Disk). Same harness as adv19_test.go: a
// block device node made with mknod (root, else skipped) and a fake sysfs
// laid out as the kernel's, device numbers in the experimental range.

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// A disk whose device node is not named as its sysfs directory: the
// kernel names some disks with a '/' (AoE's "etherd/e0.0", sx8's "sx8/0",
// cciss's "cciss/c0d0"), which sysfs spells with a '!' ("etherd!e0.0")
// and whose node is /dev/etherd/e0.0; the agent's discovery names such a
// disk by its uevent DEVNAME (fence/discovery devName), so dev.Path, the
// claim's Device, and the path an operator gives `vco-agent lease clear`
// are /dev/etherd/e0.0. Disk takes the node's base name ("e0.0") for the
// sysfs name: class/block/e0.0 does not exist, which it reads as "no
// partitions" and "no holders", so a dm-crypt, md or lvm device stacked
// on the disk (or anything on its partitions) is not seen, and the proof
// says nothing of the volume is in use (P1: the fence is given up, or the
// lease area cleared, under a live mapping of this node). Control: the
// same disk, its node named as sysfs names it, is found in use.
func TestAdv20ReleaseGuardMissesAHolderOfADiskWhoseNodeIsNotItsSysfsName(t *testing.T) {
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")
	const kname = "etherd!e0.0"
	unmounted(t, "242:48")
	d := fakeDisk(t, sys, kname)
	if err := os.WriteFile(filepath.Join(d, "dev"), []byte("242:48\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "uevent"), []byte("MAJOR=242\nMINOR=48\nDEVNAME=etherd/e0.0\nDEVTYPE=disk\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(d, "holders", "dm-3"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Control: the node named as sysfs names the disk.
	same := blockNode(t, dir, kname, 242, 48)
	if err := Disk(sys, same); !errors.As(err, new(*Error)) {
		t.Fatalf("control: dm-3 stacked on %s: Disk = %v, want an in-use error", same, err)
	}
	// The node as the kernel's DEVNAME (and so discovery) names it.
	if err := os.Mkdir(filepath.Join(dir, "etherd"), 0o755); err != nil {
		t.Fatal(err)
	}
	node := blockNode(t, filepath.Join(dir, "etherd"), "e0.0", 242, 48)
	if err := Disk(sys, node); !errors.As(err, new(*Error)) {
		t.Fatalf("dm-3 is stacked on the disk 242:48, and Disk(%s) proved it unused (err %v): it looked for class/block/%s, not the disk's sysfs directory %s; the release guard gives the fence up under a live mapping",
			node, err, filepath.Base(node), kname)
	}
}
