package volume

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

// These tests run on this host with real loop devices, real mkfs, blkid and
// mounts. A loop device has no persistent reservations and newEnv's fencer
// factory has no on-disk lease (the lease tests give it one), so the tests
// that stage through it use the explicit opt-in for unfenced disks
// (allow_unfenced in both the request and the configuration), exactly as
// an operator would have to. The fence-loss tests put the real reservation
// engine in front of the loop device, talking to fence/scsi/scsitest, the
// model SPC-4 target, because this host has no SCSI.

const nodeA = "4c4c4544-0042-3610-8052-b4c04f4e3332"

func needRoot(t *testing.T) {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices and mounts", "losetup", "blkid", "mkfs.ext4", "mkfs.xfs")
}

type env struct {
	t       *testing.T
	kubelet string
	state   string
	bus     *events.Bus
	sub     *events.Subscription
	m       *Manager
	fencers FencerFactory
	crypt   Encryption
	cfg     config.Volumes
	logs    *bytes.Buffer
	// sysfs, when set, replaces /sys for disk discovery.
	sysfs *fakeSysfs
}

func newEnv(t *testing.T) *env {
	key, _ := fence.KeyFromUUID(nodeA)
	return newEnvWith(t, &Fencing{Key: key, Node: nodeA})
}

func newEnvWith(t *testing.T, fencers FencerFactory) *env {
	needRoot(t)
	if fencers == nil {
		key, _ := fence.KeyFromUUID(nodeA)
		fencers = &Fencing{Key: key, Node: nodeA}
	}
	dir := t.TempDir()
	e := &env{t: t, kubelet: filepath.Join(dir, "kubelet"), state: filepath.Join(dir, "state")}
	for _, d := range []string{e.kubelet, e.state} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Every mount made under the test's kubelet root goes, even when the
	// test fails half-way; registered first, so it runs after the loop
	// devices' cleanup has been registered... and before it runs.
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	e.cfg = config.Volumes{KubeletRoot: e.kubelet, DevRoot: "/dev", CheckInterval: time.Second, AllowUnfenced: true, AllowLoopDevices: true}
	e.fencers = fencers
	e.bus = events.NewBus(64, 64, nil)
	e.sub = e.bus.Subscribe(false)
	t.Cleanup(e.sub.Close)
	e.start()
	return e
}

// start makes a new manager over the same state directory, as a restarted
// agent does.
func (e *env) start() {
	e.t.Helper()
	if e.m != nil {
		e.m.Close()
	}
	if e.logs == nil {
		e.logs = &bytes.Buffer{}
	}
	log := slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	sysfs := "/sys"
	if e.sysfs != nil {
		sysfs = e.sysfs.root
	}
	m, err := New(Options{Config: e.cfg, StateDir: e.state, SysfsRoot: sysfs, Fencers: e.fencers, Crypt: e.crypt, Bus: e.bus, Log: log})
	if err != nil {
		e.t.Fatal(err)
	}
	e.m = m
	e.t.Cleanup(m.Close)
}

func (e *env) path(p string) string { return filepath.Join(e.kubelet, p) }

// event waits for the next event of type typ.
func (e *env) event(typ events.Type) events.Event {
	e.t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case ev := <-e.sub.C():
			if ev.Type == typ {
				return ev
			}
		case <-deadline:
			e.t.Fatalf("no %s event", typ)
		}
	}
}

// loop attaches a sparse image of size MiB and returns its backing file
// and device; both go when the test ends.
func loop(t *testing.T, mib int64) (string, string) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(mib << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return img, attach(t, img)
}

// attach makes a loop device of img, detached when the test ends.
func attach(t *testing.T, img string) string {
	t.Helper()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		// Mappings the agent made over the disk (a lease disk's data area)
		// go first, also when a test failed before unstaging, and before
		// each the pod device over it (at offset 0), which keeps it bound.
		all, _ := exec.Command("losetup", "-a").Output()
		lines := strings.Split(string(all), "\n")
		for _, line := range lines {
			m, _, ok := strings.Cut(line, ":")
			if !ok || !strings.Contains(line, "("+dev+"), offset") {
				continue
			}
			for _, over := range lines {
				if p, _, ok := strings.Cut(over, ":"); ok && strings.HasSuffix(over, "("+m+")") {
					exec.Command("losetup", "-d", p).Run()
				}
			}
			exec.Command("losetup", "-d", m).Run()
		}
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Logf("losetup -d %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

func blkid(t *testing.T, dev, tag string) string {
	t.Helper()
	out, _ := exec.Command("blkid", "-p", "-s", tag, "-o", "value", dev).Output()
	return strings.TrimSpace(string(out))
}

func isMounted(t *testing.T, p string) bool {
	t.Helper()
	var st, parent unix.Stat_t
	if unix.Stat(p, &st) != nil || unix.Stat(filepath.Dir(p), &parent) != nil {
		return false
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		fs := strings.Fields(line)
		if len(fs) > 4 && fs[4] == p {
			return true
		}
	}
	return false
}

func wantCode(t *testing.T, err error, c codes.Code, words ...string) {
	t.Helper()
	if got := agenterr.Code(err); got != c {
		t.Fatalf("got %v (%v), want %v", got, err, c)
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("error %q lacks %q", err, w)
		}
	}
}

func (e *env) stageReq(vol, img, staging string) StageRequest {
	return StageRequest{Volume: vol, Locator: Locator{BackingFile: img}, StagingPath: e.staging(staging), FsType: "ext4", AllowUnfenced: true}
}

func TestStageFormatsOnceThenPublishStatsUnstage(t *testing.T) {
	e := newEnv(t)
	img, dev := loop(t, 64)
	ctx := context.Background()
	req := e.stageReq("vol-1", img, "vol-1")

	uuid := e.firstStageFormatsAndMounts(ctx, req, dev)
	e.stageRetriedOrConflicting(ctx, req, dev, uuid)
	rw, ro := e.publishReadWriteAndReadOnly(ctx, req)
	e.unpublishThenUnstage(ctx, req, rw, ro)

	// Staged again later: the filesystem and its data are still there.
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Formatted {
		t.Fatalf("stage after unstage: %+v %v", res, err)
	}
	if _, err := os.Stat(filepath.Join(req.StagingPath, "new")); err != nil {
		t.Fatalf("data written through the target: %v", err)
	}
}

// firstStageFormatsAndMounts: the first stage of the blank dev formats it
// ext4 and mounts it, unfenced, saying so in its DiskClaimed event; it
// writes "kept" to the file data and returns the filesystem's UUID.
func (e *env) firstStageFormatsAndMounts(ctx context.Context, req StageRequest, dev string) string {
	t := e.t
	t.Helper()
	res, err := e.m.Stage(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Formatted || res.Device != dev || res.Method != fence.MethodNone {
		t.Fatalf("first stage: %+v", res)
	}
	if blkid(t, dev, "TYPE") != "ext4" || !isMounted(t, req.StagingPath) {
		t.Fatalf("after stage: type %q, mounted %v", blkid(t, dev, "TYPE"), isMounted(t, req.StagingPath))
	}
	uuid := blkid(t, dev, "UUID")
	if ev := e.event(events.DiskClaimed); ev.Volume != "vol-1" || ev.Device != dev || !strings.Contains(ev.Message, "without fencing") {
		t.Fatalf("claimed event: %+v", ev)
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	return uuid
}

// stageRetriedOrConflicting: a retry is idempotent and never formats
// again; conflicting stages are refused, naming the difference.
func (e *env) stageRetriedOrConflicting(ctx context.Context, req StageRequest, dev, uuid string) {
	t := e.t
	t.Helper()
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Formatted {
		t.Fatalf("retried stage: %+v %v", res, err)
	}
	if b, err := os.ReadFile(filepath.Join(req.StagingPath, "data")); err != nil || string(b) != "kept" || blkid(t, dev, "UUID") != uuid {
		t.Fatalf("data after retried stage: %q %v (uuid %s, was %s)", b, err, blkid(t, dev, "UUID"), uuid)
	}
	// Conflicting stages are refused, naming the difference.
	xfs := req
	xfs.FsType = "xfs"
	_, err = e.m.Stage(ctx, xfs)
	wantCode(t, err, codes.AlreadyExists, `filesystem "ext4", not "xfs"`)
	other := req
	other.StagingPath = e.staging("elsewhere")
	_, err = e.m.Stage(ctx, other)
	wantCode(t, err, codes.AlreadyExists, "staging path")
}

// publishReadWriteAndReadOnly publishes vol-1 read-write (twice) and
// read-only: the data is there, writes go through the one and fail with
// EROFS on the other, and the stats are of the filesystem, for a
// published path only. It returns the two targets.
func (e *env) publishReadWriteAndReadOnly(ctx context.Context, req StageRequest) (rw, ro string) {
	t := e.t
	t.Helper()
	rw, ro = e.target("a", "vol"), e.target("b", "vol")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: rw}); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: ro, ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-1", StagingPath: req.StagingPath, TargetPath: rw}); err != nil {
		t.Fatalf("retried publish: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(rw, "data")); err != nil || string(b) != "kept" {
		t.Fatalf("published data: %q %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(rw, "new"), []byte("x"), 0o644); err != nil {
		t.Fatalf("write through the read-write target: %v", err)
	}
	if err := os.WriteFile(filepath.Join(ro, "nope"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through the read-only target: %v, want EROFS", err)
	}
	st, err := e.m.Stats(ctx, "vol-1", rw)
	if err != nil || st.TotalBytes < 50<<20 || st.UsedBytes <= 0 || st.TotalInodes <= 0 || st.UsedInodes <= 0 || st.Abnormal {
		t.Fatalf("stats: %+v %v", st, err)
	}
	_, err = e.m.Stats(ctx, "vol-1", e.target("c", "vol"))
	wantCode(t, err, codes.NotFound)
	return rw, ro
}

// unpublishThenUnstage: unstage before unpublish is refused; then the
// right order works, each step idempotent: the targets go, the staging
// path is unmounted, the claim forgotten and its release announced.
func (e *env) unpublishThenUnstage(ctx context.Context, req StageRequest, rw, ro string) {
	t := e.t
	t.Helper()
	wantCode(t, e.m.Unstage(ctx, "vol-1", req.StagingPath), codes.FailedPrecondition, "unpublish")
	for _, p := range []string{rw, ro} {
		if err := e.m.Unpublish(ctx, "vol-1", p); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("target %s still there: %v", p, err)
		}
	}
	if err := e.m.Unpublish(ctx, "vol-1", rw); err != nil {
		t.Fatalf("retried unpublish: %v", err)
	}
	if err := e.m.Unstage(ctx, "vol-1", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if isMounted(t, req.StagingPath) {
		t.Fatal("staging path still mounted after unstage")
	}
	if c, err := e.m.Store().Get("vol-1"); c != nil || err != nil {
		t.Fatalf("claim still recorded: %+v %v", c, err)
	}
	if ev := e.event(events.DiskReleased); ev.Volume != "vol-1" || ev.Reason != "unstaged" {
		t.Fatalf("released event: %+v", ev)
	}
	if err := e.m.Unstage(ctx, "vol-1", req.StagingPath); err != nil {
		t.Fatalf("retried unstage: %v", err)
	}
}

func TestForeignFilesystemIsMountedNeverFormatted(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()

	img, dev := loop(t, 64)
	if out, err := exec.Command("mkfs.ext4", "-q", "-L", "foreign", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	uuid := blkid(t, dev, "UUID")
	req := e.stageReq("vol-ext4", img, "ext4")
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Formatted {
		t.Fatalf("stage of an existing ext4: %+v %v", res, err)
	}
	if blkid(t, dev, "UUID") != uuid || blkid(t, dev, "LABEL") != "foreign" {
		t.Fatal("the existing filesystem was replaced")
	}

	// xfs where ext4 is asked for: neither formatted nor mounted.
	img2, dev2 := loop(t, 320)
	if out, err := exec.Command("mkfs.xfs", "-q", dev2).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v %s", err, out)
	}
	uuid2 := blkid(t, dev2, "UUID")
	req2 := e.stageReq("vol-xfs", img2, "xfs")
	_, err = e.m.Stage(ctx, req2)
	wantCode(t, err, codes.FailedPrecondition, `carries "xfs"`, "neither formats")
	if blkid(t, dev2, "TYPE") != "xfs" || blkid(t, dev2, "UUID") != uuid2 || isMounted(t, req2.StagingPath) {
		t.Fatal("a device with another filesystem was touched")
	}
	if c, _ := e.m.Store().Get("vol-xfs"); c != nil {
		t.Fatalf("a refused first stage left a record: %+v", c)
	}
	// Asked for as xfs, it mounts as it is.
	req2.FsType = "xfs"
	if res, err := e.m.Stage(ctx, req2); err != nil || res.Formatted {
		t.Fatalf("stage of an existing xfs: %+v %v", res, err)
	}

	// A partition table is data too: an MBR with one Linux partition.
	img3, dev3 := loop(t, 64)
	mbr := make([]byte, 512)
	copy(mbr[446:], []byte{0, 0, 0, 0, 0x83, 0, 0, 0, 0, 0x08, 0, 0, 0, 0xf8, 0x01, 0})
	mbr[510], mbr[511] = 0x55, 0xaa
	if f, err := os.OpenFile(dev3, os.O_WRONLY, 0); err != nil {
		t.Fatal(err)
	} else {
		_, werr := f.Write(mbr)
		f.Close()
		if werr != nil {
			t.Fatal(werr)
		}
	}
	_, err = e.m.Stage(ctx, e.stageReq("vol-mbr", img3, "mbr"))
	wantCode(t, err, codes.FailedPrecondition, "probably partitions")
	if blkid(t, dev3, "PTTYPE") != "dos" {
		t.Fatal("the partition table was overwritten")
	}
}

func TestBlockVolumePublishesTheDevice(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 16)
	req := StageRequest{Volume: "vol-b", Locator: Locator{BackingFile: img}, StagingPath: e.blockStaging("b"), Block: true, AllowUnfenced: true}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	if blkid(t, dev, "TYPE") != "" {
		t.Fatal("a raw block volume was formatted")
	}
	target := e.blockTarget("dev", "p")
	e.publishTheDeviceNodeThreeTimes(ctx, req, dev, target)
	// Another block volume's device on that target is not this one's.
	img2, _ := loop(t, 8)
	req2 := StageRequest{Volume: "vol-b2", Locator: Locator{BackingFile: img2}, StagingPath: e.blockStaging("b2"), Block: true, AllowUnfenced: true}
	if _, err := e.m.Stage(ctx, req2); err != nil {
		t.Fatal(err)
	}
	err := e.m.Publish(ctx, PublishRequest{Volume: "vol-b2", StagingPath: req2.StagingPath, TargetPath: target, Block: true})
	wantCode(t, err, codes.AlreadyExists, target)
	if err := e.m.Unstage(ctx, "vol-b2", req2.StagingPath); err != nil {
		t.Fatal(err)
	}
	s, err := e.m.Stats(ctx, "vol-b", "")
	if err != nil || !s.Block || s.TotalBytes != 16<<20 {
		t.Fatalf("block stats: %+v %v", s, err)
	}
	// Grow the backing file and the loop device: expand reports the size.
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
		t.Fatalf("losetup -c: %v %s", err, out)
	}
	if n, err := e.m.Expand(ctx, "vol-b", "", 32<<20); err != nil || n != 32<<20 {
		t.Fatalf("expand block: %d %v", n, err)
	}
	if err := e.m.Unpublish(ctx, "vol-b", target); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unstage(ctx, "vol-b", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// publishTheDeviceNodeThreeTimes publishes the block volume of req at
// target: target is dev's device node. The kubelet publishes again after
// its own restart: the agent knows its bind mount of the device node
// (whose mount source reads as devtmpfs, not the device) and answers OK,
// once more, leaving one mount.
func (e *env) publishTheDeviceNodeThreeTimes(ctx context.Context, req StageRequest, dev, target string) {
	t := e.t
	t.Helper()
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-b", StagingPath: req.StagingPath, TargetPath: target, Block: true}); err != nil {
		t.Fatal(err)
	}
	var st, want unix.Stat_t
	if err := unix.Stat(target, &st); err != nil || unix.Stat(dev, &want) != nil || st.Rdev != want.Rdev || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("target %s is not %s: %v", target, dev, err)
	}
	for i := 0; i < 2; i++ {
		if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-b", StagingPath: req.StagingPath, TargetPath: target, Block: true}); err != nil {
			t.Fatalf("publish %d of the same block volume to the same target: %v", i+2, err)
		}
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Count(string(b), " "+target+" ") != 1 {
		t.Fatalf("not one mount at %s after three publishes:\n%s", target, b)
	}
}

func TestExpandGrowsTheFilesystemOnline(t *testing.T) {
	for _, fs := range []struct {
		name     string
		from, to int64 // MiB
	}{{"ext4", 64, 128}, {"xfs", 320, 640}} {
		t.Run(fs.name, func(t *testing.T) {
			if fs.name == "ext4" && !hasCap(unix.CAP_SYS_RESOURCE) {
				// resize2fs' online ioctl (EXT4_IOC_RESIZE_FS) needs it; some
				// containers drop it even for root.
				t.Skip("online ext4 resize needs CAP_SYS_RESOURCE, which this process lacks")
			}
			e := newEnv(t)
			ctx := context.Background()
			img, dev := loop(t, fs.from)
			req := e.stageReq("vol-g", img, "g")
			req.FsType = fs.name
			if _, err := e.m.Stage(ctx, req); err != nil {
				t.Fatal(err)
			}
			before, _ := e.m.Stats(ctx, "vol-g", "")
			_, err := e.m.Expand(ctx, "vol-g", "", fs.to<<20)
			wantCode(t, err, codes.FailedPrecondition, "has not reached this node")
			if err := os.Truncate(img, fs.to<<20); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
				t.Fatalf("losetup -c: %v %s", err, out)
			}
			n, err := e.m.Expand(ctx, "vol-g", req.StagingPath, fs.to<<20)
			if err != nil || n != fs.to<<20 {
				t.Fatalf("expand: %d %v", n, err)
			}
			after, _ := e.m.Stats(ctx, "vol-g", "")
			if after.TotalBytes < before.TotalBytes*3/2 {
				t.Fatalf("filesystem did not grow: %d -> %d bytes", before.TotalBytes, after.TotalBytes)
			}
		})
	}
}

func hasCap(c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var mask uint64
			for _, r := range strings.TrimSpace(v) {
				mask <<= 4
				switch {
				case r >= '0' && r <= '9':
					mask |= uint64(r - '0')
				case r >= 'a' && r <= 'f':
					mask |= uint64(r - 'a' + 10)
				}
			}
			return mask&(1<<uint(c)) != 0
		}
	}
	return false
}

func TestUnfencedDiskNeedsBothOptIns(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 16)
	req := e.stageReq("vol-u", img, "u")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "offers no fencing", "not a SCSI device", "allow_unfenced")
	if blkid(t, dev, "TYPE") != "" || isMounted(t, req.StagingPath) {
		t.Fatal("a refused disk was formatted or mounted")
	}
	e.cfg.AllowUnfenced = false
	e.start()
	req.AllowUnfenced = true
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "offers no fencing")
	// Loop devices themselves need the configuration's consent.
	e.cfg.AllowLoopDevices = false
	e.start()
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.InvalidArgument, "allow_loop_devices")
}

func TestPathsMustStayUnderTheKubeletRoot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	outside := t.TempDir()
	if err := os.MkdirAll(e.path("plugins"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, e.path("plugins/escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, e.path("link-target")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{
		e.path("../elsewhere/x"),
		e.path("a/../../x"),
		outside + "/x",
		e.path("plugins/escape/x"),
		e.path("plugins/escape/deeper/x"),
		e.path("link-target"),
		e.kubelet,
		"relative/x",
		"",
	} {
		req := StageRequest{Volume: "v", Locator: Locator{BackingFile: "/nonexistent"}, StagingPath: p, AllowUnfenced: true}
		if _, err := e.m.Stage(ctx, req); agenterr.Code(err) != codes.InvalidArgument {
			t.Errorf("stage at %q: %v, want InvalidArgument", p, err)
		}
		if err := e.m.Publish(ctx, PublishRequest{Volume: "v", StagingPath: e.staging("v"), TargetPath: p}); agenterr.Code(err) != codes.InvalidArgument {
			t.Errorf("publish at %q: %v, want InvalidArgument", p, err)
		}
		if err := e.m.Unpublish(ctx, "v", p); agenterr.Code(err) != codes.InvalidArgument {
			t.Errorf("unpublish at %q: %v, want InvalidArgument", p, err)
		}
	}
	// Paths of the kubelet's shapes through a symlink that leaves the root.
	for _, link := range []string{filepath.Dir(filepath.Dir(e.staging("v"))), e.path("pods/p"), e.path("plugins/kubernetes.io/csi/volumeDevices/publish")} {
		if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(outside, link); err != nil {
			t.Fatal(err)
		}
	}
	req := StageRequest{Volume: "v", Locator: Locator{BackingFile: "/nonexistent"}, StagingPath: e.staging("v"), AllowUnfenced: true}
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.InvalidArgument, "outside the kubelet directory")
	for _, pub := range []PublishRequest{
		{Volume: "v", StagingPath: e.staging("v"), TargetPath: e.target("p", "pv")},
		{Volume: "v", StagingPath: e.blockStaging("pv"), TargetPath: e.blockTarget("pv", "p"), Block: true},
	} {
		wantCode(t, e.m.Publish(ctx, pub), codes.InvalidArgument, "outside the kubelet directory")
		wantCode(t, e.m.Unpublish(ctx, "v", pub.TargetPath), codes.InvalidArgument, "outside the kubelet directory")
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Fatalf("something was created outside the kubelet root: %v", entries)
	}
}

func TestConcurrentOperationOnAVolumeIsAborted(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 64)
	req := e.stageReq("vol-c", img, "c")
	release, err := e.m.locks.try("vol-c", "stage")
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.Aborted, "vol-c", "in progress")
	wantCode(t, e.m.Unstage(ctx, "vol-c", req.StagingPath), codes.Aborted)
	wantCode(t, e.m.Publish(ctx, PublishRequest{Volume: "vol-c", StagingPath: req.StagingPath, TargetPath: e.target("p", "t")}), codes.Aborted)
	_, err = e.m.Expand(ctx, "vol-c", "", 0)
	wantCode(t, err, codes.Aborted)
	release()

	// Really concurrent: of several stages of one volume racing, those
	// that do not win are aborted, and the disk is formatted exactly once.
	const n = 4
	errs := make(chan error, n)
	formatted := make(chan bool, n)
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		go func() {
			<-start
			res, err := e.m.Stage(ctx, req)
			formatted <- res.Formatted
			errs <- err
		}()
	}
	close(start)
	var ok, aborted, formats int
	for i := 0; i < n; i++ {
		if <-formatted {
			formats++
		}
		switch err := <-errs; agenterr.Code(err) {
		case codes.OK:
			ok++
		case codes.Aborted:
			aborted++
		default:
			t.Fatalf("racing stage: %v", err)
		}
	}
	if ok < 1 || ok+aborted != n || formats != 1 {
		t.Fatalf("racing stages: %d ok, %d aborted, %d formats", ok, aborted, formats)
	}
}

func TestRestartReconcilesFromTheStateFile(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, _ := loop(t, 64)
	req := e.stageReq("vol-r", img, "r")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "data"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Block volume whose disk will be gone when the agent comes back.
	imgB, devB := loop(t, 16)
	reqB := StageRequest{Volume: "vol-gone", Locator: Locator{BackingFile: imgB}, StagingPath: e.blockStaging("gone"), Block: true, AllowUnfenced: true}
	if _, err := e.m.Stage(ctx, reqB); err != nil {
		t.Fatal(err)
	}
	// A stage cut short after its record was written (crash before any
	// mount), on a disk the agent had already formatted once.
	imgC, devC := loop(t, 16)
	if err := e.m.Store().Put(&Claim{Volume: "vol-cut", Locator: Locator{BackingFile: imgC}, StagingPath: e.staging("cut"),
		FsType: "ext4", Phase: PhaseClaiming, Formatted: true}); err != nil {
		t.Fatal(err)
	}

	e.m.Close() // the agent stops (or crashes): claims stay recorded
	if out, err := exec.Command("losetup", "-d", devB).CombinedOutput(); err != nil {
		t.Fatalf("detaching %s: %v %s", devB, err, out)
	}
	e.start()
	e.m.Reconcile(ctx)

	if c, _ := e.m.Store().Get("vol-gone"); c != nil {
		t.Fatalf("claim of a vanished disk kept: %+v", c)
	}
	if ev := e.event(events.DiskReleased); ev.Volume != "vol-gone" || ev.Reason != "device-gone" {
		t.Fatalf("gone event: %+v", ev)
	}
	e.keptClaimServesAfterTheRestart(ctx, req)
	e.cutStageIsNeverFormattedAgain(ctx, imgC, devC)
	disks, err := e.m.Disks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, d := range disks {
		if d.Volume == "vol-r" {
			found = d.State == "unfenced" && d.Method == fence.MethodNone && d.Staging == req.StagingPath
		}
	}
	if !found {
		t.Fatalf("vol-r not listed as an unfenced claim: %+v", disks)
	}
}

// keptClaimServesAfterTheRestart: vol-r's claim is kept, staged and
// unfenced, its stats normal; staged again it is not formatted and its
// data is there.
func (e *env) keptClaimServesAfterTheRestart(ctx context.Context, req StageRequest) {
	t := e.t
	t.Helper()
	c, _ := e.m.Store().Get("vol-r")
	if c == nil || c.Phase != PhaseStaged || c.State != StateUnfenced {
		t.Fatalf("kept claim: %+v", c)
	}
	if st, err := e.m.Stats(ctx, "vol-r", ""); err != nil || st.Abnormal {
		t.Fatalf("stats after restart: %+v %v", st, err)
	}
	if res, err := e.m.Stage(ctx, req); err != nil || res.Formatted {
		t.Fatalf("stage after restart: %+v %v", res, err)
	}
	if _, err := os.Stat(filepath.Join(req.StagingPath, "data")); err != nil {
		t.Fatal(err)
	}
}

// cutStageIsNeverFormattedAgain: the stage of vol-cut cut short is
// recorded as interrupted, and its retry never formats the disk again.
func (e *env) cutStageIsNeverFormattedAgain(ctx context.Context, imgC, devC string) {
	t := e.t
	t.Helper()
	cut, _ := e.m.Store().Get("vol-cut")
	if cut == nil || cut.Phase != PhaseInterrupted || !cut.Formatted {
		t.Fatalf("interrupted claim: %+v", cut)
	}
	// Its retry finds the disk blank although the agent formatted it: the
	// wrong disk, or its data lost elsewhere. Never formatted again.
	_, err := e.m.Stage(ctx, StageRequest{Volume: "vol-cut", Locator: Locator{BackingFile: imgC}, StagingPath: e.staging("cut"), FsType: "ext4", AllowUnfenced: true})
	wantCode(t, err, codes.FailedPrecondition, "will not format it again")
	if blkid(t, devC, "TYPE") != "" {
		t.Fatal("formatted twice")
	}
}

func TestStateFilesAreNotFollowedThroughSymlinks(t *testing.T) {
	dir := t.TempDir()
	target := t.TempDir()
	if err := os.Symlink(target, filepath.Join(dir, "state")); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenStore(filepath.Join(dir, "state")); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("state dir through a symlink: %v", err)
	}
	s, err := OpenStore(filepath.Join(dir, "real"))
	if err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(target, "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, s.file("v")); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(&Claim{Volume: "v"}); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("put over a symlink: %v", err)
	}
	if _, err := s.Get("v"); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("get through a symlink: %v", err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Fatal("the symlink's target was overwritten")
	}
	roundTripKeepsEveryField(t, s)
}

// roundTripKeepsEveryField: a round trip keeps every field and leaves no
// temporary file.
func roundTripKeepsEveryField(t *testing.T, s *Store) {
	t.Helper()
	c := &Claim{Volume: "loc/42", Locator: Locator{Disk: discovery.Locator{PCI: &discovery.PCIAddress{Slot: 7, AnyFunction: true}, Serial: "42"}}, Phase: PhaseStaged, State: StateHeld, Key: 0x7663000000000001, Formatted: true, Publications: []string{"/a"}}
	if err := s.Put(c); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("loc/42")
	if err != nil || got == nil || !got.Locator.Equal(c.Locator) || got.Key != c.Key || !got.Formatted || got.Publications[0] != "/a" {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	ents, _ := os.ReadDir(s.Dir())
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".tmp") {
			t.Fatalf("temporary file left: %s", e.Name())
		}
	}
}

func TestReadOnlyStage(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	req := e.stageReq("vol-ro", img, "ro")
	req.ReadOnly = true
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "blank", "read-only")
	if blkid(t, dev, "TYPE") != "" {
		t.Fatal("a read-only stage formatted the disk")
	}
	if out, err := exec.Command("mkfs.ext4", "-q", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(req.StagingPath, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("write to a read-only stage: %v", err)
	}
	err = e.m.Publish(ctx, PublishRequest{Volume: "vol-ro", StagingPath: req.StagingPath, TargetPath: e.target("x", "vol")})
	wantCode(t, err, codes.InvalidArgument, "read-only")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-ro", StagingPath: req.StagingPath, TargetPath: e.target("x", "vol"), ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	_, err = e.m.Expand(ctx, "vol-ro", "", 0)
	wantCode(t, err, codes.FailedPrecondition, "read-only")
}

// Two xfs volumes with one filesystem UUID (a clone of a snapshot) are
// both staged on one node.
func TestClonedXFSVolumesMountSideBySide(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 320)
	if out, err := exec.Command("mkfs.xfs", "-q", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v %s", err, out)
	}
	img2 := filepath.Join(t.TempDir(), "clone.img")
	if out, err := exec.Command("cp", "--sparse=always", img, img2).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	attach(t, img2)
	for i, im := range []string{img, img2} {
		req := e.stageReq(fmt.Sprintf("vol-x%d", i), im, fmt.Sprintf("x%d", i))
		req.FsType = "xfs"
		if res, err := e.m.Stage(ctx, req); err != nil || res.Formatted {
			t.Fatalf("stage %d: %+v %v", i, res, err)
		}
	}
}
