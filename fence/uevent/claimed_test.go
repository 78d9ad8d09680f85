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

// A symlink planted where a claim mark goes is not followed: the mark
// fails, and neither a file it names is created nor an existing one opened.
func TestClaimMarkDoesNotFollowSymlinks(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "claimed")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	absent := filepath.Join(base, "created-through-link")
	if err := os.Symlink(absent, filepath.Join(dir, "vdb")); err != nil {
		t.Fatal(err)
	}
	if err := MarkClaimed(dir, "vdb"); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("marking through a dangling symlink: %v, want a refusal naming the symlink", err)
	}
	if _, err := os.Lstat(absent); !os.IsNotExist(err) {
		t.Errorf("the symlink's target was created: %v", err)
	}

	existing := filepath.Join(base, "config")
	if err := os.WriteFile(existing, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(existing, filepath.Join(dir, "vdc")); err != nil {
		t.Fatal(err)
	}
	if err := MarkClaimed(dir, "vdc"); err == nil {
		t.Error("marking through a symlink to an existing file succeeded")
	}
	if b, err := os.ReadFile(existing); err != nil || string(b) != "keep" {
		t.Errorf("the symlink's target changed: %q, %v", b, err)
	}
	if st, err := os.Stat(existing); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("the symlink's target's mode changed: %v, %v", st.Mode(), err)
	}
}
