package volume

import (
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestStageGrowsARestoredFilesystemToItsLargerDisk: a volume whose disk
// is larger than its filesystem (a restore of a snapshot into a larger
// claim, here a disk grown while not staged) is staged with its filesystem
// grown to fill the disk, its files kept; a stage of a volume that fills
// its disk grows nothing, nor does a read-only one. ext4 is grown both
// ways: unmounted, as an agent without CAP_SYS_RESOURCE does, and online
// where this process has that capability.
func TestStageGrowsARestoredFilesystemToItsLargerDisk(t *testing.T) {
	for _, tc := range []struct {
		name, fs  string
		from, to  int64 // MiB
		unmounted bool
		mkfs      []string // made before the first stage, when given
	}{
		{"ext4 unmounted", "ext4", 64, 128, true, nil},
		{"ext4 unmounted, tail", "ext4", 1024, 1153, true, nil},
		{"ext4 online", "ext4", 64, 128, false, nil},
		{"xfs", "xfs", 320, 640, false, nil},
		// resize2fs does not grow a bigalloc ext4 unmounted: mounted
		// as it is, and said.
		{"ext4 bigalloc unmounted", "ext4", 64, 128, true, []string{"-O", "bigalloc", "-C", "16384"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fs == "ext4" && !tc.unmounted && !CanGrowExt4Online() {
				t.Skip("online ext4 growth needs CAP_SYS_RESOURCE, which this process lacks")
			}
			if tc.unmounted {
				growsExt4Online = func() bool { return false }
				t.Cleanup(func() { growsExt4Online = CanGrowExt4Online })
			}
			stageGrowsFilesystem(t, tc.fs, tc.from, tc.to, tc.mkfs)
		})
	}
}

// growCase is one volume of TestStageGrowsARestoredFilesystemToItsLargerDisk:
// its disk img on the loop device dev, staged by req.
type growCase struct {
	t        *testing.T
	e        *env
	ctx      context.Context
	img, dev string
	req      StageRequest
}

func stageGrowsFilesystem(t *testing.T, fs string, from, to int64, mkfs []string) {
	g := &growCase{t: t, e: newEnv(t), ctx: context.Background()}
	g.img, g.dev = loop(t, from)
	if mkfs != nil {
		if out, err := exec.Command("mkfs."+fs, append(append([]string{"-q", "-F"}, mkfs...), g.dev)...).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.%s %v: %v %s", fs, mkfs, err, out)
		}
	}
	g.req = g.e.stageReq("vol-r", g.img, "r")
	g.req.FsType = fs
	made := g.stageUnstage(true)
	g.same("a filesystem that fills its disk", made, 0)
	g.growDisk(to)
	g.req.ReadOnly = true
	g.same("a read-only stage", made, 0)
	g.req.ReadOnly, g.req.MountFlags = false, []string{"ro"}
	g.same("a stage mounted with the flag ro", made, 0)
	g.req.MountFlags = nil
	if mkfs != nil {
		g.same("a bigalloc ext4 without CAP_SYS_RESOURCE", made, 0)
		if !strings.Contains(g.e.logs.String(), "bigalloc") {
			t.Fatalf("a bigalloc ext4 left as it is without saying why:\n%s", g.e.logs)
		}
		return
	}
	grown := g.stageUnstage(false)
	if grown-made < (to-from)<<20*3/4 || grew(g.e) != 1 {
		t.Fatalf("staged on a disk grown from %d to %d MiB: the filesystem %d -> %d bytes, grown %d times\n%s", from, to, made, grown, grew(g.e), g.e.logs)
	}
	// Grown once: what the grower leaves unused is not grown for again.
	g.same("staged again", grown, 1)
	if out, err := exec.Command("fsck", "-n", "-f", g.dev).CombinedOutput(); fs == "ext4" && err != nil {
		t.Fatalf("the grown filesystem does not check clean: %v\n%s", err, out)
	}
}

// stageUnstage stages the volume, writes its file "kept" (write) or checks
// it is there, and unstages it; it returns the filesystem's size.
func (g *growCase) stageUnstage(write bool) int64 {
	t, req := g.t, g.req
	t.Helper()
	if _, err := g.e.m.Stage(g.ctx, req); err != nil {
		t.Fatal(err)
	}
	kept := filepath.Join(req.StagingPath, "kept")
	if write {
		if err := os.WriteFile(kept, []byte("kept"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if b, err := os.ReadFile(kept); err != nil || string(b) != "kept" {
		t.Fatalf("the volume's file: %q %v", b, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(req.StagingPath, &st); err != nil {
		t.Fatal(err)
	}
	if err := g.e.m.Unstage(g.ctx, "vol-r", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks) * st.Bsize
}

// same stages and unstages the volume once more (what): its filesystem
// must still be size bytes, and the stages so far must have grown it
// times times.
func (g *growCase) same(what string, size int64, times int) {
	g.t.Helper()
	if got := g.stageUnstage(false); got != size || grew(g.e) != times {
		g.t.Fatalf("%s: %d -> %d bytes, grown %d times, want %d\n%s", what, size, got, grew(g.e), times, g.e.logs)
	}
}

// growDisk grows the disk to mib MiB, as a restore into a larger claim
// or a disk grown while not staged leaves it.
func (g *growCase) growDisk(mib int64) {
	g.t.Helper()
	if err := os.Truncate(g.img, mib<<20); err != nil {
		g.t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", g.dev).CombinedOutput(); err != nil {
		g.t.Fatalf("losetup -c: %v %s", err, out)
	}
}

// grew counts the stages that grew a filesystem.
func grew(e *env) int {
	return strings.Count(e.logs.String(), "grew the filesystem to fill its device")
}

// TestSuperblockOfNoSizeIsAnError: a superblock whose block size is out of
// range is an error, not a division by zero that stops the agent.
func TestSuperblockOfNoSizeIsAnError(t *testing.T) {
	ext := make([]byte, 1024)
	binary.LittleEndian.PutUint16(ext[0x38:], 0xef53)
	binary.LittleEndian.PutUint32(ext[0x20:], 8192)
	for _, log := range []uint32{7, 54, 60, 1 << 31} {
		binary.LittleEndian.PutUint32(ext[0x18:], log)
		if e, err := ext4Extent(ext); err == nil {
			t.Errorf("ext4 with a log block size of %d: %+v", log, e)
		}
	}
	binary.LittleEndian.PutUint32(ext[0x18:], 2)
	binary.LittleEndian.PutUint32(ext[0x20:], 0)
	if e, err := ext4Extent(ext); err == nil {
		t.Errorf("ext4 with no blocks per group: %+v", e)
	}
	xfs := make([]byte, 512)
	copy(xfs, "XFSB")
	for _, bs := range []uint32{0, 256, 4097, 131072} {
		binary.BigEndian.PutUint32(xfs[4:], bs)
		if e, err := xfsExtent(xfs); err == nil {
			t.Errorf("xfs with a block size of %d: %+v", bs, e)
		}
	}
}

func TestSuperblockExtents(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		fs  string
		mib int64
	}{{"ext4", 64}, {"ext4", 1024}, {"xfs", 320}} {
		img := filepath.Join(t.TempDir(), "fs.img")
		if err := os.WriteFile(img, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, tc.mib<<20); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("mkfs."+tc.fs, "-q", img).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.%s: %v %s", tc.fs, err, out)
		}
		e, err := readExtent(img, tc.fs)
		if err != nil || e.size != tc.mib<<20 || e.slack <= 0 || e.slack > 8<<20 {
			t.Errorf("%s of %d MiB: %+v %v", tc.fs, tc.mib, e, err)
		}
		other := map[string]string{"ext4": "xfs", "xfs": "ext4"}[tc.fs]
		if _, err := readExtent(img, other); err == nil {
			t.Errorf("%s read as %s", tc.fs, other)
		}
	}
}
