package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestAdoptCommand: `vco-agent adopt` on a disk as the earlier driver left
// it (ext4 made on the whole disk), grown as through the API, writes the
// lease area, after which `vco-agent lease show` finds it; a second run
// leaves it; a disk with nothing to adopt is refused with a sentence.
// (agent/volume's TestAdoptedDiskOfTheEarlierDriverStagesFenced stages
// the adopted volume.)
func TestAdoptCommand(t *testing.T) {
	dev := leaseLoop(t, func(img string) {
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m0", img).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v: %s", err, out)
		}
		if err := os.Truncate(img, 20<<20); err != nil { // grown by 4 MiB
			t.Fatal(err)
		}
	})
	out, errs, code := run(t, "adopt", "--uuid", uuid, dev)
	if code != 0 || !strings.Contains(out, "adopted") {
		t.Fatalf("adopt: exit %d\n%s%s", code, out, errs)
	}
	out, errs, code = run(t, "lease", "show", "--uuid", uuid, dev)
	if code != 0 {
		t.Fatalf("lease show after adopt: exit %d\n%s%s", code, out, errs)
	}
	out, _, code = run(t, "adopt", "--uuid", uuid, dev)
	if code != 0 || !strings.Contains(out, "already is a lease volume") {
		t.Fatalf("adopt again: exit %d\n%s", code, out)
	}
	blank := leaseLoop(t, nil)
	_, errs, code = run(t, "adopt", "--uuid", uuid, blank)
	if code != 1 || !strings.Contains(errs, "no ext4 filesystem at byte 0") {
		t.Fatalf("adopt of a blank disk: exit %d, stderr %q", code, errs)
	}
	if _, _, code := run(t, "adopt"); code != 2 {
		t.Fatalf("adopt without a device: exit %d, want 2", code)
	}
}
