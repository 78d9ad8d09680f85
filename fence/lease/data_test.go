package lease

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func blockSize(t *testing.T, dev string) int64 {
	t.Helper()
	d, err := OpenDevice(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	return d.Size()
}

func sh(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return string(out)
}

// The data area, mapped with a loop device at DataOffset, carries an
// ordinary filesystem that never touches the lease, is invisible on the
// raw disk, grows online with the disk, and is found again after a
// restart.
func TestDataArea(t *testing.T) {
	ctx := context.Background()
	disk := loopDevice(t, 320<<20, 512, nil) // sparse; XFS wants 300 MB
	img := strings.TrimSpace(sh(t, "losetup", "-n", "-O", "BACK-FILE", disk))
	d := openDev(t, disk)
	if _, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second}); err != nil {
		t.Fatal(err)
	}
	a := newNode(t, disk, uuidA, "node-a")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}

	data, err := MapData(disk)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			data.Close()
		}
		exec.Command("losetup", "-d", data.Path).Run()
	})
	if got, want := blockSize(t, data.Path), int64(320<<20-DataOffset); got != want {
		t.Fatalf("data area is %d bytes, want %d", got, want)
	}
	mnt := checkFilesystemBesideTheLease(t, a, disk, data)
	checkOnlineGrowth(t, a, img, disk, data, mnt)

	// Autoclear: once unmounted and closed, the mapping goes away.
	sh(t, "umount", mnt)
	data.Close()
	closed = true
	waitMappingGone(t, disk)
}

// checkFilesystemBesideTheLease makes a filesystem on the data area: the
// raw disk shows none and the lease still checks. It mounts it, writes a
// file and finds the mapping again from the disk; it returns the mount
// point.
func checkFilesystemBesideTheLease(t *testing.T, a *node, disk string, data *Data) string {
	t.Helper()
	sh(t, "mkfs.xfs", "-q", "-f", data.Path)
	if out := sh(t, "blkid", "-p", "-o", "value", "-s", "TYPE", data.Path); strings.TrimSpace(out) != "xfs" {
		t.Fatalf("blkid on the data area: %q", out)
	}
	if out, err := exec.Command("blkid", "-p", disk).CombinedOutput(); err == nil {
		t.Fatalf("the raw lease disk shows a filesystem: %s", out)
	}
	if err := a.e.Check(context.Background()); err != nil {
		t.Fatalf("lease after mkfs on the data area: %v", err)
	}

	mnt := t.TempDir()
	sh(t, "mount", data.Path, mnt)
	t.Cleanup(func() { exec.Command("umount", mnt).Run() })
	if err := os.WriteFile(filepath.Join(mnt, "f"), []byte("volume data"), 0o644); err != nil {
		t.Fatal(err)
	}
	if found, err := FindData("/sys", disk); err != nil || found != data.Path {
		t.Fatalf("FindData: %q %v, want %s", found, err, data.Path)
	}
	return mnt
}

// checkOnlineGrowth: the disk grows, then the mapping, then the
// filesystem, with its data and the lease intact.
func checkOnlineGrowth(t *testing.T, a *node, img, disk string, data *Data, mnt string) {
	t.Helper()
	var before unix.Statfs_t
	if err := unix.Statfs(mnt, &before); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 448<<20); err != nil {
		t.Fatal(err)
	}
	sh(t, "losetup", "-c", disk)
	if err := data.Resize(); err != nil {
		t.Fatal(err)
	}
	if got, want := blockSize(t, data.Path), int64(448<<20-DataOffset); got != want {
		t.Fatalf("data area after growth is %d bytes, want %d", got, want)
	}
	// XFS grows online with CAP_SYS_ADMIN alone; ext4's online resize
	// also needs CAP_SYS_RESOURCE, which test sandboxes often drop.
	sh(t, "xfs_growfs", mnt)
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	if grown := (st.Blocks - before.Blocks) * uint64(st.Bsize); grown < 120<<20 {
		t.Fatalf("filesystem grew by %d bytes online; the disk grew by 128 MiB", grown)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil || string(b) != "volume data" {
		t.Fatalf("data after growth: %q %v", b, err)
	}
	if err := a.e.Check(context.Background()); err != nil {
		t.Fatalf("lease after growth: %v", err)
	}
}

// waitMappingGone waits up to five seconds for the disk's data mapping to
// go away.
func waitMappingGone(t *testing.T, disk string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		found, _ := FindData("/sys", disk)
		if found == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("mapping %s still there after its last user left", found)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
