package fencecaps

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
)

func mk(t *testing.T, root string, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDetectSCSIDisks(t *testing.T) {
	root := t.TempDir()
	mk(t, root, "class/block/sdb/device/scsi_device/2:0:0:1", "class/block/sda/device/scsi_device/2:0:0:0",
		"class/block/sda1/device/scsi_device/x", "class/block/vda/device", "class/block/loop0")
	if err := os.WriteFile(filepath.Join(root, "class/block/sda1/partition"), []byte("1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	caps := Detect(root)
	if caps[0].Method != fence.MethodPR || !caps[0].Available || caps[0].Detail != "SG_IO-capable SCSI disks: sda, sdb" {
		t.Fatalf("got %+v", caps[0])
	}
	if caps[1].Method != fence.MethodLease || !caps[1].Available || !strings.Contains(caps[1].Detail, "not enforced by the storage") {
		t.Fatalf("lease reported as %+v", caps[1])
	}
}

func TestDetectNoSCSI(t *testing.T) {
	root := t.TempDir()
	mk(t, root, "class/block/vda/device", "class/block/loop0")
	c := Detect(root)[0]
	if c.Available || !strings.Contains(c.Detail, "no SCSI disks") {
		t.Fatalf("got %+v", c)
	}
	c = Detect(filepath.Join(root, "absent"))[0]
	if c.Available || !strings.Contains(c.Detail, "cannot list block devices") {
		t.Fatalf("got %+v", c)
	}
}
