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

	"github.com/whitesky-cloud/vco-storage/internal/blank"
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

// Two encrypted volumes whose ids differ but whose dm-crypt mapping names
// are the same: mapperName escapes "/" as "_2f" and keeps "_", so
// "pvc/x" and "pvc_2fx" both map as vco-pvc_2fx (ids longer than 116
// bytes that share their first 116 collide the same way, by truncation).
// Everything that closes "the volume's mapping by its name" then closes
// the other volume's: here Y's unstage closes the mapping X's first stage
// has just proven blank and is about to format, Y's stage opens its own
// LUKS2 volume (which holds Y's filesystem) under that name, and X's
// mkfs, on the proof it made a moment before, formats Y's data. Nothing
// is formatted without a blank proof for that device (I2): the device the
// proof names is no longer the one it proved blank.
func TestBreak2MapperNameCollisionFormatsOtherVolume(t *testing.T) {
	x := &simVolume{id: "pvc/x", serial: "sim0", encrypted: true}
	y := &simVolume{id: "pvc_2fx", serial: "sim1", encrypted: true}
	if mapperName(x.id) != mapperName(y.id) {
		t.Fatalf("the ids chosen no longer collide: %s / %s", mapperName(x.id), mapperName(y.id))
	}
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
		if r.m.mayBeWriting() == false {
			r.logBreak("the agent process %d of boot-2 takes itself for the first since the boot", r.w.gen)
		}
	})
}
