package volume

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"google.golang.org/grpc/codes"
)

// adv10Swap removes the disk of volume a (its Removed uevent delivered)
// and attaches the disk of volume b at the device node and number a's
// disk had: the kernel gives a new disk the lowest free name and minor.
func adv10Swap(r *simRun, a, b *simVolume) {
	x := r.w.disks[a.serial]
	r.remove(a)
	r.w.mu.Lock()
	y := r.w.disks[b.serial]
	y.path, y.minor, y.present = x.path, x.minor, true
	r.w.mu.Unlock()
}

// Volume A is staged on disk X (/dev/vdb, lease-fenced, so its data is
// mapped by a loop device past the lease area). X is removed (the watcher
// marks A's claim missing) and disk Y, volume B's, is attached and gets
// the name and device number X had. B is staged on Y (A's claim is
// missing and names another serial, so B's stage is allowed), which maps
// Y's data region. Then the kubelet unstages A. A's unstage detaches "a
// data mapping of the volume's disk that its record does not name" by
// looking up the data mapping over the node its record names, /dev/vdb:
// that is Y now, and the mapping it finds is B's. An operation of volume
// A tears down volume B's data mapping: raw block B is left staged on a
// device that maps nothing, and its publish is refused; a filesystem B
// keeps it only because it is busy (on the node, a loop device detached
// while open goes at its last close). Control: without the swap (Y
// attached at a node of its own) A's unstage leaves B whole.
func TestAdv10UnstageAfterDiskSwapTakesAnotherVolumesDataMapping(t *testing.T) {
	for _, tc := range []struct {
		name        string
		swap, block bool
	}{
		{"control: B's disk at its own node, raw block", false, true},
		{"control: B's disk at its own node, filesystem", false, false},
		{"B's disk at X's old node, raw block", true, true},
		{"B's disk at X's old node, filesystem", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
			b := &simVolume{id: "pvc-b", serial: "sim1", block: tc.block}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				if tc.swap {
					r.w.mu.Lock()
					r.w.disks[b.serial].present = false
					r.w.mu.Unlock()
					adv10Swap(r, a, b)
				} else {
					r.remove(a)
				}
				r.logBreak("disk of %s removed; disk of %s at %s", a.id, b.id, r.w.disks[b.serial].path)
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				if err := r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: b.block}); err != nil {
					t.Fatalf("publish %s: %v", b.id, err)
				}
				if err := r.m.Unpublish(ctx, b.id, b.targets[0]); err != nil {
					t.Fatalf("unpublish %s: %v", b.id, err)
				}
				cb, _ := r.m.store.Get(b.id)
				mapping := cb.DataDevice
				err := r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s: %s", a.id, errText(err))
				time.Sleep(time.Minute)
				r.w.mu.Lock()
				_, mapped := r.w.loops[mapping]
				r.w.mu.Unlock()
				if !mapped {
					t.Errorf("unstaging %s detached %s, volume %s's data mapping", a.id, mapping, b.id)
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: b.block})
				r.logBreak("NodePublish %s: %s", b.id, errText(err))
				if err != nil {
					t.Errorf("publishing %s after %s's unstage: %v (%s)", b.id, a.id, err, agenterr.Code(err))
				}
			})
		})
	}
}

// adv10LowestLoop makes the manager's data mappings take the lowest free
// loop device number, as the kernel's loop-control hands them out (the
// simulation's own counts up and never reuses one).
func adv10LowestLoop(r *simRun) {
	mapData := r.m.mapData
	r.m.mapData = func(disk string, offset int64, ro bool) (string, error) {
		r.w.mu.Lock()
		n := 0
		for {
			if _, used := r.w.loops[fmt.Sprintf("/dev/loop%d", n+1)]; !used {
				break
			}
			n++
		}
		r.w.nLoop = n
		r.w.mu.Unlock()
		return mapData(disk, offset, ro)
	}
}

// Volume A (raw block, lease-fenced: its data mapped by /dev/loop1) is
// staged on disk X at /dev/vdb. The kubelet unstages A: the unstage
// detaches /dev/loop1 and then stops at the release (it fails), leaving
// A's record naming /dev/loop1 still. X is removed, and disk Y, volume
// B's, is attached at /dev/vdb, and B's
// stage maps Y's data region at the lowest free loop device: /dev/loop1.
// The kubelet retries A's unstage: the mapping A's record names is "a
// loop device over its disk" (/dev/loop1 backed by /dev/vdb), and A's
// unstage detaches it: volume B's. Control: B's data mapping at another
// number (A's record names none that is bound) stays.
func TestAdv10UnstageRetryDetachesAnotherVolumesMappingAtAReusedLoopNumber(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lowest bool
	}{{"control: loop numbers never reused", false}, {"loop numbers reused, lowest first", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0", block: true}
			b := &simVolume{id: "pvc-b", serial: "sim1", block: true}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if tc.lowest {
					adv10LowestLoop(r)
				}
				r.w.mu.Lock()
				r.w.disks[b.serial].present = false
				r.w.mu.Unlock()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				// The first unstage stops at the release (an unstage whose
				// disk is gone forgets the claim at once, so the release
				// fails here while the disk is still attached).
				r.w.failNext["release"] = 1
				err := r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s, its release failing: %s", a.id, errText(err))
				ca, _ := r.m.store.Get(a.id)
				if ca == nil {
					t.Errorf("the unstage of %s whose release failed forgot its claim", a.id)
					return
				}
				r.logBreak("%s's record names the data mapping %q", a.id, ca.DataDevice)
				adv10Swap(r, a, b)
				if _, err := r.m.Stage(ctx, r.stageReq(b)); err != nil {
					t.Fatalf("stage %s: %v", b.id, err)
				}
				cb, _ := r.m.store.Get(b.id)
				mapping := cb.DataDevice
				r.logBreak("%s staged on %s, its data mapped at %s", b.id, cb.Device, mapping)
				err = r.m.Unstage(ctx, a.id, a.staging)
				r.logBreak("NodeUnstage %s again: %s", a.id, errText(err))
				time.Sleep(time.Minute)
				r.w.mu.Lock()
				_, mapped := r.w.loops[mapping]
				r.w.mu.Unlock()
				if !mapped {
					t.Errorf("the retried unstage of %s detached %s, volume %s's data mapping", a.id, mapping, b.id)
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: b.targets[0], Block: true})
				r.logBreak("NodePublish %s: %s", b.id, errText(err))
				if err != nil {
					t.Errorf("publishing %s after %s's unstage: %v", b.id, a.id, err)
				}
			})
		})
	}
}

// An unstage of a lease-fenced filesystem volume stops at the release
// (its answer an error), after it unmounted the volume and detached its
// data mapping, which its record no longer names. NodeExpand then finds
// the claim staged: it must refuse, and never grow the disk node itself,
// whose start is the lease area, not the volume.
func TestAdv10ExpandAfterUnstageStoppedGrowsNoDiskNode(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		var mu sync.Mutex
		var runs []string
		r.m.exec = adv7Exec{mu: &mu, runs: &runs}
		if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		r.w.failNext["release"] = 1
		err := r.m.Unstage(ctx, a.id, a.staging)
		r.logBreak("NodeUnstage %s, its release failing: %s", a.id, errText(err))
		_, err = r.m.Expand(ctx, a.id, "", 0)
		r.logBreak("NodeExpand %s: %s", a.id, errText(err))
		mu.Lock()
		defer mu.Unlock()
		if agenterr.Code(err) != codes.FailedPrecondition {
			t.Errorf("NodeExpand of %s after its unstage stopped answered %v, not FAILED_PRECONDITION", a.id, err)
		}
		for _, run := range runs {
			if strings.Contains(run, "resize") {
				t.Errorf("NodeExpand ran %q", run)
			}
		}
	})
}

// Volume A is published at target T. Its unpublish unmounts T, but the
// answer of the unmount is lost (or the agent dies before recording it):
// A's record still lists T, which nothing is mounted on. A publish of
// volume B at T (a hostile or mistaken request: the kubelet gives each
// volume targets of its own) is accepted and binds B's filesystem there,
// and the kubelet's retry of A's unpublish then takes B's publication
// down (and removes the target): an operation of volume A unmounts volume
// B's pod volume. Control: B published at a target of its own stays.
func TestAdv10PublishAtATargetAnotherVolumeRecordsIsTakenDownByIt(t *testing.T) {
	for _, hostile := range []bool{false, true} {
		name := "control: B at its own target"
		if hostile {
			name = "B at A's recorded target"
		}
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			b := &simVolume{id: "pvc-b", serial: "sim1"}
			runBreak(t, true, []*simVolume{a, b}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				for _, v := range []*simVolume{a, b} {
					if _, err := r.m.Stage(ctx, r.stageReq(v)); err != nil {
						t.Fatalf("stage %s: %v", v.id, err)
					}
				}
				ta := a.targets[0]
				if err := r.m.Publish(ctx, PublishRequest{Volume: a.id, StagingPath: a.staging, TargetPath: ta}); err != nil {
					t.Fatalf("publish %s: %v", a.id, err)
				}
				r.w.loseNext["umount"] = 1
				err := r.m.Unpublish(ctx, a.id, ta)
				r.logBreak("NodeUnpublish %s at %s, the unmount's answer lost: %s", a.id, ta, errText(err))
				tb := b.targets[0]
				if hostile {
					tb = ta
				}
				err = r.m.Publish(ctx, PublishRequest{Volume: b.id, StagingPath: b.staging, TargetPath: tb})
				r.logBreak("NodePublish %s at %s: %s", b.id, tb, errText(err))
				if err != nil {
					if hostile {
						return // refused: nothing of B's at A's target
					}
					t.Fatalf("publish %s: %v", b.id, err)
				}
				err = r.m.Unpublish(ctx, a.id, ta)
				r.logBreak("NodeUnpublish %s at %s again: %s", a.id, ta, errText(err))
				r.w.mu.Lock()
				_, mounted := r.w.mounts[tb]
				r.w.mu.Unlock()
				if !mounted {
					t.Errorf("volume %s's publication at %s was taken down by the unpublish of volume %s", b.id, tb, a.id)
				}
			})
		})
	}
}

// Volume A, lease-fenced, is staged (its filesystem mounted) when the
// agent restarts; the next process finds A's claim record damaged (a
// write torn by the disk, a hand edit), unreadable. The start-up check
// leaves the volume "alone", and so does the host watchdog's list: the
// lease the earlier process renewed is renewed by nobody, listed as not
// resumed nowhere, and the watchdog is fed while A's filesystem stays
// mounted and writable: the lease lapses under a volume in use, and
// another node may take the disk (I1, P1). Control: the record intact,
// the lease is resumed.
func TestAdv10DamagedRecordAtRestartLetsAMountedVolumesLeaseLapse(t *testing.T) {
	for _, damaged := range []bool{false, true} {
		name := "control: record intact"
		if damaged {
			name = "record damaged"
		}
		t.Run(name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.w.mu.Lock()
				r.w.crash()
				dir := r.w.stateDir
				r.w.mu.Unlock()
				if damaged {
					recs, _ := filepath.Glob(filepath.Join(dir, "volumes", "*.json"))
					if len(recs) != 1 {
						t.Fatalf("claim records: %v", recs)
					}
					b, err := os.ReadFile(recs[0])
					if err != nil {
						t.Fatal(err)
					}
					if err := os.WriteFile(recs[0], b[:len(b)/2], 0o600); err != nil {
						t.Fatal(err)
					}
				}
				r.logBreak("agent restarts, %s's record damaged: %v", a.id, damaged)
				r.m.Close()
				r.start(ctx)
				r.logBreak("the host watchdog's list: %+v", r.m.Leases())
				r.w.mu.Lock()
				defer r.w.mu.Unlock()
				d := r.w.disks[a.serial]
				if what := r.w.inUse(a.serial); what != "" && !r.renewed(a, d) {
					t.Errorf("%s is %s, but its lease is renewed by no live fencer and not listed for the host watchdog as not resumed (I1)", a.id, what)
				}
			})
		})
	}
}
