package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// Directed reproductions, sixteenth adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

// After a boot, the first agent process cannot read the kernel's boot id,
// or cannot record it in the state directory (firstStartSinceBoot answers
// false, the careful answer for itself, and leaves the earlier boot's id
// recorded). It stages a lease volume: mounted, its lease renewed.
// The process then restarts in the same boot. The second process reads
// the boot id, finds the earlier boot's still recorded and takes itself
// for the first since the boot (afterBoot): ExpectRecordedLeases lists
// nothing and mayBeWriting is false, though the first process of this
// very boot left the volume mounted. Its resume failing (a read of the
// lease area that times out), the volume stays mounted, renewed by no
// fencer and not listed for the host watchdog, which is fed (I1). The
// control: the first process read the boot id, and the second lists the
// claim.
func TestAdv16UnreadBootIDMakesALaterProcessOfTheBootTakeItselfForTheFirst(t *testing.T) {
	for _, tc := range []struct {
		name                string
		readFail, writeFail bool
	}{
		{"control: the first process read and recorded the boot id", false, false},
		{"the first process could not read the boot id", true, false},
		{"the first process could not record the boot id", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &simVolume{id: "pvc-a", serial: "sim0"}
			runBreak(t, true, []*simVolume{a}, func(r *simRun, _ *hookHost) {
				ctx := context.Background()
				r.reboot()
				old := r.m
				obstacle := filepath.Join(r.w.stateDir, bootIDFile+".tmp")
				if tc.writeFail {
					// writeSmallFile's temporary file cannot be made: the
					// boot id is not recorded (a full or failing disk).
					if err := os.Mkdir(obstacle, 0o700); err != nil {
						t.Fatal(err)
					}
				}
				r.startWith(ctx, "boot-2", nil, func(m *Manager) {
					if tc.readFail {
						m.bootID = func() (string, error) {
							return "", errors.New("reading /proc/sys/kernel/random/boot_id: input/output error")
						}
					}
				})
				old.Close()
				if _, err := r.m.Stage(ctx, r.stageReq(a)); err != nil {
					t.Fatalf("stage %s: %v", a.id, err)
				}
				r.logBreak("%s staged by the first process of boot-2", a.id)
				r.check()
				if err := os.Remove(obstacle); err != nil && !errors.Is(err, os.ErrNotExist) {
					t.Fatal(err)
				}
				r.w.mu.Lock()
				r.w.crash()
				r.w.mu.Unlock()
				old = r.m
				r.startBooted(ctx, "boot-2", func(s simFencers) FencerFactory { return simResumeFails{s} })
				old.Close()
				r.logBreak("a second agent process of boot-2 started (mayBeWriting=%v), its resume of %s failing", r.m.mayBeWriting(), a.id)
				r.check()
			})
		})
	}
}
