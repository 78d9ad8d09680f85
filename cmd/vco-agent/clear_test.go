package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// lease clear takes a disk's fence state off for good when asked, on a
// loop device: refused without --yes, while another node holds the lease,
// and while the agent's claim records say the disk is staged here; then it
// zeroes the lease area and leaves the volume's data at the data offset
// untouched (issue 20, path 8: uninstalling).
func TestLeaseClear(t *testing.T) {
	dev := leaseLoop(t, nil)
	if code, out, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA); code != 0 {
		t.Fatalf("format: %d %q %q", code, out, errs)
	}
	marker := []byte("volume data past the lease area")
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(marker, lease.DataOffset); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	empty := t.TempDir()
	leaseShown := func() bool {
		code, _, _ := runLeaseCLI(t, nil, "show", dev, "--uuid", cliUUIDB)
		return code == 0
	}

	if code, _, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--state-dir", empty); code != 1 || !strings.Contains(errs, "--yes") {
		t.Fatalf("clear without --yes: %d %q", code, errs)
	}
	if !leaseShown() {
		t.Fatal("clear without --yes touched the lease area")
	}

	// Node A holds the disk: the clear is refused, naming it.
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	interrupt := make(chan os.Signal, 1)
	claimed := make(chan struct{})
	var wg sync.WaitGroup
	var outA, errA bytes.Buffer
	wg.Add(1)
	go func() {
		defer wg.Done()
		leaseMainWith(append([]string{"acquire", dev, "--uuid", cliUUIDA, "--name", "node-a"}, fastLease...), &outA, &errA, interrupt, leaseHooks{ready: func() { close(claimed) }})
	}()
	select {
	case <-claimed:
	case <-time.After(10 * time.Second):
		t.Fatalf("node A did not claim: %s %s", outA.String(), errA.String())
	}
	code, _, errs := runLeaseCLI(t, nil, "clear", dev, "--uuid", cliUUIDB, "--yes", "--state-dir", empty, "--node", "node-a="+cliUUIDA)
	interrupt <- os.Interrupt
	wg.Wait()
	if code != 1 || !strings.Contains(errs, keyA.String()) || !strings.Contains(errs, "not cleared") {
		t.Fatalf("clear while node A holds the lease: %d %q", code, errs)
	}
	if !leaseShown() {
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
