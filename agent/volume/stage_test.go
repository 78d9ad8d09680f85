package volume

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// The stage's rollback, tested without root. What needs root (opening a
// block device, a loop device over the data region, dm-crypt, mounts) is
// done by stand-ins that write what they do to one journal and fail where
// the test says; everything else is the manager's own code: the claim
// store, the lease area check, blkid and fsck on a filesystem image, the
// staging directory. The tests with real devices are in volume_test.go and
// the others.

var errInjected = errors.New("injected failure")

// stageHost is the node for the stage tests: the release guard's proof
// looks at the stand-in mounter's mounts (the disk is an image file, which
// the real proof refuses as no block device).
type stageHost struct {
	osHost
	mounts map[string]string
}

// MapsDisk: the fake data mapping (mapData's "data-mapping" file) maps
// whatever disk the stage opened.
func (h stageHost) MapsDisk(p, _ string) bool    { return filepath.Base(p) == "data-mapping" }
func (h stageHost) MapsDiskNow(p, _ string) bool { return filepath.Base(p) == "data-mapping" }

func (h stageHost) InUse(u usage) error {
	for _, p := range u.Paths {
		if _, ok := h.mounts[p]; ok {
			return &inuse.Error{Device: u.Disk, What: "it is mounted at " + p}
		}
	}
	return nil
}

// withMounter puts mt in the place of the manager's mounter; every other
// effect on the node stays the host's own.
func withMounter(m *Manager, mt mounter) {
	h := m.host.(osHost)
	h.mounter = mt
	m.host = h
}

// journal is what the stand-ins did, in order; a failed call ends in "!".
type journal struct {
	calls  []string
	failAt string
}

func (j *journal) do(call string) error {
	if call == j.failAt {
		j.calls = append(j.calls, call+"!")
		return fmt.Errorf("%s: %w", call, errInjected)
	}
	j.calls = append(j.calls, call)
	return nil
}

// fakeFencer takes and gives back a fence that exists only in the
// journal; held makes it find the disk held by another node.
type fakeFencer struct {
	j    *journal
	held bool
}

func (f *fakeFencer) Probe(context.Context) (fence.Support, error) {
	return fence.Support{Method: fence.MethodLease}, nil
}
func (f *fakeFencer) Acquire(context.Context, *fence.Grant) (fence.Acquired, error) {
	if f.held {
		f.j.calls = append(f.j.calls, "acquire: held")
		return fence.Acquired{}, &fence.HeldError{Device: "fake0", Holder: 0x6e6f6465, HolderNode: "node-b"}
	}
	return fence.Acquired{Method: fence.MethodLease, Key: 0x7663}, f.j.do("acquire")
}
func (f *fakeFencer) Release(context.Context) error { return f.j.do("release") }
func (f *fakeFencer) Check(context.Context) error   { return nil }
func (f *fakeFencer) Close() error                  { return f.j.do("close fencer") }
func (f *fakeFencer) Choose(context.Context, *Device, string, func(*fence.LostError) bool) (Choice, error) {
	// A fencing method that keeps metadata before the data, as the
	// lease does, so that the stage maps the data region.
	return Choice{Fencer: f, Method: fence.MethodLease, DataOffset: 1 << 20}, nil
}

// fakeCrypt maps an encrypted volume onto a filesystem image.
type fakeCrypt struct {
	j     *journal
	plain string
}

func (f *fakeCrypt) Inspect(context.Context, string) (Content, error) {
	return Content{Kind: ContentLUKS2}, nil
}
func (f *fakeCrypt) Format(context.Context, blank.Proof, []byte, luks2.TransitToken) error {
	return errors.New("the stage tests format nothing")
}
func (f *fakeCrypt) Open(context.Context, string, string, []byte, bool) (Mapped, error) {
	return Mapped{Path: f.plain, Reader: "fake"}, f.j.do("unlock")
}
func (f *fakeCrypt) Close(context.Context, string) error  { return f.j.do("lock") }
func (f *fakeCrypt) Resize(context.Context, string) error { return nil }

// fakeMounter keeps its mounts in a map. hook runs after a mount.
type fakeMounter struct {
	j      *journal
	mounts map[string]string
	hook   func()
}

func (f *fakeMounter) Mount(source, target, _ string, _ []string) error {
	if err := f.j.do("mount"); err != nil {
		return err
	}
	f.mounts[target] = source
	if f.hook != nil {
		f.hook()
	}
	return nil
}
func (f *fakeMounter) Unmount(target string) error {
	if _, ok := f.mounts[target]; !ok {
		return nil
	}
	delete(f.mounts, target)
	return f.j.do("unmount")
}
func (f *fakeMounter) IsMountPoint(p string) (bool, error) {
	_, ok := f.mounts[p]
	return ok, nil
}
func (f *fakeMounter) List() ([]mount.MountPoint, error) {
	var mps []mount.MountPoint
	for p, d := range f.mounts {
		mps = append(mps, mount.MountPoint{Path: p, Device: d})
	}
	return mps, nil
}

type stageEnv struct {
	m       *Manager
	j       *journal
	mounter *fakeMounter
	fencer  *fakeFencer
	dev     *Device // the disk the last stage opened
	kubelet string
}

func newStageEnv(t *testing.T) *stageEnv {
	t.Helper()
	hosttest.NeedTools(t, "blkid", "mkfs.ext4", "fsck")
	dir := t.TempDir()
	e := &stageEnv{j: &journal{}, kubelet: filepath.Join(dir, "kubelet")}
	disk := filepath.Join(dir, "disk.img")
	plain := filepath.Join(dir, "plain.img") // what the unlocked volume shows
	if err := os.MkdirAll(e.kubelet, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{disk, plain} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(f, 16<<20); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", plain).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v: %s", plain, err, out)
	}
	e.fencer = &fakeFencer{j: e.j}
	m, err := New(Options{Config: config.Volumes{KubeletRoot: e.kubelet}, StateDir: filepath.Join(dir, "state"),
		Fencers: e.fencer, Crypt: &fakeCrypt{j: e.j, plain: plain}, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	e.m = m
	e.mounter = &fakeMounter{j: e.j, mounts: map[string]string{}}
	withMounter(m, e.mounter)
	m.host = stageHost{osHost: m.host.(osHost), mounts: e.mounter.mounts}
	m.locate = func(context.Context, Locator) (*Device, error) {
		if err := e.j.do("locate"); err != nil {
			return nil, err
		}
		f, err := os.Open(disk)
		if err != nil {
			return nil, err
		}
		e.dev = &Device{Path: disk, Name: "fake0", Major: 7, Minor: 250, File: f, Verify: func(context.Context) error { return nil }}
		return e.dev, nil
	}
	m.mapData = func(string, int64, bool) (string, error) {
		return filepath.Join(dir, "data-mapping"), e.j.do("map")
	}
	m.unmapData = func(string) error { return e.j.do("unmap") }
	return e
}

func (e *stageEnv) request(volume string) StageRequest {
	return StageRequest{Volume: volume, Locator: Locator{Disk: discovery.Locator{Serial: "fake0"}}, StagingPath: kubeletpath.Staging(e.kubelet, testDriver, volume),
		Encrypted: true, Passphrase: []byte("not a secret")}
}

// diskClosed reports whether the stage closed the disk it opened.
func (e *stageEnv) diskClosed() bool {
	_, err := e.dev.File.Stat()
	return errors.Is(err, os.ErrClosed)
}

// staged is the journal of a stage that gets through every step.
var staged = []string{"locate", "acquire", "map", "unlock", "mount"}

// TestStageFailingAtEachStepUndoesWhatCameBefore fails each step of a
// first stage in turn: every earlier step's undo runs, last first,
// nothing after the failure runs, the disk is closed and nothing of the
// volume is left recorded or live.
func TestStageFailingAtEachStepUndoesWhatCameBefore(t *testing.T) {
	undone := []string{"unmount", "lock", "unmap", "release", "close fencer"}
	for _, tc := range []struct {
		failAt string
		want   []string
	}{
		{"locate", []string{"locate!"}},
		// An acquire that fails of itself may have taken the fence
		// before its answer was lost: it is given back.
		{"acquire", []string{"locate", "acquire!", "release", "close fencer"}},
		{"map", []string{"locate", "acquire", "map!", "release", "close fencer"}},
		{"unlock", []string{"locate", "acquire", "map", "unlock!", "unmap", "release", "close fencer"}},
		{"mount", []string{"locate", "acquire", "map", "unlock", "mount!", "lock", "unmap", "release", "close fencer"}},
		// The record is the last step: its failure undoes all the others.
		{"record", append(slices.Clone(staged), undone...)},
	} {
		t.Run(tc.failAt, func(t *testing.T) {
			e := newStageEnv(t)
			if tc.failAt == "record" {
				e.failRecord("vol-r")
			} else {
				e.j.failAt = tc.failAt
			}
			_, err := e.m.Stage(context.Background(), e.request("vol-r"))
			wantErr := errInjected.Error()
			if tc.failAt == "record" {
				wantErr = "is a symlink"
			}
			if !strings.Contains(fmt.Sprint(err), wantErr) {
				t.Fatalf("the stage failing at %s answered %v, not %q", tc.failAt, err, wantErr)
			}
			if !slices.Equal(e.j.calls, tc.want) {
				t.Fatalf("failing at %s:\n got %v\nwant %v", tc.failAt, e.j.calls, tc.want)
			}
			if e.dev != nil && !e.diskClosed() {
				t.Error("the disk is still open after the failed stage")
			}
			if l := e.m.getLive("vol-r"); l != nil {
				t.Errorf("the failed stage left the volume live: %+v", l)
			}
			if c, err := e.m.store.Get("vol-r"); err != nil || c != nil {
				t.Errorf("a first stage that wrote nothing on the disk left a record: %+v, %v", c, err)
			}
		})
	}
}

// failRecord makes the stage's last write of the claim fail: once the
// volume is mounted, its record is a symlink, which the store refuses to
// replace.
func (e *stageEnv) failRecord(volume string) {
	e.mounter.hook = func() {
		p := e.m.store.file(volume)
		if err := os.Remove(p); err != nil {
			panic(err)
		}
		if err := os.Symlink(p+".elsewhere", p); err != nil {
			panic(err)
		}
	}
}

// TestStageThatGetsThroughUndoesNothing: a stage that succeeds keeps the
// disk open and live, the claim recorded staged.
func TestStageThatGetsThroughUndoesNothing(t *testing.T) {
	e := newStageEnv(t)
	res, err := e.m.Stage(context.Background(), e.request("vol-s"))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(e.j.calls, staged) {
		t.Fatalf("got %v, want %v", e.j.calls, staged)
	}
	if e.diskClosed() || e.m.getLive("vol-s") == nil {
		t.Error("the staged volume's disk is not held open")
	}
	c, err := e.m.store.Get("vol-s")
	if err != nil || c == nil || c.Phase != PhaseStaged || c.Mapper != res.Device || c.DataDevice == "" {
		t.Fatalf("record of the staged volume: %+v, %v (result %+v)", c, err, res)
	}
	// A retry of the intact stage answers as the stage did, doing nothing.
	e.j.calls = nil
	again, err := e.m.Stage(context.Background(), e.request("vol-s"))
	if err != nil || again.Device != res.Device || again.Method != res.Method || len(e.j.calls) > 0 {
		t.Fatalf("retried stage: %+v %v (first %+v), did %v", again, err, res, e.j.calls)
	}
}

// TestInterruptedStageKeepsItsRecord: a stage retried after one that made
// the volume's filesystem fails at the mount; everything it did is undone,
// the data mapping too (the release guard gives the fence up only with no
// mapping over the disk), and the claim stays recorded as interrupted, for
// the next retry (which must not format again), naming no data mapping
// (the one detached may be another volume's by then).
func TestInterruptedStageKeepsItsRecord(t *testing.T) {
	e := newStageEnv(t)
	r := e.request("vol-i")
	if err := e.m.store.Put(&Claim{Volume: r.Volume, Locator: r.Locator, StagingPath: r.StagingPath, FsType: "ext4",
		Encrypted: true, Phase: PhaseInterrupted, Formatted: true, LUKSFormatted: true}); err != nil {
		t.Fatal(err)
	}
	e.j.failAt = "mount"
	if _, err := e.m.Stage(context.Background(), r); !strings.Contains(fmt.Sprint(err), errInjected.Error()) {
		t.Fatalf("stage: %v", err)
	}
	want := []string{"locate", "acquire", "map", "unlock", "mount!", "lock", "unmap", "release", "close fencer"}
	if !slices.Equal(e.j.calls, want) {
		t.Fatalf("got %v, want %v", e.j.calls, want)
	}
	c, err := e.m.store.Get(r.Volume)
	if err != nil || c == nil || c.Phase != PhaseInterrupted || !c.Formatted || c.DataDevice != "" || c.Mapper != "" {
		t.Fatalf("record after the failed retry: %+v, %v", c, err)
	}
}

// TestRefusedStageLetsGoOfItsFencer: a stage refused because another node
// holds the disk (P2) closes what its fencer holds open (the lease's
// descriptor of the disk), as every failed stage does; the node plugin
// retries a refused stage, and each refusal used to keep one more
// descriptor open.
func TestRefusedStageLetsGoOfItsFencer(t *testing.T) {
	e := newStageEnv(t)
	e.fencer.held = true
	_, err := e.m.Stage(context.Background(), e.request("vol-h"))
	if agenterr.Code(err) != codes.FailedPrecondition || !strings.Contains(fmt.Sprint(err), "node-b") {
		t.Fatalf("refused stage answered %v", err)
	}
	want := []string{"locate", "acquire: held", "close fencer"}
	if !slices.Equal(e.j.calls, want) {
		t.Fatalf("got %v, want %v", e.j.calls, want)
	}
	if !e.diskClosed() {
		t.Error("the refused disk is still open")
	}
}

// TestUnstageTakesTheStageBackInReverse: an unstage undoes what the stage
// did, last first, as a failed stage does; a release that fails stops it
// with the claim still recorded staged, and the retry finishes it.
func TestUnstageTakesTheStageBackInReverse(t *testing.T) {
	e := newStageEnv(t)
	r := e.request("vol-u")
	ctx := context.Background()
	if _, err := e.m.Stage(ctx, r); err != nil {
		t.Fatal(err)
	}
	e.j.calls, e.j.failAt = nil, "release"
	if err := e.m.Unstage(ctx, r.Volume, r.StagingPath); agenterr.Code(err) != codes.Unavailable {
		t.Fatalf("unstage whose release fails answered %v", err)
	}
	if want := []string{"unmount", "lock", "unmap", "release!"}; !slices.Equal(e.j.calls, want) {
		t.Fatalf("got %v, want %v", e.j.calls, want)
	}
	if c, err := e.m.store.Get(r.Volume); err != nil || c == nil || c.Phase != PhaseStaged || c.Mapper != "" {
		t.Fatalf("record after the failed release: %+v, %v", c, err)
	}
	e.j.calls, e.j.failAt = nil, ""
	if err := e.m.Unstage(ctx, r.Volume, r.StagingPath); err != nil {
		t.Fatal(err)
	}
	// The encrypted volume's mapping is closed by its name again (a
	// mapping the record does not name is closed too); the data mapping
	// the first attempt detached is no longer recorded, so not detached
	// again (its number may be another volume's by now).
	if want := []string{"lock", "release", "close fencer"}; !slices.Equal(e.j.calls, want) {
		t.Fatalf("retry: got %v, want %v", e.j.calls, want)
	}
	if c, err := e.m.store.Get(r.Volume); err != nil || c != nil || !e.diskClosed() {
		t.Fatalf("after the unstage: record %+v (%v), disk closed %v", c, err, e.diskClosed())
	}
}

// funcFencer is a fencer of a type Go cannot compare (it holds a func),
// as test wrappers such as watchedFencer are: the rollback must not
// compare fencers.
type funcFencer struct {
	*fakeFencer
	note func()
}

type funcFencers struct{ f *fakeFencer }

func (ff funcFencers) Choose(ctx context.Context, dev *Device, v string, onLost func(*fence.LostError) bool) (Choice, error) {
	ch, err := ff.f.Choose(ctx, dev, v, onLost)
	ch.Fencer = funcFencer{fakeFencer: ff.f, note: func() {}}
	return ch, err
}

// TestFailedStageUndoesAFencerOfAnyType: failing before and after the
// claim goes live, with a fencer that cannot be compared.
func TestFailedStageUndoesAFencerOfAnyType(t *testing.T) {
	for failAt, want := range map[string][]string{
		"acquire": {"locate", "acquire!", "release", "close fencer"},
		"map":     {"locate", "acquire", "map!", "release", "close fencer"},
	} {
		e := newStageEnv(t)
		e.m.o.Fencers = funcFencers{f: e.fencer}
		e.j.failAt = failAt
		if _, err := e.m.Stage(context.Background(), e.request("vol-f")); err == nil {
			t.Fatalf("failing at %s: the stage succeeded", failAt)
		}
		if !slices.Equal(e.j.calls, want) {
			t.Errorf("failing at %s: got %v, want %v", failAt, e.j.calls, want)
		}
	}
}

// TestStagedLogSaysWhereTheTimeWent: the "volume staged" line names each
// step with its duration, in the stage's order, so that an operator (and
// docs/benchmarks.md) can tell where a slow stage spent its time.
func TestStagedLogSaysWhereTheTimeWent(t *testing.T) {
	e := newStageEnv(t)
	var buf bytes.Buffer
	e.m.log = slog.New(slog.NewJSONHandler(&buf, nil))
	if _, err := e.m.Stage(context.Background(), e.request("vol-t")); err != nil {
		t.Fatal(err)
	}
	var steps string
	for line := range strings.Lines(buf.String()) {
		var rec struct{ Msg, Steps string }
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec.Msg == "volume staged" {
			steps = rec.Steps
		}
	}
	// The fence step's parts follow its total.
	names := regexp.MustCompile(`^open \S+, fence \S+ \(choose \S+, prepare \S+, acquire \S+\), map \S+, unlock \S+, pod \S+, mount \S+$`)
	if !names.MatchString(steps) {
		t.Fatalf("the volume staged line's steps are %q; want each step with its duration, in order", steps)
	}
	for _, d := range regexp.MustCompile(`(\w+) ([^ ,()]+)`).FindAllStringSubmatch(steps, -1) {
		if _, err := time.ParseDuration(d[2]); err != nil {
			t.Errorf("step %q: its duration does not parse: %v", d[1], err)
		}
	}
}

// TestStageWaitsForADiskStillBeingAttached: a disk that appears while the
// stage waits (volumes.attach_wait) is staged by that call; past the wait,
// or with none, the stage answers NOT_FOUND, and a caller that gives up
// ends the wait.
func TestStageWaitsForADiskStillBeingAttached(t *testing.T) {
	e := newStageEnv(t)
	found := e.m.locate
	absent := 0 // calls that still find no disk
	e.m.locate = func(ctx context.Context, loc Locator) (*Device, error) {
		if absent > 0 {
			absent--
			return nil, agenterr.New(agenterr.NotFound, "disk not found: looked for serial %s; is the disk attached to this node?", loc.Disk.Serial)
		}
		return found(ctx, loc)
	}
	ctx := context.Background()

	absent = 1
	_, err := e.m.Stage(ctx, e.request("vol-now"))
	wantCode(t, err, codes.NotFound, "vol-now", "is the disk attached")

	e.m.o.Config.AttachWait = 5 * time.Second
	absent = 5
	start := time.Now()
	if _, err := e.m.Stage(ctx, e.request("vol-late")); err != nil || absent != 0 {
		t.Fatalf("a disk that appeared after 5 looks: %v (%d looks left)", err, absent)
	}
	if took := time.Since(start); took < 4*attachPoll {
		t.Errorf("the stage looked 6 times in %s, not every %s", took, attachPoll)
	}

	e.m.o.Config.AttachWait = 300 * time.Millisecond
	absent = 1 << 20
	_, err = e.m.Stage(ctx, e.request("vol-never"))
	wantCode(t, err, codes.NotFound, "vol-never")

	e.m.o.Config.AttachWait = time.Hour
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = e.m.Stage(cctx, e.request("vol-gone"))
	wantCode(t, err, codes.NotFound, "vol-gone")
	if cctx.Err() == nil {
		t.Fatal("the stage answered before its caller gave up")
	}
}

// TestAWaitingStageLooksWhenTheWatcherSawADisk: a stage waiting for its
// hot-plugged disk looks again as soon as the uevent watcher has decided
// about a disk, not at its next poll (here an hour away).
func TestAWaitingStageLooksWhenTheWatcherSawADisk(t *testing.T) {
	e := newStageEnv(t)
	e.m.o.Config.AttachWait = time.Hour
	e.m.attachPoll = time.Hour
	found := e.m.locate
	var present atomic.Bool
	looked := make(chan bool, 16) // each look, and whether it found the disk
	e.m.locate = func(ctx context.Context, loc Locator) (*Device, error) {
		there := present.Load()
		looked <- there
		if !there {
			return nil, agenterr.New(agenterr.NotFound, "disk not found: looked for serial %s", loc.Disk.Serial)
		}
		return found(ctx, loc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := e.m.Stage(ctx, e.request("vol-plugged"))
		done <- err
	}()
	if <-looked {
		t.Fatal("the first look found the disk before it was there")
	}
	present.Store(true)
	e.m.Refused(uevent.Decision{Event: uevent.Event{Action: "add", Subsystem: "block", DevName: "fake0", Major: 7, Minor: 250}})
	if err := <-done; err != nil {
		t.Fatalf("the stage woken by the watcher's decision: %v", err)
	}
	close(looked)
	var after []bool
	for there := range looked {
		after = append(after, there)
	}
	if len(after) != 1 || !after[0] {
		t.Fatalf("after the watcher's decision the stage looked %v (found the disk or not), want once, finding it", after)
	}
}
