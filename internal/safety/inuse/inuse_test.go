package inuse

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestDiskNamesWhatUsesAPartition: a partition of the disk mounted, and a
// loop device over the partition, are named as its partition's.
func TestDiskNamesWhatUsesAPartition(t *testing.T) {
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")
	disk := blockNode(t, dir, "vdd", 243, 48)
	part := blockNode(t, dir, "vdd1", 243, 49)
	unmounted(t, "243:48")
	unmounted(t, "243:49")
	d := fakeDisk(t, sys, "vdd")
	p := filepath.Join(d, "vdd1")
	if err := os.MkdirAll(filepath.Join(p, "holders"), 0o755); err != nil {
		t.Fatal(err)
	}
	for f, v := range map[string]string{"partition": "1\n", "dev": "243:49\n"} {
		if err := os.WriteFile(filepath.Join(p, f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := Disk(sys, disk); err != nil {
		t.Fatalf("nothing uses vdd or vdd1: %v", err)
	}
	loop := filepath.Join(sys, "devices", "virtual", "block", "loop7")
	if err := os.MkdirAll(filepath.Join(loop, "loop"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..", "devices", "virtual", "block", "loop7"), filepath.Join(sys, "block", "loop7")); err != nil {
		t.Fatal(err)
	}
	for f, v := range map[string]string{"backing_file": part + "\n", "offset": "0\n"} {
		if err := os.WriteFile(filepath.Join(loop, "loop", f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	err := Disk(sys, disk)
	var ie *Error
	if !errors.As(err, &ie) || ie.What != "its partition vdd1: /dev/loop7 maps it at offset 0" {
		t.Fatalf("loop7 over vdd1: %v", err)
	}
	// A loop device whose backing node is gone is asked what it maps: a
	// device that left (its read fails) does not count, a live one does,
	// and one that cannot be asked leaves the proof unmade.
	if err := os.WriteFile(filepath.Join(loop, "loop", "backing_file"), []byte(part+" (deleted)\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	defer func(d func(string) (uint64, error), l func(string) bool) { loopDevice, loopLive = d, l }(loopDevice, loopLive)
	live := false
	loopDevice = func(name string) (uint64, error) {
		if name != "loop7" {
			return 0, errors.New("not this test's")
		}
		return unix.Mkdev(243, 49), nil
	}
	loopLive = func(name string) bool { return name == "loop7" && live }
	if err := Disk(sys, disk); err != nil {
		t.Fatalf("a loop device over a device that left: %v, want nothing in use", err)
	}
	live = true
	if err := Disk(sys, disk); !errors.As(err, &ie) || ie.What != "its partition vdd1: /dev/loop7 maps it at offset 0" {
		t.Fatalf("a loop device over vdd1 through a removed node: %v", err)
	}
	loopDevice = func(string) (uint64, error) { return 0, errors.New("no such device") }
	if err := Disk(sys, disk); err == nil || errors.As(err, &ie) || !strings.Contains(err.Error(), "cannot be told") {
		t.Fatalf("a loop device that cannot be asked: %v, want the proof unmade", err)
	}
}
