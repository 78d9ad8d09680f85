package uevent

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestClaimMarks(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run", "claimed")
	if err := MarkClaimed(dir, "vdb"); err != nil {
		t.Fatal(err)
	}
	if err := MarkClaimed(dir, "vdb"); err != nil {
		t.Fatalf("marking twice: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "vdb")); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "..", "../etc", "a/b"} {
		if err := MarkClaimed(dir, bad); err == nil {
			t.Errorf("name %q accepted", bad)
		}
	}
	if err := ClearClaimed(dir, "vdb"); err != nil {
		t.Fatal(err)
	}
	if err := ClearClaimed(dir, "vdb"); err != nil {
		t.Fatalf("clearing twice: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "vdb")); !os.IsNotExist(err) {
		t.Fatalf("mark still there: %v", err)
	}
}

// Trigger makes the kernel re-send a change event for a real device.
func TestTriggerChange(t *testing.T) {
	needRoot(t)
	out, err := exec.Command("losetup", "--find", "--show", image(t, 4<<20)).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	name := filepath.Base(dev)
	c, err := Dial(GroupKernel)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := Trigger("/sys", "/devices/virtual/block/"+name, "change"); err != nil {
		t.Fatal(err)
	}
	ev := next(t, c, name, "change")
	if ev.DevPath != "/devices/virtual/block/"+name {
		t.Fatalf("event %+v", ev)
	}
	for _, bad := range [][2]string{{"/devices/../etc", "change"}, {"devices/x", "change"}, {"/devices/virtual/block/" + name, "explode"}} {
		if err := Trigger("/sys", bad[0], bad[1]); err == nil {
			t.Errorf("Trigger(%q, %q) accepted", bad[0], bad[1])
		}
	}
}
