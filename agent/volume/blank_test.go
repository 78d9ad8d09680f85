package volume

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// P5 on every path: the agent formats only a device it proves blank, and a
// disk carrying the lease area is staged past it whatever fences it. Real
// loop devices, mkfs, blkid and mounts; reservations through the model
// target (this host has no SCSI).

const keepsake = "written through the lease data area; must survive\n"

// leaseDiskWithFile makes dev a lease disk as a lease-fenced stage leaves
// it: the lease area written by the lease's own Format, an ext4
// filesystem from the data offset holding one file.
func leaseDiskWithFile(t *testing.T, dev string) {
	t.Helper()
	ld, err := lease.OpenDevice(dev)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := fence.KeyFromUUID(nodeB)
	if wrote, err := lease.Format(context.Background(), ld, lease.FormatOptions{Key: key}); err != nil || !wrote {
		t.Fatalf("lease format: %v %v", wrote, err)
	}
	ld.Close()
	withDataArea(t, dev, func(data string) {
		if out, err := exec.Command("mkfs.ext4", "-q", data).CombinedOutput(); err != nil {
			t.Fatalf("mkfs: %v: %s", err, out)
		}
		dir := t.TempDir()
		if out, err := exec.Command("mount", data, dir).CombinedOutput(); err != nil {
			t.Fatalf("mount: %v: %s", err, out)
		}
		werr := os.WriteFile(filepath.Join(dir, "keepsake"), []byte(keepsake), 0o644)
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Fatalf("umount: %v: %s", err, out)
		}
		if werr != nil {
			t.Fatal(werr)
		}
	})
}

// withDataArea runs f on a loop device over dev from the lease data offset.
func withDataArea(t *testing.T, dev string, f func(data string)) {
	t.Helper()
	out, err := exec.Command("losetup", "--find", "--show", "--offset", strconv.Itoa(lease.DataOffset), dev).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	data := strings.TrimSpace(string(out))
	defer exec.Command("losetup", "-d", data).Run()
	f(data)
}

func imageSum(t *testing.T, img string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func startsWithLease(t *testing.T, img string) bool {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 8)
	f.ReadAt(b, 0)
	return string(b) == "VCOLEASE"
}

func TestLeaseDiskIsStagedPastItsLeaseAreaOnEveryPath(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	paths := []struct {
		name string
		env  func(t *testing.T) *env
	}{
		// The disk shows up with reservations (another bus, a target that
		// gained PR): fenced by PR, never by the lease.
		{"reservations", func(t *testing.T) *env {
			e := newEnvWith(t, &modelFencing{tgt: scsitest.New(scsitest.Options{}), node: nodeA})
			e.cfg.AllowUnfenced = false
			e.start()
			return e
		}},
		// An agent without the lease stages it with the unfenced opt-in.
		{"unfenced opt-in", newEnv},
	}
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			e := p.env(t)
			e.crypt = &LUKS{} // for VolumeToken, which only reads
			e.start()
			img, dev := loop(t, 64)
			leaseDiskWithFile(t, dev)
			// What the node plugin reads before a stage is the data area too.
			tok, err := e.m.VolumeToken(ctx, "vol-l", Locator{BackingFile: img})
			if err != nil || tok.Device == dev || tok.Kind != ContentOther || !strings.Contains(tok.Detail, "ext") {
				t.Fatalf("the token read of a lease disk is not of its data area: %+v %v", tok, err)
			}
			res, err := e.m.Stage(ctx, e.stageReq("vol-l", img, "l"))
			if err != nil {
				t.Fatal(err)
			}
			if res.Formatted {
				t.Fatal("the stage formatted a disk carrying the lease area")
			}
			got, err := os.ReadFile(filepath.Join(e.staging("l"), "keepsake"))
			if err != nil || string(got) != keepsake {
				t.Fatalf("the file in the lease data area does not read back: %q %v", got, err)
			}
			if !startsWithLease(t, img) {
				t.Fatal("the lease header was overwritten")
			}
			if c, _ := e.m.Store().Get("vol-l"); c.DataOffset != lease.DataOffset || c.DataDevice == "" {
				t.Fatalf("the claim does not stage past the lease area: %+v", c)
			}
			if err := e.m.Unstage(ctx, "vol-l", e.staging("l")); err != nil {
				t.Fatal(err)
			}

			// A raw block volume of it is the data area, not the disk.
			req := e.stageReq("vol-b", img, "b")
			req.Block, req.FsType, req.StagingPath = true, "", e.blockStaging("b")
			res, err = e.m.Stage(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if res.Device == dev || blkid(t, res.Device, "TYPE") != "ext4" {
				t.Fatalf("raw block volume of a lease disk is %s (%q), not its data area", res.Device, blkid(t, res.Device, "TYPE"))
			}
		})
	}

	// A lease header this agent cannot read (another version): where the
	// data begins is unknown; refused with a sentence, nothing written.
	t.Run("unreadable lease header", func(t *testing.T) {
		e := newEnv(t)
		img, dev := loop(t, 64)
		leaseDiskWithFile(t, dev)
		f, err := os.OpenFile(img, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(lease.EncodeHeader(lease.Header{Version: 9, BlockSize: lease.BlockSize, Slots: lease.Slots, SlotOffset: lease.BlockSize, DataOffset: 2 << 20}), 0); err != nil {
			t.Fatal(err)
		}
		f.Close()
		before := imageSum(t, img)
		_, err = e.m.Stage(ctx, e.stageReq("vol-v", img, "v"))
		wantCode(t, err, codes.FailedPrecondition, "lease area", "neither formatted nor staged from byte 0")
		if imageSum(t, img) != before {
			t.Fatal("the disk changed")
		}
	})
}

// secondaryHeader is a LUKS2 secondary header (16 KiB at byte 16384 of a
// LUKS2 volume), cut from a real one.
func secondaryHeader(t *testing.T) []byte {
	t.Helper()
	img := filepath.Join(t.TempDir(), "luks.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	v, err := luks2.Format(img, luks2.FormatOptions{Passphrase: []byte("another volume's passphrase")})
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b[16<<10:], []byte("SKUL\xba\xbe")) {
		t.Fatal("no secondary header at 16 KiB")
	}
	return b[16<<10 : 32<<10]
}

func TestOnlyAProvenBlankDeviceIsFormatted(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	const size = 64 << 20
	pattern := bytes.Repeat([]byte("not blank "), 400)
	cases := []struct {
		name  string
		at    int64
		data  func(t *testing.T) []byte
		found string
	}{
		{"data only in the last MiB", size - 300<<10, func(*testing.T) []byte { return pattern }, "in the last MiB"},
		{"data only at the lease data offset", lease.DataOffset + 64<<10, func(*testing.T) []byte { return pattern }, "lease data offset"},
		{"a LUKS2 secondary header alone", 16 << 10, secondaryHeader, "LUKS"},
		// The secondary header of an encrypted volume that lived in a lease
		// disk's data area, its lease header and LUKS2 primary gone: blkid
		// probes the standard offsets from byte 0 only.
		{"a LUKS2 secondary header alone in the lease data area", lease.DataOffset + 16<<10, secondaryHeader, "lease data offset"},
	}
	paths := []struct {
		name string
		env  func(t *testing.T) *env
		req  func(e *env, img string) StageRequest
	}{
		{"filesystem", newEnv, func(e *env, img string) StageRequest { return e.stageReq("vol-1", img, "1") }},
		{"LUKS2", func(t *testing.T) *env {
			e := newEnvWith(t, nil)
			e.crypt = newHostLUKS(t)
			e.start()
			return e
		}, func(e *env, img string) StageRequest { return encReq(e, "vol-1", img, "1") }},
		{"lease", func(t *testing.T) *env { return fencedLeaseEnv(t, nodeA, "node-a") },
			func(e *env, img string) StageRequest { return e.stageReq("vol-1", img, "1") }},
	}
	for _, c := range cases {
		for _, p := range paths {
			t.Run(c.name+"/"+p.name, func(t *testing.T) {
				e := p.env(t)
				img, _ := loop(t, size>>20)
				f, err := os.OpenFile(img, os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := f.WriteAt(c.data(t), c.at); err != nil {
					t.Fatal(err)
				}
				f.Close()
				before := imageSum(t, img)
				res, err := e.m.Stage(ctx, p.req(e, img))
				if err == nil {
					t.Fatalf("staged (%+v) a disk that is not blank", res)
				}
				wantCode(t, err, codes.FailedPrecondition)
				if !strings.Contains(err.Error(), c.found) && !strings.Contains(err.Error(), "offers no fencing") {
					t.Fatalf("the refusal %q does not name what was found (%q)", err, c.found)
				}
				if imageSum(t, img) != before {
					t.Fatal("the disk was written")
				}
			})
		}
	}
}

// A LUKS2 format of this agent's that a crash cut short is done again over
// its own leftovers (the header area), but not over a disk that holds
// anything past that area.
func TestACutShortLUKSFormatIsRedoneOnlyOverItsOwnLeftovers(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	e := newEnvWith(t, nil)
	e.crypt = newHostLUKS(t)
	e.start()
	img, _ := loop(t, 64)
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(bytes.Repeat([]byte{0xa5}, 4096), 32<<10)          // key material of the cut-short format
	f.WriteAt([]byte("data past the LUKS2 header area"), 20<<20) // not the format's
	f.Close()
	c := &Claim{Volume: "vol-c", Locator: Locator{BackingFile: img}, StagingPath: e.staging("c"), FsType: "ext4",
		Encrypted: true, Phase: PhaseInterrupted, LUKSFormatting: true}
	if err := e.m.Store().Put(c); err != nil {
		t.Fatal(err)
	}
	e.start()
	before := imageSum(t, img)
	_, err = e.m.Stage(ctx, encReq(e, "vol-c", img, "c"))
	wantCode(t, err, codes.FailedPrecondition, "cut short", "past the header area", "byte 20971520")
	if imageSum(t, img) != before {
		t.Fatal("the disk was written")
	}
}

// A node without the filesystem's tools refuses the format with a
// sentence naming the package to install, as a precondition, not as an
// internal error (the storage suite's xfs patterns met a worker without
// xfsprogs).
func TestMakeFSWithoutItsToolNamesThePackage(t *testing.T) {
	proof, err := blank.Prove(context.Background(), hosttest.SparseFile(t, 32<<20))
	if err != nil {
		t.Skipf("no proof here: %v", err)
	}
	t.Setenv("PATH", t.TempDir())
	for fs, pkg := range map[string]string{"xfs": "xfsprogs", "ext4": "e2fsprogs"} {
		err := makeFS(context.Background(), proof, fs, false, "0b0e1d2c-3f4a-4b5c-8d6e-7f8091a2b3c4")
		if agenterr.KindOf(err) != agenterr.FailedPrecondition || !strings.Contains(err.Error(), pkg) {
			t.Fatalf("mkfs.%s missing: %v (%v); want FAILED_PRECONDITION naming %s", fs, err, agenterr.KindOf(err), pkg)
		}
	}
}

// mkfsUUID is the UUID the tests' records say the agent gave mkfs.
const mkfsUUID = "5e1f0a2b-7c3d-4e5f-8a9b-0c1d2e3f4a5b"

// cutShortMkfs leaves on dev what an mkfs of fsType with UUID id killed
// part-way leaves: ext4 without its primary superblock (mke2fs writes it
// last), xfs with its superblock marked in progress (mkfs.xfs writes it
// first and clears the mark last).
func cutShortMkfs(t *testing.T, fsType, dev, id string) {
	t.Helper()
	switch fsType {
	case "ext4":
		run(t, "mkfs.ext4", "-q", "-F", "-U", id, dev)
		run(t, "dd", "if=/dev/zero", "of="+dev, "bs=2048", "count=1", "conv=notrunc,fsync", "status=none")
		if got := blkid(t, dev, "TYPE"); got != "" {
			t.Fatalf("blkid still names %q after the primary superblock went", got)
		}
	case "xfs":
		if _, err := exec.LookPath("xfs_db"); err != nil {
			t.Skip("xfs_db is not installed")
		}
		run(t, "mkfs.xfs", "-q", "-f", "-m", "uuid="+id, dev)
		run(t, "xfs_db", "-x", "-c", "sb 0", "-c", "write inprogress 1", dev)
		if got := blkid(t, dev, "TYPE"); got != "xfs" {
			t.Fatalf("blkid names %q, not xfs, on an xfs marked in progress", got)
		}
		mnt := t.TempDir()
		if err := unix.Mount(dev, mnt, "xfs", 0, ""); err == nil {
			unix.Unmount(mnt, 0)
			t.Fatal("the kernel mounted an xfs whose mkfs was marked in progress")
		}
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
}

// finishedAndUsed makes a filesystem of fsType on dev and writes a file in
// it, as another node that was given the disk would have.
func finishedAndUsed(t *testing.T, fsType, dev string) {
	t.Helper()
	run(t, "mkfs."+fsType, "-q", map[string]string{"ext4": "-F", "xfs": "-f"}[fsType], dev)
	used := t.TempDir()
	if err := unix.Mount(dev, used, fsType, 0, ""); err != nil {
		t.Fatal(err)
	}
	werr := os.WriteFile(filepath.Join(used, "kept"), []byte("data"), 0o644)
	if err := unix.Unmount(used, 0); err != nil || werr != nil {
		t.Fatal(err, werr)
	}
}

// cutShortCase is one device a record of a cut-short mkfs meets.
type cutShortCase struct {
	name, fsType string
	// prepare leaves on the device what the case is about.
	prepare func(t *testing.T, dev string)
	// record changes the recorded attempt (nil: as the mkfs was made).
	record func(a *MkfsAttempt)
	// want is "made again", "kept" (the finished filesystem mounted, its
	// file read back), or the words of a FAILED_PRECONDITION refusal that
	// leaves the disk as it was.
	want []string
}

var cutShortCases = []cutShortCase{
	{name: "ext4 leftovers", fsType: "ext4", prepare: func(t *testing.T, dev string) { cutShortMkfs(t, "ext4", dev, mkfsUUID) }, want: []string{"made again"}},
	{name: "xfs in progress", fsType: "xfs", prepare: func(t *testing.T, dev string) { cutShortMkfs(t, "xfs", dev, mkfsUUID) }, want: []string{"made again"}},
	{name: "all zeros", fsType: "ext4", prepare: func(*testing.T, string) {}, want: []string{"made again"}},
	// The mkfs finished before the crash; the filesystem may have been
	// used since (on another node, had the disk moved while this record
	// stayed).
	{name: "ext4 finished and used", fsType: "ext4", prepare: func(t *testing.T, dev string) { finishedAndUsed(t, "ext4", dev) }, want: []string{"kept"}},
	{name: "xfs finished and used", fsType: "xfs", prepare: func(t *testing.T, dev string) { finishedAndUsed(t, "xfs", dev) }, want: []string{"kept"}},
	{name: "xfs in progress of another mkfs", fsType: "xfs", prepare: func(t *testing.T, dev string) { cutShortMkfs(t, "xfs", dev, uuid.NewString()) },
		want: []string{"was cut short", "another UUID", "not formatted again"}},
	{name: "another filesystem", fsType: "xfs", prepare: func(t *testing.T, dev string) { run(t, "mkfs.ext4", "-q", "-F", dev) },
		want: []string{"was cut short", "TYPE=ext4", "not formatted again"}},
	{name: "a LUKS header", fsType: "ext4", prepare: func(t *testing.T, dev string) {
		cutShortMkfs(t, "ext4", dev, mkfsUUID)
		writeAt(t, dev, []byte("LUKS\xba\xbe\x00\x02"), 0)
	}, want: []string{"was cut short", "LUKS", "not formatted again"}},
	// The mkfs ran on a lease disk's data mapping, from 1 MiB; the disk
	// now comes without a lease area, the volume from byte 0 of it.
	{name: "another offset", fsType: "ext4", prepare: func(t *testing.T, dev string) { cutShortMkfs(t, "ext4", dev, mkfsUUID) },
		record: func(a *MkfsAttempt) { a.Offset = 1 << 20 }, want: []string{"from byte 1048576", "now lies from byte 0", "not formatted"}},
	{name: "another size", fsType: "ext4", prepare: func(t *testing.T, dev string) { cutShortMkfs(t, "ext4", dev, mkfsUUID) },
		record: func(a *MkfsAttempt) { a.Size -= 1 << 20 }, want: []string{"bytes now", "not formatted again"}},
}

func writeAt(t *testing.T, dev string, b []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// An mkfs of this agent's that a crash cut short (its record names it in
// Formatting) is run again over what it left, on both filesystems, and
// only there: a finished filesystem of the volume's type is mounted as it
// is, its files kept; anything the mkfs does not leave, or a device other
// than the one it ran on, is refused and left as it was.
func TestACutShortMkfsIsMadeAgainOnlyOverItsOwnLeftovers(t *testing.T) {
	needRoot(t)
	for _, c := range cutShortCases {
		t.Run(c.name, func(t *testing.T) { c.run(t) })
	}
	t.Run("no record", func(t *testing.T) {
		// The same leftovers without the record are foreign data (P5).
		e := newEnv(t)
		img, dev := loop(t, 64)
		cutShortMkfs(t, "ext4", dev, mkfsUUID)
		before := imageSum(t, img)
		_, err := e.m.Stage(context.Background(), e.stageReq("vol-m", img, "m"))
		wantCode(t, err, codes.FailedPrecondition, "not blank", "non-zero data")
		if imageSum(t, img) != before {
			t.Fatal("the disk was written")
		}
	})
}

func (c cutShortCase) run(t *testing.T) {
	e := newEnv(t)
	img, dev := loop(t, 320) // mkfs.xfs's least
	c.prepare(t, dev)
	a := &MkfsAttempt{Size: 320 << 20, UUID: mkfsUUID}
	if c.record != nil {
		c.record(a)
	}
	staging := e.staging("m")
	if err := e.m.Store().Put(&Claim{Volume: "vol-m", Locator: Locator{BackingFile: img}, StagingPath: staging, FsType: c.fsType,
		Phase: PhaseInterrupted, Formatting: a}); err != nil {
		t.Fatal(err)
	}
	e.start()
	before, uuidBefore := imageSum(t, img), blkid(t, dev, "UUID")
	r := e.stageReq("vol-m", img, "m")
	r.FsType = c.fsType
	res, err := e.m.Stage(context.Background(), r)
	switch c.want[0] {
	case "made again", "kept":
		if err != nil {
			t.Fatalf("the retried stage: %v\n%s", err, e.logs)
		}
		rec, gerr := e.m.Store().Get("vol-m")
		if gerr != nil || rec == nil || !rec.Formatted || rec.Formatting != nil || rec.Phase != PhaseStaged {
			t.Fatalf("record after the stage: %+v %v", rec, gerr)
		}
	default:
		wantCode(t, err, codes.FailedPrecondition, c.want...)
		if imageSum(t, img) != before {
			t.Fatal("the disk was written")
		}
		return
	}
	if c.want[0] == "made again" {
		if !res.Formatted || blkid(t, dev, "TYPE") != c.fsType || !strings.Contains(e.logs.String(), "was cut short; making it again") {
			t.Fatalf("stage %+v: blkid %q; log:\n%s", res, blkid(t, dev, "TYPE"), e.logs)
		}
		return
	}
	if res.Formatted || blkid(t, dev, "UUID") != uuidBefore {
		t.Fatalf("stage %+v: UUID %s, was %s: a finished filesystem was made again", res, blkid(t, dev, "UUID"), uuidBefore)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "kept")); err != nil || string(b) != "data" {
		t.Fatalf("the file on the finished filesystem: %q %v", b, err)
	}
}

// An mkfs that fails having written nothing leaves no record of a first
// stage: the device is still blank, and nothing of it is this agent's.
func TestAFailedMkfsThatWroteNothingIsForgotten(t *testing.T) {
	needRoot(t)
	e := newEnv(t)
	img, _ := loop(t, 64)
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "mkfs.ext4"), []byte("#!/bin/sh\necho no space left >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	_, err := e.m.Stage(context.Background(), e.stageReq("vol-f", img, "f"))
	wantCode(t, err, codes.Internal, "no space left")
	if c, err := e.m.Store().Get("vol-f"); err != nil || c != nil {
		t.Fatalf("the record of a first stage whose mkfs wrote nothing: %+v %v", c, err)
	}
}

// An agent that dies at the mount, after its mkfs finished, leaves a
// record saying the mkfs began (Formatting); the retry of the stage mounts
// the finished filesystem, never making another over it, and records it
// made.
func TestAFilesystemFinishedBeforeADeathAtTheMountIsKept(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	e := newEnv(t)
	img, dev := loop(t, 64)
	r := e.stageReq("vol-o", img, "o")
	var atMount []byte
	withMounter(e.m, &dyingMounter{mounter: e.m.host, die: func() {
		atMount, _ = os.ReadFile(e.m.store.file("vol-o"))
	}})
	if _, err := e.m.Stage(ctx, r); err == nil {
		t.Fatal("the stage went on past the agent's death at the mount")
	}
	var c Claim
	if err := json.Unmarshal(atMount, &c); err != nil || c.Formatting == nil {
		t.Fatalf("the record when the mount began: %s (%v); want the mkfs in it", atMount, err)
	}
	uuid := blkid(t, dev, "UUID")
	// What the dead agent left on disk is the record of that moment.
	if err := os.WriteFile(e.m.store.file("vol-o"), atMount, 0o600); err != nil {
		t.Fatal(err)
	}
	e.start()
	res, err := e.m.Stage(ctx, r)
	if err != nil || res.Formatted || blkid(t, dev, "UUID") != uuid {
		t.Fatalf("retried stage %+v %v: UUID %s, was %s", res, err, blkid(t, dev, "UUID"), uuid)
	}
	if rec, err := e.m.Store().Get("vol-o"); err != nil || rec == nil || !rec.Formatted || rec.Formatting != nil {
		t.Fatalf("record after the retried stage: %+v %v", rec, err)
	}
}

// dyingMounter stands for an agent that dies as it mounts: die runs, and
// the mount fails.
type dyingMounter struct {
	mounter
	die func()
}

func (d *dyingMounter) Mount(string, string, string, []string) error {
	d.die()
	return errors.New("the agent died at the mount")
}
