package volume

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// Two "nodes" on this host share one disk image through two loop devices
// (the second over a hard link of the image, so that each node has its own
// block device and its own read-only flag, as two VMs attached to one
// virtio-blk disk do). Each runs the agent's own fencing: PR is probed and
// refused by the loop device, so the on-disk lease is chosen, with short
// timing. The lab repeats this across real guests.

var testTiming = lease.Timing{IOTimeout: 500 * time.Millisecond, Renew: time.Second, Fail: 4 * time.Second, Watchdog: 0}

// fencedLeaseEnv is a started agent on node that stages nothing unfenced,
// so a disk without reservations is staged on the lease or not at all.
func fencedLeaseEnv(t *testing.T, node, name string) *env {
	t.Helper()
	e := newEnvWith(t, leaseFencing(node, name))
	e.cfg.AllowUnfenced = false
	e.start()
	return e
}

func leaseFencing(node, name string) *Fencing {
	key, _ := fence.KeyFromUUID(node)
	return &Fencing{Key: key, Node: node, Resolver: names,
		Lease: NewLease(LeaseOptions{Key: key, Node: node, NodeName: name, Resolver: names, Timing: testTiming})}
}

// shared attaches img to a second loop device through a hard link and
// returns the link (B's locator) and device.
func shared(t *testing.T, img string) (string, string) {
	t.Helper()
	link := filepath.Join(t.TempDir(), "disk-b.img")
	if err := os.Link(img, link); err != nil {
		t.Fatal(err)
	}
	return link, attach(t, link)
}

func devEvent(t *testing.T, dev string) uevent.Event {
	t.Helper()
	name := filepath.Base(dev)
	b, err := os.ReadFile("/sys/class/block/" + name + "/dev")
	if err != nil {
		t.Fatal(err)
	}
	var ma, mi uint32
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &ma, &mi); err != nil {
		t.Fatal(err)
	}
	return uevent.Event{Action: "add", Subsystem: "block", DevType: "disk", DevName: name, Major: ma, Minor: mi, HasDevnum: true}
}

func TestLeaseFencesADiskWithoutReservations(t *testing.T) {
	needRoot(t)
	a := fencedLeaseEnv(t, nodeA, "node-a")
	b := fencedLeaseEnv(t, nodeB, "node-b")
	ctx := context.Background()
	img, devA := loop(t, 64)
	linkB, devB := shared(t, img)
	t.Cleanup(func() { clearRO(devA); clearRO(devB) })

	reqA := a.stageReq("vol-l", img, "l")
	reqA.AllowUnfenced = false
	a.firstLeaseStageFormatsPastTheLease(ctx, reqA, img, devA)
	refusedAtSightByB(ctx, a, b, devA, devB)

	// B's stage: refused, naming A.
	reqB := b.stageReq("vol-l", linkB, "l")
	reqB.AllowUnfenced = false
	_, err := b.m.Stage(ctx, reqB)
	wantCode(t, err, codes.FailedPrecondition, keyA.String(), "node-a")

	// A's agent restarts while it holds the claim: re-verified and kept.
	a.start()
	a.m.Reconcile(ctx)
	if c, _ := a.m.Store().Get("vol-l"); c == nil || c.State != StateHeld || c.Abnormal() {
		t.Fatalf("claim after A's restart: %+v", c)
	}
	time.Sleep(testTiming.Fail + testTiming.Renew) // renewals by the new process keep it
	a.m.CheckAll(ctx)
	if c, _ := a.m.Store().Get("vol-l"); c.State != StateHeld {
		t.Fatalf("claim lost after the restart: %+v", c)
	}
	if _, err := b.m.Stage(ctx, reqB); agenterr.Code(err) != codes.FailedPrecondition {
		t.Fatalf("B staged A's disk after A's restart: %v", err)
	}

	// A's agent goes down; B takes over with the controller's grant; A's
	// agent, back, finds the claim lost and stops I/O.
	a.m.Close()
	clearRO(devB)
	reqB.Grant = &fence.Grant{Disk: "vol-l", Node: nodeB, Supersedes: []fence.Key{keyA}}
	if res, err := b.m.Stage(ctx, reqB); err != nil || res.Method != fence.MethodLease || res.Formatted {
		t.Fatalf("B's granted takeover: %+v %v", res, err)
	}
	if got, _ := os.ReadFile(filepath.Join(reqB.StagingPath, "a")); string(got) != "node-a's data" {
		t.Fatalf("B reads %q", got)
	}
	a.backFindsItsClaimLostToB(ctx, devA)
	if err := b.m.Unstage(ctx, "vol-l", reqB.StagingPath); err != nil {
		t.Fatal(err)
	}
	if err := a.m.Unstage(ctx, "vol-l", reqA.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// firstLeaseStageFormatsPastTheLease: A's first stage of the blank disk
// writes a lease area and formats ext4 on a data mapping past it; A then
// writes its data there.
func (e *env) firstLeaseStageFormatsPastTheLease(ctx context.Context, req StageRequest, img, dev string) {
	t := e.t
	t.Helper()
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Method != fence.MethodLease || !res.Formatted || !strings.HasPrefix(res.Device, "/dev/loop") || res.Device == dev {
		t.Fatalf("stage on a blank disk: %+v %v", res, err)
	}
	raw, _ := os.ReadFile(img)
	if !bytes.HasPrefix(raw, []byte("VCOLEASE")) || blkid(t, res.Device, "TYPE") != "ext4" {
		t.Fatal("no lease area before the data, or no filesystem on the data mapping")
	}
	// The log says where the stage spent its time, the fence step in its
	// parts (docs/benchmarks.md reads them).
	if !fenceParts.MatchString(e.logs.String()) {
		t.Errorf("the stage's log gives no fence step in parts (choose, prepare, acquire):\n%s", e.logs)
	}
	os.WriteFile(filepath.Join(req.StagingPath, "a"), []byte("node-a's data"), 0o644)
	syncFS(req.StagingPath)
}

var fenceParts = regexp.MustCompile(`steps="open [^"]*, fence [0-9.]+[mµn]?s \(choose [0-9.]+[mµn]?s, prepare [0-9.]+[mµn]?s, acquire [0-9.]+[mµn]?s\), map `)

// refusedAtSightByB: B sees the disk appear: refused at once, read-only,
// DiskRefused naming A; no request needed. A's own agent does not refuse
// its own disk.
func refusedAtSightByB(ctx context.Context, a, b *env, devA, devB string) {
	t := b.t
	t.Helper()
	v, err := b.m.Classify(ctx, devEvent(t, devB))
	if err != nil || !v.Refuse || v.Holder != keyA || v.HolderNode != "node-a" || v.Method != fence.MethodLease {
		t.Fatalf("B's verdict on A's disk: %+v %v", v, err)
	}
	if err := uevent.SetReadOnly(devB, 0, 0, true); err != nil {
		t.Fatal(err)
	}
	b.m.Refused(uevent.Decision{Event: devEvent(t, devB), Verdict: v, ReadOnly: true, Received: time.Now(), Done: time.Now()})
	ev := b.event(events.DiskRefused)
	if ev.Device != devB || ev.HolderKey != uint64(keyA) || ev.HolderNode != "node-a" || !strings.Contains(ev.Message, "read-only") {
		t.Fatalf("refusal event: %+v", ev)
	}
	// A's own agent does not refuse its own disk.
	if v, err := a.m.Classify(ctx, devEvent(t, devA)); err != nil || v.Refuse {
		t.Fatalf("A's verdict on its own disk: %+v %v", v, err)
	}
}

// backFindsItsClaimLostToB: A's agent, started again, finds its claim of
// vol-l lost to B, announces it, sets the disk read-only and reports the
// volume lost.
func (e *env) backFindsItsClaimLostToB(ctx context.Context, devA string) {
	t := e.t
	t.Helper()
	e.start()
	e.m.Reconcile(ctx)
	fev := e.event(events.DiskFenced)
	if fev.Volume != "vol-l" || fev.HolderKey != uint64(keyB) {
		t.Fatalf("A's fenced event at start: %+v", fev)
	}
	if !deviceReadOnly(t, devA) {
		t.Fatal("A's disk is writable after its claim was found lost")
	}
	if st, _ := e.m.Stats(ctx, "vol-l", ""); !st.Abnormal || st.State != "lost" {
		t.Fatalf("A's volume is not abnormal with its claim lost: %+v", st)
	}
}

func TestForeignDiskWithoutReservationsNeedsTheOptIn(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	exec.Command("mkfs.ext4", "-q", dev).Run()
	req := e.stageReq("vol-f", img, "f")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "offers no fencing", "never formatted", "opt-in")
	raw, _ := os.ReadFile(img)
	if bytes.HasPrefix(raw, []byte("VCOLEASE")) || blkid(t, dev, "TYPE") != "ext4" {
		t.Fatal("a lease was written over a foreign filesystem")
	}
	req.AllowUnfenced = true
	if res, err := e.m.Stage(ctx, req); err != nil || res.Method != fence.MethodNone {
		t.Fatalf("opted-in stage: %+v %v", res, err)
	}
	if !strings.Contains(e.logs.String(), "WITHOUT fencing") {
		t.Fatal("the opt-in is not logged")
	}
}

// A claimed disk that goes away is marked missing (abnormal) at its
// remove uevent, without waiting for the periodic check; a remove of a
// disk the agent holds nothing of changes nothing.
func TestRemovedDiskMarksItsClaimMissing(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img, dev := loop(t, 64)
	req := e.stageReq("vol-r", img, "r")
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	_, other := loop(t, 16)
	gone := devEvent(t, other)
	gone.Action = "remove"
	e.m.Removed(gone)
	if st, _ := e.m.Stats(ctx, "vol-r", ""); st.Abnormal || st.State != "unfenced" {
		t.Fatalf("another disk's removal made the volume abnormal: %+v", st)
	}
	ev := devEvent(t, dev)
	ev.Action = "remove"
	e.m.Removed(ev)
	st, err := e.m.Stats(ctx, "vol-r", "")
	if err != nil || !st.Abnormal || st.State != "gone" || !strings.Contains(st.Message, "removed") {
		t.Fatalf("stats after the disk's removal: %+v %v", st, err)
	}
	if err := e.m.Unstage(ctx, "vol-r", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// On a lease disk LUKS2 sits past the lease area: the token is read there,
// through the stage's data mapping or, unstaged, a read-only mapping made
// for the read and detached after it.
func TestTokenOfAnEncryptedVolumeOnALeaseDisk(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	e.crypt = newHostLUKS(t)
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 64)
	req := encReq(e, "vol-lt", img, "lt")
	req.AllowUnfenced = false
	if res, err := e.m.Stage(ctx, req); err != nil || res.Method != fence.MethodLease || !res.Formatted {
		t.Fatalf("encrypted stage on a lease disk: %+v %v", res, err)
	}
	raw, _ := os.ReadFile(img)
	if !bytes.HasPrefix(raw, []byte("VCOLEASE")) || !bytes.HasPrefix(raw[lease.DataOffset:], []byte("LUKS\xba\xbe")) {
		t.Fatal("not the lease area and then LUKS2")
	}
	if err := e.m.Unstage(ctx, "vol-lt", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	loops := func() string { out, _ := exec.Command("losetup", "-a").Output(); return string(out) }
	before := strings.Count(loops(), "("+dev+")")
	tok, err := e.m.VolumeToken(ctx, "vol-lt", req.Locator)
	if err != nil || tok.Kind != ContentLUKS2 || !isWrapped(tok.Token) || !strings.HasPrefix(tok.Device, "/dev/loop") {
		t.Fatalf("token of the unstaged volume: %+v %v", tok, err)
	}
	if after := strings.Count(loops(), "("+dev+")"); after != before {
		t.Fatalf("the read-only mapping was left behind (%d mappings of the disk, were %d)", after, before)
	}
}

// The controller grants the disk's size; the volume on a lease disk is the
// data mapping past the lease area, so expansion checks the disk against
// required_bytes and grows the mapping, then the filesystem.
func TestExpandOfALeaseDiskGrowsTheDataMapping(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 320)
	req := e.stageReq("vol-lx", img, "lx")
	req.AllowUnfenced = false
	req.FsType = "xfs" // ext4 grows online only with CAP_SYS_RESOURCE, which containers may drop
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Method != fence.MethodLease || res.Device == dev {
		t.Fatalf("stage on a lease disk: %+v %v", res, err)
	}
	before, _ := e.m.Stats(ctx, "vol-lx", "")
	_, err = e.m.Expand(ctx, "vol-lx", "", 640<<20)
	wantCode(t, err, codes.FailedPrecondition, "has not reached this node")
	if err := os.Truncate(img, 640<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
		t.Fatalf("losetup -c: %v %s", err, out)
	}
	n, err := e.m.Expand(ctx, "vol-lx", req.StagingPath, 640<<20)
	if err != nil || n != 640<<20-lease.DataOffset {
		t.Fatalf("expand: %d %v; want %d", n, err, 640<<20-lease.DataOffset)
	}
	after, _ := e.m.Stats(ctx, "vol-lx", "")
	if after.TotalBytes < before.TotalBytes*3/2 {
		t.Fatalf("filesystem did not grow: %d -> %d bytes", before.TotalBytes, after.TotalBytes)
	}
	if err := e.m.Unstage(ctx, "vol-lx", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// A live holder loses its lease to a granted takeover (the controller says
// the disk left the holder's VM, but the platform still shows it there):
// its agent stops the volume's I/O, drains what was on the way down,
// including the disk's own page cache under the buffered data mapping,
// and only then marks its slot fenced, which ends the taker's wait. No
// write of the holder's lands after that mark.
func TestLiveLeaseHolderAcknowledgesAGrantedTakeover(t *testing.T) {
	needRoot(t)
	a := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, devA := loop(t, 64)
	_, devB := shared(t, img)
	t.Cleanup(func() { clearRO(devA); clearRO(devB) })

	reqA := a.stageReq("vol-ack", img, "ack")
	reqA.AllowUnfenced = false
	res, err := a.m.Stage(ctx, reqA)
	if err != nil || res.Method != fence.MethodLease {
		t.Fatalf("A's stage: %+v %v", res, err)
	}
	// Writes that went below the filesystem but not yet to the disk: the
	// file's pages are written into the data mapping (no flush), and the
	// buffered loop device keeps them as dirty pages of the disk.
	f, err := os.Create(filepath.Join(reqA.StagingPath, "late"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(bytes.Repeat([]byte("A's late write "), 1<<16)); err != nil {
		t.Fatal(err)
	}
	if err := unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER); err != nil {
		t.Fatal(err)
	}
	f.Close()

	// B takes over with the grant while A's agent runs and renews.
	var blog bytes.Buffer
	ld, err := lease.OpenDevice(devB)
	if err != nil {
		t.Fatal(err)
	}
	defer ld.Close()
	eb, err := lease.New(ld, lease.Config{Key: keyB, Node: nodeB, NodeName: "node-b", Disk: "vol-ack", Resolver: names, Timing: testTiming,
		Logger: slog.New(slog.NewTextHandler(&blog, nil))})
	if err != nil {
		t.Fatal(err)
	}
	grant := &fence.Grant{Disk: "vol-ack", Node: nodeB, Supersedes: []fence.Key{keyA}}
	if c, err := eb.Acquire(ctx, grant); err != nil || len(c.Preempted) != 1 {
		t.Fatalf("B's granted takeover: %+v %v", c, err)
	}
	defer eb.Release(ctx)
	if !strings.Contains(blog.String(), "superseded holder acknowledged the takeover") || !strings.Contains(blog.String(), "state=fenced") {
		t.Fatalf("B's takeover did not end on A's fenced mark (it waited for expiry):\n%s\nA's agent:\n%s", blog.String(), a.logs.String())
	}
	// The mark is on the disk now; what the volume's data area holds must
	// not change any more: flush every page cache of this host and
	// compare. (The lease area does change: B renews its slot.)
	before := sha256File(t, img)
	if err := exec.Command("sync").Run(); err != nil {
		t.Fatal(err)
	}
	if after := sha256File(t, img); after != before {
		t.Fatal("the disk changed after A's fenced mark: a write of A's landed after it acknowledged the takeover")
	}
	ev := a.event(events.DiskFenced)
	if ev.Volume != "vol-ack" || ev.HolderKey != uint64(keyB) {
		t.Fatalf("A's fenced event: %+v", ev)
	}
	if !deviceReadOnly(t, devA) {
		t.Fatal("A's disk is writable again after its fenced mark")
	}
	if err := a.m.Unstage(ctx, "vol-ack", reqA.StagingPath); err != nil {
		t.Fatal(err)
	}
	// The drain set the data mapping read-only; a loop device keeps that
	// flag after its detach, and its next user must not inherit it.
	if ro, err := os.ReadFile("/sys/block/" + filepath.Base(res.Device) + "/ro"); err != nil || strings.TrimSpace(string(ro)) != "0" {
		t.Fatalf("the detached data mapping %s is left read-only (ro=%q, %v)", res.Device, ro, err)
	}
}

// sha256File hashes the data area of a lease disk image, past its lease
// area.
func sha256File(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b[lease.DataOffset:])
}

// A raw block volume is grown on the node like a filesystem one, less the
// filesystem: the pod's device node is the pod device over the data
// mapping past the lease area (a lease disk), the dm-crypt mapping
// (encrypted; a loop device stands in for dm-crypt, which this host
// lacks) or the disk itself.
// After the disk has grown, expansion grows every mapping in between and
// the device the pod sees has the new size; with no mapping in between it
// changes nothing and reports the disk's size.
func TestExpandOfARawBlockVolumeGrowsTheDeviceThePodSees(t *testing.T) {
	needRoot(t)
	for _, tc := range []rawBlockCase{
		{name: "unfenced"},
		{name: "lease", lease: true},
		{name: "encrypted", encrypted: true},
		{name: "encrypted-lease", lease: true, encrypted: true},
	} {
		t.Run(tc.name, func(t *testing.T) { expandRawBlockVolume(t, tc) })
	}
}

// rawBlockCase is a raw block volume on a lease disk or not, encrypted or
// not.
type rawBlockCase struct {
	name             string
	lease, encrypted bool
}

// meta is what lies before the volume's data on its disk: the lease area,
// the LUKS2 header, both or neither.
func (tc rawBlockCase) meta() int64 {
	const header = 16 << 20 // the LUKS2 header before an encrypted volume's data
	var meta int64
	if tc.lease {
		meta += lease.DataOffset
	}
	if tc.encrypted {
		meta += header
	}
	return meta
}

// expandRawBlockVolume stages and publishes a 64 MiB raw block volume of
// case tc, then grows its disk to 128 MiB and expands it: the pod's device
// holds the disk less tc.meta() before and after, stats agree, an
// encrypted volume's mapping is resized once per expansion.
func expandRawBlockVolume(t *testing.T, tc rawBlockCase) {
	var fencing FencerFactory // none: the node's key, no lease
	if tc.lease {
		fencing = leaseFencing(nodeA, "node-a")
	}
	e := newEnvWith(t, fencing)
	var crypt *hostLUKS
	if tc.encrypted {
		crypt = newHostLUKS(t)
		e.crypt = crypt
	}
	e.start()
	ctx := context.Background()
	img, dev := loop(t, 64)
	req, target := e.stageAndPublishRawBlock(ctx, tc, img, dev)
	meta := tc.meta()
	if n, err := deviceSize(target); err != nil || n != 64<<20-meta {
		t.Fatalf("the pod's device holds %d bytes (%v), want %d", n, err, 64<<20-meta)
	}
	// Nothing grown yet: a no-op that reports the size.
	if n, err := e.m.Expand(ctx, "vol-rb", target, 64<<20); err != nil || n != 64<<20-meta {
		t.Fatalf("expand at the same size: %d %v; want %d", n, err, 64<<20-meta)
	}
	if err := os.Truncate(img, 128<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
		t.Fatalf("losetup -c: %v %s", err, out)
	}
	n, err := e.m.Expand(ctx, "vol-rb", target, 128<<20)
	if err != nil || n != 128<<20-meta {
		t.Fatalf("expand: %d %v; want %d", n, err, 128<<20-meta)
	}
	if got, err := deviceSize(target); err != nil || got != n {
		t.Fatalf("the pod's device holds %d bytes after the expansion (%v), want %d", got, err, n)
	}
	if st, err := e.m.Stats(ctx, "vol-rb", target); err != nil || !st.Block || st.TotalBytes != n {
		t.Fatalf("stats after the expansion: %+v %v", st, err)
	}
	if tc.encrypted && resized(crypt) != 2 {
		t.Fatalf("the dm-crypt mapping was resized %d times, want once per expansion", resized(crypt))
	}
	if err := e.m.Unpublish(ctx, "vol-rb", target); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// stageAndPublishRawBlock stages vol-rb of case tc on img (dev) as a raw
// block volume, on a mapping of its own unless unfenced and plain, and
// publishes it to the pod's device path, which it returns with the
// request.
func (e *env) stageAndPublishRawBlock(ctx context.Context, tc rawBlockCase, img, dev string) (StageRequest, string) {
	t := e.t
	t.Helper()
	req := e.stageReq("vol-rb", img, "rb")
	if tc.encrypted {
		req = encReq(e, "vol-rb", img, "rb")
	}
	req.Block, req.FsType, req.AllowUnfenced = true, "", !tc.lease
	req.StagingPath = e.blockStaging("rb")
	res, err := e.m.Stage(ctx, req)
	if err != nil || (res.Device == dev) != (!tc.lease && !tc.encrypted) {
		t.Fatalf("stage: %+v %v", res, err)
	}
	target := e.blockTarget("rb", "p")
	if err := e.m.Publish(ctx, PublishRequest{Volume: "vol-rb", StagingPath: req.StagingPath, TargetPath: target, Block: true}); err != nil {
		t.Fatal(err)
	}
	return req, target
}

// TestRefusedLeaseStageKeepsNoDescriptorOpen: a stage refused because
// another node holds the lease leaves no descriptor of the disk open,
// however often the node plugin retries it (each refusal used to keep
// the lease fencer's O_DIRECT descriptor).
func TestRefusedLeaseStageKeepsNoDescriptorOpen(t *testing.T) {
	needRoot(t)
	a := fencedLeaseEnv(t, nodeA, "node-a")
	b := fencedLeaseEnv(t, nodeB, "node-b")
	ctx := context.Background()
	img, devA := loop(t, 64)
	linkB, devB := shared(t, img)
	t.Cleanup(func() { clearRO(devA); clearRO(devB) })
	reqA := a.stageReq("vol-d", img, "d")
	reqA.AllowUnfenced = false
	if _, err := a.m.Stage(ctx, reqA); err != nil {
		t.Fatal(err)
	}
	reqB := b.stageReq("vol-d", linkB, "d")
	reqB.AllowUnfenced = false
	before := openOn(t, devB)
	for range 3 {
		_, err := b.m.Stage(ctx, reqB)
		wantCode(t, err, codes.FailedPrecondition, "node-a")
	}
	if n := openOn(t, devB); n != before {
		t.Fatalf("%d descriptors of %s open after three refused stages, %d before", n, devB, before)
	}
}

// openOn counts this process's descriptors open on the device node dev.
func openOn(t *testing.T, dev string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && l == dev {
			n++
		}
	}
	return n
}

// TestALookAtABlankDiskProvesNothing: the uevent watcher's Classify and
// a listing read a blank disk's lease layout and no more (LookOnly): no
// blank proof, no blkid. The watcher classifies under the lock a stage
// records its claim under, so a disk hot-plugged for a stage used to be
// proven twice, the stage's proof waiting for the watcher's. The stage
// still proves it: data past the first MiB, which the layout read does
// not see, keeps the disk from being formatted.
func TestALookAtABlankDiskProvesNothing(t *testing.T) {
	needRoot(t)
	e := fencedLeaseEnv(t, nodeA, "node-a")
	ctx := context.Background()
	img, dev := loop(t, 64)
	t.Cleanup(func() { clearRO(dev) })
	data := []byte("data the layout read does not see")
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(data, 2<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	runs := blkidRuns(t)

	v, err := e.m.Classify(ctx, devEvent(t, dev))
	if err != nil || v.Refuse || v.Method != fence.MethodLease {
		t.Fatalf("the watcher's verdict on a blank disk: %+v %v", v, err)
	}
	if got := runs(); len(got) > 0 {
		t.Fatalf("the watcher's look at a blank disk ran blkid: %q", got)
	}

	req := e.stageReq("vol-b", img, "b")
	req.AllowUnfenced = false
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "offers no fencing", "non-zero data at byte 2097152")
	if len(runs()) == 0 {
		t.Fatal("the stage formatted nothing, but without running blkid: its blank proof did not run")
	}
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.HasPrefix(raw, []byte(blank.LeaseMagic)) || !bytes.Equal(raw[2<<20:2<<20+len(data)], data) {
		t.Fatal("the refused stage wrote on the disk")
	}
}

// blkidRuns puts a blkid on PATH that notes the arguments of each run in
// a file before it runs the real one, and returns a reader of the runs.
func blkidRuns(t *testing.T) func() []string {
	t.Helper()
	real, err := exec.LookPath("blkid")
	if err != nil {
		t.Skip("no blkid here")
	}
	bin := t.TempDir()
	runs := filepath.Join(bin, "runs")
	script := fmt.Sprintf("#!/bin/sh\necho \"$@\" >> %s\nexec %s \"$@\"\n", runs, real)
	if err := os.WriteFile(filepath.Join(bin, "blkid"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	return func() []string {
		b, _ := os.ReadFile(runs)
		os.Remove(runs)
		return strings.Fields(strings.ReplaceAll(strings.TrimSpace(string(b)), " ", "_"))
	}
}

// A disk whose first block is zeros is proven blank before anything is
// written; when blkid cannot answer (here it fails as on an ambivalent
// probe, exit status 8) the proof proves nothing, but data the lease's
// layout read finds (a btrfs superblock at 64 KiB) still makes the disk
// foreign: refused for good (FAILED_PRECONDITION, naming it), not a
// retryable failure of the proof, and nothing is written to it. A blank
// disk under the same blkid is no refusal: it stays unstaged, retryable.
func TestDiskBlkidCannotTellIsStillForeign(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "blkid"), []byte("#!/bin/sh\necho ambivalent result >&2\nexit 8\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))

	img, dev := loop(t, 64)
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteAt([]byte("_BHRfS_M"), 0x10000+64)
	f.Sync()
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	before := sha256File(t, img)
	req := e.stageReq("vol-amb", img, "amb")
	req.AllowUnfenced = false
	_, err = e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "vol-amb", "btrfs superblock", "not a lease area", "opt-in")
	if sha256File(t, img) != before {
		t.Fatal("the refused stage changed the disk")
	}

	img2, _ := loop(t, 64)
	req2 := e.stageReq("vol-blank", img2, "blank")
	req2.AllowUnfenced = false
	_, err = e.m.Stage(ctx, req2)
	wantCode(t, err, codes.Unavailable, "vol-blank", "blkid")
	if raw, _ := os.ReadFile(img2); bytes.HasPrefix(raw, []byte(blank.LeaseMagic)) {
		t.Fatal("a lease area was written on a disk blkid could not prove blank")
	}
}

// Two nodes given the same blank disk race its first stage: the other
// node's lease area lands between this stage's read of the first block
// and its blank proof, which then finds it. It is a lease area, used as it
// is (not this node's format, nor foreign data that would fail the stage):
// nobody holds it yet, so this stage acquires it and makes its filesystem
// past it.
func TestStageUsesALeaseAreaWrittenDuringItsProof(t *testing.T) {
	needRoot(t)
	e := newEnvWith(t, leaseFencing(nodeA, "node-a"))
	ctx := context.Background()
	img, dev := loop(t, 64)
	raced := false
	testHookBeforeStageProof = func(path string) {
		testHookBeforeStageProof = nil
		other, err := lease.OpenDevice(dev)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		if wrote, err := lease.Format(ctx, other, lease.FormatOptions{Key: keyB, Timeout: time.Second}); err != nil || !wrote {
			t.Fatalf("the other node's format: %v %v", wrote, err)
		}
		raced = true
	}
	t.Cleanup(func() { testHookBeforeStageProof = nil })
	req := e.stageReq("vol-race", img, "race")
	req.AllowUnfenced = false
	res, err := e.m.Stage(ctx, req)
	if !raced || err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage raced by another node's format (raced %v): %+v %v; want the lease, on the other node's lease area", raced, res, err)
	}
	d, err := lease.OpenDevice(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	b, err := d.ReadArea(ctx, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := lease.DecodeHeader(b[:lease.BlockSize]); err != nil || h.Creator != keyB {
		t.Fatalf("header after the race: %+v %v; want the other node's (creator %s)", h, err, keyB)
	}
	if err := e.m.Unstage(ctx, "vol-race", req.StagingPath); err != nil {
		t.Fatal(err)
	}
}

// An agent that does not claim disks with the lease (volumes.fence_methods
// without disk-lease) stages a blank disk without reservations only by the
// unfenced opt-in, writing no lease area; a look at a disk another node
// holds by its lease still sees that holder.
func TestAgentWithoutTheLeaseStagesOnlyByTheOptIn(t *testing.T) {
	needRoot(t)
	f := leaseFencing(nodeA, "node-a")
	f.Use = func(m fence.Method) bool { return m == fence.MethodPR }
	e := newEnvWith(t, f)
	ctx := context.Background()
	img, dev := loop(t, 64)
	req := e.stageReq("vol-n", img, "n")
	req.AllowUnfenced = false
	_, err := e.m.Stage(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "offers no fencing", "does not use the on-disk lease (volumes.fence_methods)", "opt-in")
	req.AllowUnfenced = true
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Method != fence.MethodNone || !res.Formatted {
		t.Fatalf("opted-in stage of a blank disk: %+v %v", res, err)
	}
	if raw, _ := os.ReadFile(img); bytes.HasPrefix(raw, []byte("VCOLEASE")) || blkid(t, dev, "TYPE") != "ext4" {
		t.Fatal("the disk got a lease area, or no filesystem, from an agent that does not use the lease")
	}
	if err := e.m.Unstage(ctx, "vol-n", req.StagingPath); err != nil {
		t.Fatal(err)
	}

	// Node B, which uses the lease, holds another disk; A, given the
	// same disk, refuses it naming B.
	b := fencedLeaseEnv(t, nodeB, "node-b")
	imgB, _ := loop(t, 64)
	if _, err := b.m.Stage(ctx, b.stageReq("vol-b", imgB, "b")); err != nil {
		t.Fatal(err)
	}
	_, devA := shared(t, imgB)
	if v, err := e.m.Classify(ctx, devEvent(t, devA)); err != nil || !v.Refuse || v.Holder != keyB || v.Method != fence.MethodLease {
		t.Fatalf("the verdict of an agent without the lease on a disk B holds by its lease: %+v %v", v, err)
	}
}
