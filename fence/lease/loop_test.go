package lease

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// Test nodes: two SMBIOS UUIDs and their keys.
const (
	uuidA = "8c2f4d0e-1b7a-4e61-9d3c-5a0b1c2d3e4f"
	uuidB = "3f9a7b21-64c5-4d08-a1e2-7b8c9d0e1f2a"
)

var (
	keyA, _ = fence.KeyFromUUID(uuidA)
	keyB, _ = fence.KeyFromUUID(uuidB)
	nodes   = fence.Directory{keyA: "node-a", keyB: "node-b"}
)

// testTiming keeps the lease's proportions at a scale a test can wait for:
// Expiry is 2.25s, Settle 500ms. The fail bound leaves a holder's renewals
// room to be late on a loaded test machine without the holder fencing
// itself, which a test of who wins would misread.
var testTiming = Timing{IOTimeout: 250 * time.Millisecond, Renew: 500 * time.Millisecond, Fail: 2 * time.Second}

// readTiming is for tests that only read the lease area (Probe): what they
// check does not depend on timing, so a read slowed by a loaded machine
// (a loop device read took over 250 ms at load 15) must not fail them.
var readTiming = Timing{IOTimeout: 10 * time.Second, Renew: 10 * time.Second, Fail: 20 * time.Second}

// loopDevice attaches a real loop device (with the given logical sector
// size) to a sparse file of size bytes, optionally prepared by
// prepare(imgPath) first.
func loopDevice(t testing.TB, size int64, sector int, prepare func(img string)) string {
	t.Helper()
	hosttest.NeedRoot(t, "needs root to attach a loop device")
	// Backing files live in memory where possible: the lease's O_DSYNC
	// writes then cost no flush of the test machine's disk, whose latency
	// under load says nothing about the lease.
	dir := t.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if dir, err = os.MkdirTemp("/dev/shm", "lease-test-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	img := filepath.Join(dir, "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if prepare != nil {
		prepare(img)
	}
	out, err := exec.Command("losetup", "--find", "--show", "--sector-size", strconv.Itoa(sector), img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup -d %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

func openDev(t testing.TB, path string) *Device {
	t.Helper()
	d, err := OpenDevice(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// formattedLoop is a loop device with a lease area.
func formattedLoop(t testing.TB, sector int) string {
	t.Helper()
	dev := loopDevice(t, 8<<20, sector, nil)
	d := openDev(t, dev)
	wrote, err := Format(context.Background(), d, FormatOptions{Key: keyA, Timeout: time.Second})
	if err != nil || !wrote {
		t.Fatalf("format %s: %v %v", dev, wrote, err)
	}
	return dev
}

// node is one "host": its own open descriptor and engine. Its OnLost
// reports the loss and answers stopped (nil) unless stop says otherwise;
// the hosts share one device, so no test node sets it read-only.
type node struct {
	e    *Engine
	lost chan *fence.LostError
	stop func() bool
}

func newNode(t testing.TB, dev string, uuid string, name string) *node {
	t.Helper()
	return newNodeTiming(t, dev, uuid, name, testTiming)
}

func newNodeTiming(t testing.TB, dev string, uuid string, name string, tm Timing) *node {
	t.Helper()
	k, err := fence.KeyFromUUID(uuid)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{lost: make(chan *fence.LostError, 1)}
	n.e, err = New(openDev(t, dev), Config{Key: k, Node: uuid, NodeName: name, Disk: "disk-1", Resolver: nodes,
		Timing: tm, OnLost: func(l *fence.LostError) bool {
			n.lost <- l
			return n.stop == nil || n.stop()
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stopRenewing)
	return n
}

// stopRenewing stops the node's renewer without releasing, as when its
// agent dies.
func (n *node) stopRenewing() { n.e.stopRenewer() }

func (n *node) pause(p bool) {
	n.e.mu.Lock()
	n.e.paused = p
	n.e.mu.Unlock()
}

func status(t testing.TB, dev string) Status {
	t.Helper()
	d := openDev(t, dev)
	st, _, err := ReadStatus(context.Background(), d, 0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
