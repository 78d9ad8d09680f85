package volume

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// A filesystem made on a data mapping (the loop device past the lease
// area) is made without discarding the device first: the loop driver turns
// the discard into a write of zeroes over the whole disk, the 14-16 s of a
// lease volume's first stage in the lab. On the disk itself mkfs keeps its
// defaults (mount-utils' options). mkfs is replaced by a recorder here; the
// host tests and the lab make real filesystems both ways.
func TestMakeFSDiscardsOnlyOffAMapping(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	proof, err := blank.Prove(context.Background(), img)
	if err != nil {
		t.Skipf("cannot prove a zero file blank here (blkid?): %v", err)
	}
	bin := filepath.Join(dir, "bin")
	os.Mkdir(bin, 0o755)
	for _, fs := range []string{"ext4", "xfs"} {
		script := "#!/bin/sh\necho \"$@\" >" + filepath.Join(dir, "mkfs."+fs+".args") + "\n"
		if err := os.WriteFile(filepath.Join(bin, "mkfs."+fs), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	const id = "0b0e1d2c-3f4a-4b5c-8d6e-7f8091a2b3c4"
	for _, c := range []struct {
		fs        string
		onMapping bool
		want      string
	}{
		{"ext4", false, "-F -m0 -U " + id + " " + img},
		{"ext4", true, "-F -m0 -U " + id + " -E nodiscard " + img},
		{"xfs", false, "-f -m uuid=" + id + " " + img},
		{"xfs", true, "-f -m uuid=" + id + " -K " + img},
	} {
		if err := makeFS(context.Background(), proof, c.fs, c.onMapping, id); err != nil {
			t.Fatalf("%s (on a mapping: %v): %v", c.fs, c.onMapping, err)
		}
		got, err := os.ReadFile(filepath.Join(dir, "mkfs."+c.fs+".args"))
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(string(got)) != c.want {
			t.Errorf("mkfs.%s (on a mapping: %v) ran with %q, want %q", c.fs, c.onMapping, strings.TrimSpace(string(got)), c.want)
		}
	}
}
