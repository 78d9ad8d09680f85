package volume

// Directed reproductions over the manager simulation's modelled node
// (sim_test.go): the same manager code, with no random faults, but with a
// host whose calls a test can hold or fail at a chosen point, so that two
// calls of the kubelet interleave as the test says.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// hookHost is the simulation's host with hooks run before a mount or an
// mkfs; a hook's error is the call's.
type hookHost struct {
	simHost
	beforeMount func(source, target string) error
	beforeMkfs  func(p blank.Proof) error
}

func (h hookHost) Mount(source, target, fstype string, opts []string) error {
	if h.beforeMount != nil {
		if err := h.beforeMount(source, target); err != nil {
			return err
		}
	}
	return h.simHost.Mount(source, target, fstype, opts)
}

func (h hookHost) MakeFS(ctx context.Context, p blank.Proof, fsType string, onMapping bool, uuid string) error {
	if h.beforeMkfs != nil {
		if err := h.beforeMkfs(p); err != nil {
			return err
		}
	}
	return h.simHost.MakeFS(ctx, p, fsType, onMapping, uuid)
}

// breakRun is a simulation run without random faults; vols share disks
// as their serials say.
func breakRun(t *testing.T, dir string, lease bool, vols ...*simVolume) *simRun {
	w := &simWorld{t: t, disks: map[string]*simDiskState{}, loops: map[string]string{}, pods: map[string]string{}, autoclear: map[string]bool{}, crypts: map[string]string{},
		mounts: map[string]string{}, content: map[string]string{}, proved: map[string]string{}, failNext: map[string]int{}, loseNext: map[string]int{},
		stateDir: filepath.Join(dir, "state"), kubelet: filepath.Join(dir, "kubelet"), unsynced: map[string][]byte{}}
	if err := os.MkdirAll(w.kubelet, 0o755); err != nil {
		t.Fatal(err)
	}
	r := &simRun{w: w, vols: vols}
	for i, v := range vols {
		w.place(v, i, i)
		if w.disks[v.serial] == nil {
			w.minor++
			w.disks[v.serial] = &simDiskState{serial: v.serial, path: fmt.Sprintf("/dev/vd%c", 'b'+w.minor-1), minor: w.minor, present: true, lease: lease}
		}
	}
	return r
}

// runBreak runs body in a bubble over a fresh breakRun, then reports what
// the simulation's invariants found broken.
func runBreak(t *testing.T, lease bool, vols []*simVolume, body func(r *simRun, h *hookHost)) {
	dir, err := os.MkdirTemp(simTempRoot(), "volbreak")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	var broken, trace []string
	synctest.Test(t, func(t *testing.T) {
		r := breakRun(t, dir, lease, vols...)
		defer func() {
			if r.m != nil {
				r.m.Close()
			}
		}()
		r.start(context.Background())
		h := &hookHost{simHost: r.m.host.(simHost)}
		r.m.host = h
		body(r, h)
		broken, trace = r.w.broken, r.w.trace
	})
	if testing.Verbose() {
		t.Logf("trace:\n%s", strings.Join(trace, "\n"))
	}
	if len(broken) > 0 {
		t.Errorf("the volume manager's invariants broke:\n  %s\ntrace:\n%s", strings.Join(uniq(broken), "\n  "), strings.Join(trace, "\n"))
	}
}

// logf notes a step in the run's trace.
func (r *simRun) logBreak(format string, args ...any) {
	r.w.mu.Lock()
	r.w.logf(format, args...)
	r.w.mu.Unlock()
}

// Two volumes whose locators name the same disk, staged side by side
// (the controller's error, or a hostile request). The stage's "one disk,
// one volume" refusal (openDisk, claimedBy) only counts claims already
// staged: while the first stage is under way (its claim recorded
// claiming, its fence taken, its mount not yet made), the second goes
// through, takes the same fence (the same node's key), and when it fails
// its rollback releases that fence through the release guard, whose proof
// finds nothing in use yet. The first stage then mounts the volume with
// no fence held on the disk (P1).
func TestBreakSecondVolumeOnDiskReleasesFenceOfStageUnderWay(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	b := &simVolume{id: "pvc-b", serial: "sim0"}
	runBreak(t, false, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
		reached, goOn := make(chan struct{}), make(chan struct{})
		h.beforeMount = func(_, target string) error {
			switch target {
			case a.staging:
				close(reached)
				<-goOn
			case b.staging:
				return fmt.Errorf("mount %s: %w", target, errSimFault)
			}
			return nil
		}
		var wg sync.WaitGroup
		var errA error
		wg.Go(func() { _, errA = r.m.Stage(context.Background(), r.stageReq(a)) })
		<-reached
		_, errB := r.m.Stage(context.Background(), r.stageReq(b))
		r.logBreak("NodeStage %s (same disk, while %s's stage mounts): %s", b.id, a.id, errText(errB))
		close(goOn)
		wg.Wait()
		r.logBreak("NodeStage %s: %s", a.id, errText(errA))
		r.check()
		r.w.mu.Lock()
		d := r.w.disks[a.serial]
		if _, ok := r.w.mounts[a.staging]; ok && d.holder != "us" {
			r.w.violate("P1: %s is mounted at its staging path and its disk's fence is held by %q, not this node", a.id, d.holder)
		}
		r.w.mu.Unlock()
	})
}

// The same race for the format: both stages prove the disk blank before
// either formats it; the second makes its filesystem and mounts it; the
// first's mkfs then runs on its proof, now stale, over the second's
// mounted filesystem. "Nothing is formatted without a blank proof for
// that device": the proof was made, but the device it proved blank holds
// a filesystem by the time of the mkfs.
func TestBreakSecondVolumeOnDiskFormattedOverByStaleProof(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	b := &simVolume{id: "pvc-b", serial: "sim0"}
	runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
		reached, goOn := make(chan struct{}), make(chan struct{})
		var once sync.Once
		h.beforeMkfs = func(blank.Proof) error {
			first := false
			once.Do(func() { first = true })
			if first {
				close(reached)
				<-goOn
			}
			return nil
		}
		var wg sync.WaitGroup
		var errA error
		wg.Go(func() { _, errA = r.m.Stage(context.Background(), r.stageReq(a)) })
		<-reached
		_, errB := r.m.Stage(context.Background(), r.stageReq(b))
		r.logBreak("NodeStage %s (same disk, while %s's stage is about to format): %s", b.id, a.id, errText(errB))
		close(goOn)
		wg.Wait()
		r.logBreak("NodeStage %s: %s", a.id, errText(errA))
		if errB != nil && errors.Is(errA, errSimFault) {
			t.Logf("neither stage got through: %v / %v", errA, errB)
		}
	})
}

// simResumeFails is a fencer factory whose lease fencers cannot be resumed
// (the lease area's read timing out after a reboot, say).
type simResumeFails struct{ simFencers }

type noResumeFencer struct{ *simFencer }

func (f noResumeFencer) Resume(context.Context) error {
	return fmt.Errorf("resuming the lease of %s: reading the lease area: %w", f.serial, errSimFault)
}

func (s simResumeFails) Choose(ctx context.Context, dev *Device, v string, onLost func(*fence.LostError) bool) (Choice, error) {
	ch, err := s.simFencers.Choose(ctx, dev, v, onLost)
	if f, ok := ch.Fencer.(*simFencer); ok && f.lease {
		ch.Fencer = noResumeFencer{f}
	}
	return ch, err
}

// startBooted starts an agent process as r.start does, in the boot named
// boot, with the fencer factory fencers gives (nil: the simulation's).
func (r *simRun) startBooted(ctx context.Context, boot string, fencers func(simFencers) FencerFactory) {
	r.startWith(ctx, boot, fencers, nil)
}

// reboot kills the agent process and reboots the node: its mounts and
// mappings go; the disks and what their fences say stay.
func (r *simRun) reboot() {
	w := r.w
	w.mu.Lock()
	defer w.mu.Unlock()
	w.logf("the node reboots")
	w.crash()
	clear(w.mounts)
	clear(w.loops)
	clear(w.pods)
	clear(w.autoclear)
	clear(w.crypts)
}

// After a reboot the kubelet stages every volume of the node's pods
// again. The first agent process of the boot does not list a lease it
// could not take back for the host watchdog (mayBeWriting: nothing was
// mounted at boot), so a lease whose resume fails at start leaves the
// claim staged with a live entry without a fencer. The repeated
// NodeStage then takes the claim back (restaged: reconcile, whose resume
// fails again), finds the staging path unmounted and repairs it: the
// data mapping and the mount are made again, under no fencer at all. The
// volume is mounted, nothing renews its lease and the host watchdog is
// fed: another node takes the disk over once the lease expires (P1).
func TestBreakRestageAfterRebootMountsLeaseNobodyRenews(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("first stage: %v", err)
		}
		r.reboot()
		old := r.m
		r.startBooted(ctx, "boot-2", func(s simFencers) FencerFactory { return simResumeFails{s} })
		old.Close()
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s after the reboot: %s", a.id, errText(err))
		r.check()
	})
}
