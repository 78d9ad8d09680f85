package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// lease clear takes a disk's fence state off for good when asked, on a
// loop device: refused without --yes, while another node holds the lease,
// and while the agent's claim records say the disk is staged here; then it
// zeroes the lease area and leaves the volume's data at the data offset
// untouched (docs/uninstall.md).
func TestLeaseClear(t *testing.T) {
	dev := leaseLoop(t, nil)
	if code, out, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA); code != 0 {
		t.Fatalf("format: %d %q %q", code, out, errs)
	}
	marker := []byte("volume data past the lease area")
	writeSyncedAt(t, dev, marker, lease.DataOffset)
	empty := t.TempDir()

	if code, _, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--state-dir", empty); code != 1 || !strings.Contains(errs, "--yes") {
		t.Fatalf("clear without --yes: %d %q", code, errs)
	}
	if !leaseShown(t, dev) {
		t.Fatal("clear without --yes touched the lease area")
	}

	clearRefusedWhileNodeAHolds(t, dev, empty)
	if !leaseShown(t, dev) {
		t.Fatal("a refused clear touched the lease area")
	}

	// The agent's claim record says the disk is staged here.
	staged := t.TempDir()
	writeClaim(t, filepath.Join(staged, "volumes", "dm9sLTE.json"), `{"volume":"vol-1","device":"`+dev+`","phase":"staged","state":"held"}`)
	if code, _, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--yes", "--state-dir", staged); code != 1 || !strings.Contains(errs, "staged as volume vol-1") {
		t.Fatalf("clear of a staged disk: %d %q", code, errs)
	}

	code, out, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--yes", "--state-dir", empty)
	if code != 0 || !strings.Contains(out, "lease area cleared") {
		t.Fatalf("clear: %d %q %q", code, out, errs)
	}
	if code, _, errs := runLeaseCLI(t, nil, "show", dev, "--uuid", cliUUIDB); code != 1 || !strings.Contains(errs, "no lease area") {
		t.Fatalf("show after clear: %d %q", code, errs)
	}
	checkLeaseAreaZeroDataKept(t, dev, marker)
}

// writeSyncedAt writes b at offset off of dev and syncs it.
func writeSyncedAt(t *testing.T, dev string, b []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// leaseShown says whether lease show finds dev's lease area.
func leaseShown(t *testing.T, dev string) bool {
	t.Helper()
	code, _, _ := runLeaseCLI(t, nil, "show", dev, "--uuid", cliUUIDB)
	return code == 0
}

// clearRefusedWhileNodeAHolds: while node A holds the disk, the clear is
// refused, naming it.
func clearRefusedWhileNodeAHolds(t *testing.T, dev, stateDir string) {
	t.Helper()
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	a := holdAsNodeA(t, dev)
	code, _, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--yes", "--state-dir", stateDir, "--node", "node-a="+cliUUIDA)
	a.release()
	if code != 1 || !strings.Contains(errs, keyA.String()) || !strings.Contains(errs, "not cleared") {
		t.Fatalf("clear while node A holds the lease: %d %q", code, errs)
	}
}

// checkLeaseAreaZeroDataKept: after the clear dev's lease area is zero and
// the volume's data (marker, at the data offset) is as it was.
func checkLeaseAreaZeroDataKept(t *testing.T, dev string, marker []byte) {
	t.Helper()
	b, err := os.ReadFile(dev)
	if err != nil {
		t.Fatal(err)
	}
	if i := bytes.IndexFunc(b[:lease.AreaSize], func(r rune) bool { return r != 0 }); i >= 0 {
		t.Errorf("byte %d of the lease area is not zero after clear", i)
	}
	if !bytes.Equal(b[lease.DataOffset:lease.DataOffset+len(marker)], marker) {
		t.Errorf("the volume's data at byte %d changed: %q", lease.DataOffset, b[lease.DataOffset:lease.DataOffset+len(marker)])
	}
}

func writeClaim(t *testing.T, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
