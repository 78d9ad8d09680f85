package volume

// Directed reproductions, twenty-third adversarial round, over the
// manager simulation's modelled node (sim_test.go, break_test.go).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// adv23Store is the claim store's calls with scripted outcomes: once
// armed, each record write (Put) takes the next outcome of script: "ok",
// "lost" (the record lands, the directory's fsync then fails: the answer
// is lost) or "fail" (the temporary file's fsync fails: the record stays
// as it was). Every write's claim, as written, is noted in log.
type adv23Store struct {
	mu     sync.Mutex
	armed  bool
	script []string
	next   string
	log    []string
}

func (s *adv23Store) arm(script ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.armed, s.script = true, script
}

func (s *adv23Store) Sync(f *os.File) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if strings.HasSuffix(f.Name(), ".tmp") {
		s.next = "ok"
		if s.armed && len(s.script) > 0 {
			s.next, s.script = s.script[0], s.script[1:]
		}
		if b, err := os.ReadFile(f.Name()); err == nil {
			var c Claim
			if json.Unmarshal(b, &c) == nil {
				s.log = append(s.log, fmt.Sprintf("%s: phase %s state %s data %q", s.next, c.Phase, c.State, c.DataDevice))
			}
		}
		if s.next == "fail" {
			return errors.New("fsync claim record: scripted failure")
		}
		return f.Sync()
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if s.next == "lost" {
		return errors.New("fsync claims directory: scripted failure (the record was renamed: its answer is lost)")
	}
	return nil
}

func (s *adv23Store) Rename(from, to string) error { return os.Rename(from, to) }
func (s *adv23Store) Remove(p string) error        { return os.Remove(p) }

// A lease volume's stage mounts it and fails at its last record, a write
// whose answer is lost (the record, staged and naming the data mapping,
// landed). The rollback cannot unmount the staging path (busy), so the
// data mapping under the mount cannot be detached either, and the release
// guard keeps the fence. On its way the rollback's unmapNamed recorded
// that the claim names its data mapping no longer, a write whose answer
// was lost too (it landed), and when the detach then failed it named the
// mapping again in memory only: it writes the name back only when that
// first write answered ok. The last record, the kept fence's, fails. The
// claim's record then says staged, fenced, with no data mapping, while
// the staging path is mounted over a data mapping of its disk: the record
// says less than the node. Every later stage and publish takes the mount
// for one over a disk that left ("its disk was removed and attached
// again: unpublish and unstage the volume"), and the loss of its fence
// would stop the filesystem by the disk's device, not the mapping's,
// which stopFilesystem refuses (the stop counted failed). Volume
// simulation seed 916286 (I5) on c14a6a3.
func TestAdv23RollbackLostRecordLeavesAMountedDataMappingUnnamed(t *testing.T) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, true, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		st := &adv23Store{}
		r.m.store.sys = st
		h.beforeMount = func(string, string) error {
			h.beforeMount = nil
			r.w.mu.Lock()
			defer r.w.mu.Unlock()
			// The rollback's unmount fails; the last record's answer,
			// the rollback's unmapNamed record's answer are lost, the
			// kept fence's record fails.
			r.w.failNext["umount"] = 1
			st.arm("lost", "lost", "fail")
			return nil
		}
		_, err := r.m.Stage(ctx, r.stageReq(a))
		r.logBreak("NodeStage %s, its last record's answer lost and its unmount failing: %s", a.id, errText(err))
		st.mu.Lock()
		for _, l := range st.log {
			r.w.logf("    record write %s", l)
		}
		st.armed = false
		st.mu.Unlock()
		if err == nil {
			t.Fatalf("the stage of %s answered ok; the premise is a stage whose last record failed", a.id)
		}
		r.w.mu.Lock()
		mounted := r.w.mounts[a.staging]
		over := r.w.loops[mounted]
		r.w.mu.Unlock()
		if mounted == "" || over != a.serial {
			t.Fatalf("after the failed stage, %s's staging path holds %q (over %q); the premise is a mount over its data mapping", a.id, mounted, over)
		}
		c, gerr := r.m.store.Get(a.id)
		if gerr != nil || c == nil {
			t.Fatalf("the record of %s: %+v %v", a.id, c, gerr)
		}
		if c.DataDevice != mounted {
			t.Errorf("the record of %s says %s, %s, data mapping %q, while its staging path is mounted over its data mapping %s: the record says less than the node",
				a.id, c.Phase, c.State, c.DataDevice, mounted)
		}
		if err := checkThenStage(ctx, r, a); err != nil {
			t.Errorf("the kubelet's retried stage of %s, whose staging path is mounted over its own data mapping, never succeeds: %v", a.id, err)
		}
	})
}

// A lease volume is staged and the node reboots, down longer than the
// lease's fail bound: the first agent process of the boot finds its
// record too old to resume and nothing of the volume in use, and takes
// the lease back (retakenUnused) -- unless one call of that take-back
// fails: the host watchdog's readiness (with the lease area's check, the
// choice's Prepare) or the Retake's lease I/O. Any such error, a
// transient one too, is taken for "not retakable": the claim is recorded
// lost at once, and the loss stands for good (the claim check does not
// look at a lost claim whose I/O stopped, and the kubelet's stage of a
// lost claim needs the controller's grant). So one failed read or a
// watchdog device not ready yet at the boot's start-up check leaves the
// node refusing its own disk, which the take-back exists to avoid
// (docs/fencing.md: "without this a node would refuse its own disk until
// the controller granted it back"). Volume simulation seed 902627 (I5)
// on c14a6a3 shows the first case, the fault on the watchdog's Prepare;
// its invariant check is further confused by the model's reboot making
// the record young again.
func TestAdv23TransientRetakeFailureLosesTheClaimForGood(t *testing.T) {
	for _, call := range []string{"write lease area", "retake"} {
		t.Run(call, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.hostReset()
				r.w.mu.Lock()
				stale := r.w.disks[a.serial].stale
				r.w.failNext[call] = 1
				r.w.logf("the node rebooted, down past the lease's fail bound (stale record: %v); the next %q fails once", stale, call)
				r.w.mu.Unlock()
				if !stale {
					t.Fatalf("the premise is a reboot past the fail bound")
				}
				r.start(ctx)
				c, _ := r.m.store.Get(a.id)
				r.logBreak("after the start-up check, the claim of %s is %s (%s)", a.id, phaseOf(c), detailOf(c))
				if err := checkThenStage(ctx, r, a); err != nil {
					t.Errorf("after one failed %q, the kubelet's stage of %s never succeeds (no other node holds its disk, nothing of it is in use): %v", call, a.id, err)
				}
			})
		})
	}
}
