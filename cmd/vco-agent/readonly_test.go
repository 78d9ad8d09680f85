package main

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
)

// A disk refused while node A held it stays read-only on node B after A
// released it ("a refused disk that becomes free stays read-only until a
// stage on this node claims it", docs/fencing.md). lease acquire on B
// then behaves as the agent's stage: it clears the flag and takes the
// lease, where it used to fail writing its slot with "operation not
// permitted". While another node holds the disk the claim is refused and
// the flag set again; while B's agent has the disk staged the flag is
// left alone, and the refusal names it. Both nodes are loop devices over
// one image; the refusal is the watcher's own (uevent.SetReadOnly).
func TestLeaseAcquireOnADiskARefusalLeftReadOnly(t *testing.T) {
	img := ""
	devA := leaseLoop(t, func(p string) { img = p })
	if code, _, errs := runLeaseCLI(t, nil, "format", devA, "--uuid", cliUUIDA); code != 0 {
		t.Fatal(errs)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	devB := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		exec.Command("blockdev", "--setrw", devB).Run()
		exec.Command("losetup", "-d", devB).Run()
	})
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	a := holdAsNodeA(t, devA)
	if err := uevent.SetReadOnly(devB, 0, 0, true); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()

	code, _, errs := runLeaseCLI(t, nil, "acquire", devB, "--uuid", cliUUIDB, "--state-dir", empty)
	if code != 1 || !strings.Contains(errs, keyA.String()) || !readOnly(t, devB) {
		t.Fatalf("acquire by B while A holds: %d %q, read-only afterwards: %v", code, errs, readOnly(t, devB))
	}
	a.release()

	staged := t.TempDir()
	writeClaim(t, filepath.Join(staged, "volumes", "dm9sLTE.json"), `{"volume":"vol-1","device":"`+devB+`","phase":"staged","state":"held"}`)
	code, _, errs = runLeaseCLI(t, nil, "acquire", devB, "--uuid", cliUUIDB, "--state-dir", staged)
	// Refused before anything is touched: the disk is this node's
	// (acquire ends in a release), and its flag stays.
	if code != 1 || !strings.Contains(errs, "staged as volume vol-1") || !readOnly(t, devB) {
		t.Fatalf("acquire by B of a read-only disk B has staged: %d %q, read-only afterwards: %v", code, errs, readOnly(t, devB))
	}
	if code, _, errs := runLeaseCLI(t, nil, "release", devB, "--uuid", cliUUIDB); code != 1 || !strings.Contains(errs, "read-only flag") {
		t.Fatalf("release on a read-only disk: %d %q", code, errs)
	}

	code, out2, errs := runLeaseCLI(t, nil, "acquire", devB, "--uuid", cliUUIDB, "--state-dir", empty, "--hold-for", "100ms")
	if code != 0 || !strings.Contains(out2, "claimed") || !strings.Contains(errs, "read-only") {
		t.Fatalf("acquire by B after A released, on the disk a refusal left read-only: %d %q %q", code, out2, errs)
	}
	if readOnly(t, devB) {
		t.Error("the disk B claimed is read-only")
	}
}

// readOnly reads dev's read-only flag.
func readOnly(t *testing.T, dev string) bool {
	t.Helper()
	ro, err := uevent.ReadOnly(dev)
	if err != nil {
		t.Fatal(err)
	}
	return ro
}
