package volume

import (
	"context"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// adv8LossHost is the simulation's host that notes every StopFilesystem
// and, right after the mount of the staging path took effect, runs
// afterMount: the fencer's renewal noticing the loss (onLost runs on the
// engine's goroutine, without the volume's lock) while the stage is
// still under way.
type adv8LossHost struct {
	*hookHost
	target     string
	afterMount func()
	mu         *sync.Mutex
	stopped    *[]string
}

func (h adv8LossHost) Mount(source, target, fstype string, opts []string) error {
	err := h.hookHost.Mount(source, target, fstype, opts)
	if err == nil && target == h.target && h.afterMount != nil {
		h.afterMount()
	}
	return err
}

func (h adv8LossHost) StopFilesystem(p, device string) error {
	h.mu.Lock()
	*h.stopped = append(*h.stopped, p)
	h.mu.Unlock()
	return h.hookHost.StopFilesystem(p, device)
}

// A lease or reservation lost while a stage is between its mount and its
// record (the fencer is live from takeFence on, and its renewals run
// beside the stage). onLost, which must report stopped only once the
// disk is read-only, the filesystem stopped and every layer drained
// (P4: the taker trusts it as the holder's "fenced" mark), reads the
// claim's phase without the volume's lock: the record still says
// claiming, so it skips StopFilesystem for the filesystem that is
// mounted at the staging path, and yet answers stopped = true. The
// taker is told the holder is quiet while the mounted filesystem was
// never stopped. Control: the same loss once the volume is recorded
// staged stops the filesystem before answering stopped.
func TestAdv8LossDuringStageAfterMountReportsStoppedWithFilesystemRunning(t *testing.T) {
	for _, tc := range []struct {
		name        string
		duringMount bool
	}{{"control: loss after the stage", false}, {"loss between the mount and the record", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				var mu sync.Mutex
				var stops []string
				var answered, mounted bool
				var got bool
				var atAnswer []string
				lost := &fence.LostError{Device: "/dev/vdb", Reason: "the lease is held by another node", Holder: 0x6f74686572}
				lose := func() {
					got = r.m.onLost(a.id)(lost)
					answered = true
					mu.Lock()
					atAnswer = slices.Clone(stops)
					mu.Unlock()
					r.w.mu.Lock()
					_, mounted = r.w.mounts[a.staging]
					r.w.mu.Unlock()
				}
				lh := adv8LossHost{hookHost: h, target: a.staging, mu: &mu, stopped: &stops}
				if tc.duringMount {
					lh.afterMount = lose
				}
				r.m.host = lh
				_, err := r.m.Stage(ctx, r.stageReq(a))
				r.logBreak("NodeStage %s: %s", a.id, errText(err))
				if !tc.duringMount {
					lose()
				}
				// recordLoss waits for the volume's lock; let it finish.
				time.Sleep(time.Minute)
				synctest.Wait()
				if !answered {
					t.Fatal("the loss was never delivered")
				}
				mu.Lock()
				defer mu.Unlock()
				stoppedFS := false
				for _, p := range atAnswer {
					if p == a.staging {
						stoppedFS = true
					}
				}
				r.logBreak("onLost answered stopped=%v; staging mounted then: %v; StopFilesystem calls before the answer: %v", got, mounted, atAnswer)
				if got && mounted && !stoppedFS {
					t.Errorf("onLost reported the I/O of volume %s stopped while its filesystem was mounted at %s and never stopped (StopFilesystem calls before it: %v)", a.id, a.staging, atAnswer)
				}
			})
		})
	}
}

// adv8UnbindHost runs duringUnbind inside Unbind, before the unmount: a
// call of the kubelet that holds the volume's lock while the watcher
// hears of the disk's removal.
type adv8UnbindHost struct {
	*hookHost
	duringUnbind func()
}

func (h adv8UnbindHost) Unbind(target string) (bool, error) {
	if h.duringUnbind != nil {
		h.duringUnbind()
	}
	return h.hookHost.Unbind(target)
}

// The uevent watcher hears a staged volume's disk removed while a call
// holds the volume's lock (here a NodeUnpublish). Removed cannot take
// the lock, skips the claim ("the call in progress finds the device gone
// itself"), and no call does: Unpublish never looks at the disk, so the
// claim is not marked missing. Classify then leaves alone, without
// reading it, any disk that appears with the removed disk's device number
// (the kernel hands the freed number to the next disk attached): a disk
// another node holds is not refused nor set read-only (P2, and the
// claim's record says the node holds a disk it does not), until the next
// periodic claim check marks the claim missing and a later rescan looks
// again. Refusing at the appearance is the point of the watcher. Control: the
// same removal with no call in progress marks the claim missing, and
// Classify reads the new disk (here: no such node, so it says so).
func TestAdv8RemovalDuringUnpublishLeavesNextDiskAtTheNumberUnclassified(t *testing.T) {
	for _, tc := range []struct {
		name   string
		racing bool
	}{{"control: removal with no call in progress", false}, {"removal while an unpublish holds the lock", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage: %v", err)
				}
				if err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: a.targets[0]}); err != nil {
					t.Fatalf("publish: %v", err)
				}
				minor := r.w.disks[a.serial].minor
				removed := false
				uh := adv8UnbindHost{hookHost: h}
				if tc.racing {
					uh.duringUnbind = func() {
						if !removed {
							removed = true
							r.remove(a)
						}
					}
				}
				r.m.host = uh
				err := r.m.Unpublish(ctx, a.id, a.targets[0])
				r.logBreak("NodeUnpublish %s (disk removed meanwhile: %v): %s", a.id, tc.racing, errText(err))
				if !tc.racing {
					r.remove(a)
				}
				c, _ := r.m.store.Get(a.id)
				ev := ueventOf(minor)
				ev.Action = "add"
				v, cerr := r.m.Classify(ctx, ev)
				r.logBreak("record: missing=%v; another disk appears as %s (%d:%d): verdict %+v, err %v", c != nil && c.Missing, ev.Node(), ev.Major, ev.Minor, v, cerr)
				if cerr == nil && !v.Refuse {
					t.Errorf("a disk that appeared at %d:%d after volume %s's disk was removed was left alone without being read (verdict %+v); the claim's record says missing=%v", ev.Major, ev.Minor, a.id, v, c != nil && c.Missing)
				}
			})
		})
	}
}
