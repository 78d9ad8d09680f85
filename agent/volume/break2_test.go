package volume

// Directed reproductions, second adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go). Each test
// fails while the property it names can be broken.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// flushFailHost fails the release guard's flush of a disk while failFlush
// is above zero (an I/O error of the disk's cache flush).
type flushFailHost struct {
	*hookHost
	mu        sync.Mutex
	failFlush int
}

func (h *flushFailHost) Flush(dev *Device) error {
	h.mu.Lock()
	fail := h.failFlush > 0
	if fail {
		h.failFlush--
	}
	h.mu.Unlock()
	if fail {
		return fmt.Errorf("flushing %s: %w", dev.Path, errSimFault)
	}
	return h.hookHost.Flush(dev)
}

// Two encrypted volumes whose ids once escaped to the same dm-crypt
// mapping name ("pvc/x" and "pvc_2fx", when "/" became "_2f" and "_" was
// kept). Everything that closes a volume's mapping closes it by name, so
// a shared name let Y's unstage close the mapping X's first stage had
// just proven blank and was about to format, Y's stage open its own LUKS2
// volume (holding Y's filesystem) under that name, and X's mkfs, on the
// proof made a moment before, format Y's data. Nothing is formatted
// without a blank proof for that device (I2); each volume keeps its own
// mapping, and both stages complete.
func TestBreak2VolumesWhoseIdsEscapeAlikeKeepTheirOwnMappings(t *testing.T) {
	x := &simVolume{id: "pvc/x", serial: "sim0", encrypted: true}
	y := &simVolume{id: "pvc_2fx", serial: "sim1", encrypted: true}
	runBreak(t, false, []*simVolume{x, y}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		fh := &flushFailHost{hookHost: h}
		r.m.host = fh
		// Y is staged (its LUKS2 header and filesystem made on sim1), then
		// an unstage of it stops at the release guard's flush, after it
		// closed its mapping: the claim stays staged for the retry.
		if _, err := r.m.Stage(ctx, r.stageReq(y)); err != nil {
			t.Fatalf("stage %s: %v", y.id, err)
		}
		fh.mu.Lock()
		fh.failFlush = 1
		fh.mu.Unlock()
		err := r.m.Unstage(ctx, y.id, y.staging)
		r.logBreak("NodeUnstage %s (the flush before the release fails): %s", y.id, errText(err))

		// X's first stage of the blank disk sim0: LUKS2 made and opened as
		// vco-pvc_2fx, its plaintext proven blank; it stops right before
		// its mkfs.
		atMkfs, goMkfs := make(chan struct{}), make(chan struct{})
		yAtMount, goYMount := make(chan struct{}), make(chan struct{})
		h.beforeMkfs = func(p blank.Proof) error {
			if p.Device() == "/dev/mapper/"+mapperName(x.id) {
				close(atMkfs)
				<-goMkfs
			}
			return nil
		}
		h.beforeMount = func(_, target string) error {
			if target == y.staging {
				close(yAtMount)
				<-goYMount
			}
			return nil
		}
		var wg sync.WaitGroup
		var errX, errY error
		wg.Go(func() { _, errX = r.m.Stage(ctx, r.stageReq(x)) })
		<-atMkfs
		// The kubelet retries Y's unstage: it closes "its" mapping by
		// name, which is X's, and completes.
		err = r.m.Unstage(ctx, y.id, y.staging)
		r.logBreak("NodeUnstage %s again (while %s's stage is about to format): %s", y.id, x.id, errText(err))
		// Y is staged again: its LUKS2 volume opened as vco-pvc_2fx; it
		// stops right before its mount.
		wg.Go(func() { _, errY = r.m.Stage(ctx, r.stageReq(y)) })
		<-yAtMount
		close(goMkfs)
		// X's stage goes on: its mkfs runs on the proof made before.
		synctest.Wait()
		close(goYMount)
		wg.Wait()
		r.logBreak("NodeStage %s: %s", x.id, errText(errX))
		r.logBreak("NodeStage %s: %s", y.id, errText(errY))
		if errX != nil || errY != nil {
			t.Errorf("stages of two volumes on their own disks: %s: %v; %s: %v", x.id, errX, y.id, errY)
		}
	})
}

// A failed write of the boot id makes every later agent process of the
// same boot believe it is the first since the boot. firstStartSinceBoot
// compares the boot id recorded by the last start that could record it
// with this boot's: the first process after a reboot that cannot write it
// (a full or failing state directory; here a directory in the place of
// its temporary file stands for that) leaves the earlier boot's id, so
// the next process of this boot, after the first one crashed with its
// volumes mounted, takes itself for the first after the boot too
// (afterBoot): it lists no recorded lease for the host watchdog
// (ExpectRecordedLeases) and, when a lease cannot be resumed, does not
// list it as unresumed (reconcileFence: mayBeWriting is false). The
// volume stays mounted, its lease renewed by nobody, while the host
// watchdog is fed (P1, I1).
func TestBreak2BootIDNotRecordedHidesUnresumedLease(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("first stage: %v", err)
		}
		r.reboot()
		// The boot id of this boot cannot be recorded.
		r.w.mu.Lock()
		if err := os.Mkdir(filepath.Join(r.w.stateDir, bootIDFile+".tmp"), 0o700); err != nil {
			t.Fatal(err)
		}
		r.w.mu.Unlock()
		old := r.m
		r.startBooted(ctx, "boot-2", nil)
		old.Close()
		// The kubelet stages the volume again after the reboot: mounted
		// under the lease this process resumed.
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s after the reboot: %s", a.id, errText(err))
		if err != nil {
			t.Fatalf("restage after the reboot: %v", err)
		}
		r.check()
		// The agent process dies (not the host): the mount stays. The next
		// process of the same boot cannot resume the lease (a read of the
		// lease area that times out).
		r.w.mu.Lock()
		r.w.logf("agent process %d dies", r.w.gen)
		r.w.crash()
		r.w.mu.Unlock()
		old = r.m
		r.startBooted(ctx, "boot-2", func(s simFencers) FencerFactory { return simResumeFails{s} })
		old.Close()
		r.check()
		if !r.m.mayBeWriting() {
			r.logBreak("the agent process %d of boot-2 takes itself for the first since the boot", r.w.gen)
		}
	})
}

// busyUnmountHost answers EBUSY to every unmount of the paths in busy
// (something of the node holds the filesystem open).
type busyUnmountHost struct {
	simHost
	busy map[string]bool
}

func (h busyUnmountHost) Unmount(target string) error {
	if h.busy[target] {
		return h.do("umount", func() error { return fmt.Errorf("umount %s: target is busy", target) })
	}
	return h.simHost.Unmount(target)
}

// crashAfterMountHost kills the agent process right after a mount at
// target took effect: a stage cut short between its mount and its record.
type crashAfterMountHost struct {
	*hookHost
	target string
}

func (h crashAfterMountHost) Mount(source, target, fstype string, opts []string) error {
	if err := h.hookHost.Mount(source, target, fstype, opts); err != nil || target != h.target {
		return err
	}
	h.w.mu.Lock()
	h.w.logf("    mount: crash after")
	h.w.crash()
	h.w.mu.Unlock()
	return errSimDead
}

// noFencingNow is a fencer factory whose disks offer no fencing the agent
// has any more (a PR disk whose target now reports no persistent
// reservations, whose byte 0 holds the filesystem, not a lease area):
// Choose answers no fencer, with its reason, and no error.
type noFencingNow struct{ simFencers }

func (s noFencingNow) Choose(_ context.Context, _ *Device, _ string, _ func(*fence.LostError) bool) (Choice, error) {
	return Choice{Method: fence.MethodNone, Reason: "no persistent reservations (the target reports none), and no lease: the disk holds ext4, not a lease area"}, nil
}

// startHosted starts an agent process as startWith does, with the host
// wrap makes of the simulation's, so that the start-up check itself runs
// over it; tune, when set, changes the manager before that check. Its
// data mappings are the ones the process finds (it maps none).
func (r *simRun) startHosted(ctx context.Context, boot string, fencers func(simFencers) FencerFactory, wrap func(simHost) host, tune func(*Manager)) {
	w := r.w
	r.startWith(ctx, boot, fencers, func(m *Manager) {
		gen := m.host.(simHost).gen
		m.host = wrap(m.host.(simHost))
		m.mapData = func(string, int64, bool) (string, error) { return "", fmt.Errorf("map data: %w", errSimFault) }
		m.unmapData = func(p string) error {
			if p == "" {
				return nil
			}
			return w.call(gen, "unmap data", func() error { delete(w.loops, p); return nil })
		}
		if tune != nil {
			tune(m)
		}
	})
}

// A stage cut short between its mount and its record (the agent process
// dies), and a restart whose start-up check cannot unmount the staging
// path (EBUSY) and finds that the disk offers no fencing the agent has
// now. reconcileInterrupted releases nothing then (right: there is no
// fencer to release with), but it records the claim interrupted with
// nothing held, as if the take-down had succeeded, while the filesystem
// stays mounted at the staging path: the record says less than the node
// (I3), the claim checks skip it for good (CheckAll retakes a cut-short
// claim only when it is unresolved or missing), and every retried stage
// answers UNAVAILABLE "the claim check takes it back", which never
// comes. reconcileFence, for the same choice of a staged claim, records
// the claim lost and stops its I/O.
func TestBreak2CutShortStageWithNoFencingNowRecordedInterruptedWhileMounted(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		r.m.host = crashAfterMountHost{hookHost: h, target: a.staging}
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s (the agent dies right after the mount): %s", a.id, errText(err))
		old := r.m
		r.startHosted(ctx, "sim-boot", func(s simFencers) FencerFactory { return noFencingNow{s} },
			func(h simHost) host { return busyUnmountHost{simHost: h, busy: map[string]bool{a.staging: true}} }, nil)
		old.Close()
		r.logBreak("agent process %d started", r.w.gen)
		r.check()
		r.m.CheckAll(ctx)
		r.check()
		_, err = r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s retried: %s", a.id, errText(err))
		r.check()
	})
}

// chooseFails is a fencer factory whose Choose fails (the PR probe's
// INQUIRY times out, the lease area's read fails).
type chooseFails struct{ simFencers }

func (s chooseFails) Choose(_ context.Context, dev *Device, _ string, _ func(*fence.LostError) bool) (Choice, error) {
	return Choice{}, fmt.Errorf("probing %s for persistent reservations: %w", dev.Path, errSimFault)
}

// A lease stage cut short right after its data mapping was attached,
// before the record named the fencing method (the stage records Method
// and DataDevice together, after the map step; the acquire before it has
// landed). At the restart the start-up check cannot detach that mapping
// (its detach fails) and cannot choose the disk's fencing (a read that
// fails). mayBeLease counts such a claim as a lease (Method ""), and
// ExpectRecordedLeases lists it for the host watchdog; but
// reconcileInterrupted goes on to the unresolved path only when the
// record names a method: with none it records the claim interrupted with
// nothing held and takes it off the list. The data mapping stays over the
// disk, the lease this node took is renewed by nobody, and the host
// watchdog is fed (P1, I1); no claim check looks at the claim again.
func TestBreak2CutShortLeaseStageWithoutMethodUnlistedWhileMapped(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
		ctx := context.Background()
		mapData := r.m.mapData
		r.m.mapData = func(disk string, off int64, ro bool) (string, error) {
			if _, err := mapData(disk, off, ro); err != nil {
				return "", err
			}
			r.w.mu.Lock()
			r.w.logf("    map data: crash after")
			r.w.crash()
			r.w.mu.Unlock()
			return "", errSimDead
		}
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s (the agent dies right after the data mapping is attached): %s", a.id, errText(err))
		st, err := OpenStore(r.w.stateDir)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := st.Get(a.id)
		r.logBreak("the record the next process finds: %s, method %q, data device %q", phaseOf(c), c.Method, c.DataDevice)
		old := r.m
		r.startHosted(ctx, "sim-boot", func(s simFencers) FencerFactory { return chooseFails{s} },
			func(h simHost) host { return h },
			func(m *Manager) {
				m.unmapData = func(p string) error {
					if p == "" {
						return nil
					}
					return r.w.call(r.w.gen, "unmap data", func() error { return fmt.Errorf("detaching %s: %w", p, errSimFault) })
				}
			})
		old.Close()
		c, _ = r.m.store.Get(a.id)
		r.logBreak("agent process %d started; the record: %s; host watchdog list: %v", r.w.gen, phaseOf(c), r.m.Leases())
		r.check()
		r.m.CheckAll(ctx)
		r.logBreak("claim check; host watchdog list: %v", r.m.Leases())
		r.check()
	})
}
