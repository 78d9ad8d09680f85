package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// The commands run here against scsitest, a model of a SPC-4 target (one
// initiator per node UUID); the lab runs the same binary in guests against
// tgt.

const (
	cliUUIDA = "4c4c4544-0042-3610-8052-b4c04f4e3332"
	cliUUIDB = "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab"
)

func withModel(t *testing.T, opts scsitest.Options) *scsitest.Target {
	tgt := scsitest.New(opts)
	saved := openFenceTarget
	openFenceTarget = func(_ context.Context, o *fenceOptions, device string) (*fenceTarget, error) {
		return &fenceTarget{
			disk:      discovery.Disk{Name: "sdb", DevPath: device, Kind: discovery.KindSCSI},
			transport: tgt.Initiator(o.uuid),
			close:     func() error { return nil },
		}, nil
	}
	t.Cleanup(func() { openFenceTarget = saved })
	return tgt
}

func runFenceCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := fenceMain(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestFenceCommands(t *testing.T) {
	tgt := withModel(t, scsitest.Options{NoPreemptAndAbort: true})
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	keyB, _ := fence.KeyFromUUID(cliUUIDB)
	names := []string{"--node", "node-a=" + cliUUIDA, "--node", "node-b=" + cliUUIDB}

	fenceAcquireByARefusesB(t, keyA, names)
	code, out, errs := runFenceCLI(t, append([]string{"show", "/dev/sdb", "--uuid", cliUUIDB}, names...)...)
	for _, want := range []string{keyA.String() + " node node-a initiator " + cliUUIDA + " [holder]", "Write Exclusive, held by key " + keyA.String() + " (node node-a)", "this node:    key " + keyB.String()} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("show lacks %q: %d %q %q", want, code, out, errs)
		}
	}
	if code, out, errs = runFenceCLI(t, "check", "/dev/sdb", "--uuid", cliUUIDA); code != 0 {
		t.Fatalf("check A: %d %q %q", code, out, errs)
	}
	// Takeover with a grant (the model, like tgt, lacks PREEMPT AND ABORT).
	grant := (&fence.Grant{Disk: "disk-9", Node: cliUUIDB, Supersedes: []fence.Key{keyA}}).Encode()
	code, out, errs = runFenceCLI(t, "acquire", "/dev/sdb", "--uuid", cliUUIDB, "--disk", "disk-9", "--grant", grant)
	if code != 0 || !strings.Contains(out, "took over") || !strings.Contains(out, "PREEMPT (the target rejects PREEMPT AND ABORT)") {
		t.Fatalf("takeover: %d %q %q", code, out, errs)
	}
	code, out, errs = runFenceCLI(t, append([]string{"check", "/dev/sdb", "--uuid", cliUUIDA}, names...)...)
	if code != 1 || !strings.Contains(errs, "lost") {
		t.Fatalf("check A after takeover: %d %q %q", code, out, errs)
	}
	fenceReleaseByBLeavesNoReservation(t, tgt)
	code, out, errs = runFenceCLI(t, "cycle", "/dev/sdb", "--uuid", cliUUIDA, "--count", "3")
	if code != 0 || !strings.Contains(out, "3 cycles, median acquire") {
		t.Fatalf("cycle: %d %q %q", code, out, errs)
	}
}

// fenceAcquireByARefusesB: node A acquires the disk; node B is refused,
// naming A's key and node, as text and as JSON.
func fenceAcquireByARefusesB(t *testing.T, keyA fence.Key, names []string) {
	t.Helper()
	code, out, errs := runFenceCLI(t, "acquire", "/dev/sdb", "--uuid", cliUUIDA)
	if code != 0 || !strings.Contains(out, "claimed with key "+keyA.String()) {
		t.Fatalf("acquire A: %d %q %q", code, out, errs)
	}
	code, out, errs = runFenceCLI(t, append([]string{"acquire", "/dev/sdb", "--uuid", cliUUIDB}, names...)...)
	if code != 1 || !strings.Contains(errs, keyA.String()) || !strings.Contains(errs, "node-a") {
		t.Fatalf("acquire B: %d %q %q", code, out, errs)
	}
	// JSON refusal carries the holder.
	code, out, _ = runFenceCLI(t, append([]string{"acquire", "--json", "/dev/sdb", "--uuid", cliUUIDB}, names...)...)
	var refusal struct {
		OK         bool      `json:"ok"`
		Refused    bool      `json:"refused"`
		Holder     fence.Key `json:"holder"`
		HolderNode string    `json:"holder_node"`
	}
	if err := json.Unmarshal([]byte(out), &refusal); err != nil || code != 1 || refusal.OK || !refusal.Refused || refusal.Holder != keyA || refusal.HolderNode != "node-a" {
		t.Fatalf("json refusal %d %q: %+v %v", code, out, refusal, err)
	}
}

// fenceReleaseByBLeavesNoReservation: after B's release, show --json has
// no keys and no reservation, and B is no longer registered.
func fenceReleaseByBLeavesNoReservation(t *testing.T, tgt *scsitest.Target) {
	t.Helper()
	if code, out, errs := runFenceCLI(t, "release", "/dev/sdb", "--uuid", cliUUIDB); code != 0 {
		t.Fatalf("release: %d %q %q", code, out, errs)
	}
	code, out, _ := runFenceCLI(t, "show", "--json", "/dev/sdb", "--uuid", cliUUIDB)
	var show struct {
		OK     bool `json:"ok"`
		Status struct {
			Keys        []any `json:"keys"`
			Reservation any   `json:"reservation"`
			Support     struct {
				Method string `json:"method"`
			} `json:"support"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(out), &show); err != nil || code != 0 || !show.OK || len(show.Status.Keys) != 0 || show.Status.Reservation != nil || show.Status.Support.Method != "scsi-pr" {
		t.Fatalf("show --json after release: %d %q %v", code, out, err)
	}
	if _, ok := tgt.Registered(cliUUIDB); ok {
		t.Fatal("B still registered")
	}
}

func TestFenceCommandErrors(t *testing.T) {
	withModel(t, scsitest.Options{NotSCSI: true})
	if code, _, errs := runFenceCLI(t, "acquire", "/dev/vdb", "--uuid", cliUUIDA); code != 1 || !strings.Contains(errs, "not a SCSI device") {
		t.Fatalf("acquire on virtio-blk: %d %q", code, errs)
	}
	if code, out, _ := runFenceCLI(t, "show", "/dev/vdb", "--uuid", cliUUIDA); code != 0 || !strings.Contains(out, "not supported") {
		t.Fatalf("show on virtio-blk: %d %q", code, out)
	}
	for _, args := range [][]string{
		{"bogus", "/dev/sdb"},
		{"show"},
		{"show", "/dev/sdb", "/dev/sdc"},
		{"show", "/dev/sdb", "--no-such-flag"},
	} {
		if code, _, _ := runFenceCLI(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
	for _, args := range [][]string{
		{"acquire", "/dev/sdb", "--uuid", "nope"},
		{"acquire", "/dev/sdb", "--uuid", cliUUIDA, "--grant", "{"},
		{"release", "/dev/sdb", "--uuid", cliUUIDA, "--grant", "{}"},
		{"acquire", "/dev/sdb", "--uuid", cliUUIDA, "--type", "wero"},
		{"acquire", "/dev/sdb", "--uuid", cliUUIDA, "--node", "x"},
	} {
		if code, _, errs := runFenceCLI(t, args...); code != 1 || errs == "" {
			t.Errorf("%v: exit %d %q, want 1 with a message", args, code, errs)
		}
	}
}

func TestFenceKeyFromSysfs(t *testing.T) {
	withModel(t, scsitest.Options{})
	root := t.TempDir()
	// Without --uuid the key comes from the SMBIOS UUID under --sysfs-root;
	// an unreadable identity is an error naming --uuid.
	if code, _, errs := runFenceCLI(t, "acquire", "/dev/sdb", "--sysfs-root", root); code != 1 || !strings.Contains(errs, "--uuid") {
		t.Fatalf("no identity: %d %q", code, errs)
	}
	if err := os.MkdirAll(filepath.Join(root, "class/dmi/id"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "class/dmi/id/product_uuid"), []byte(strings.ToUpper(cliUUIDA)+"\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	if code, out, errs := runFenceCLI(t, "acquire", "/dev/sdb", "--sysfs-root", root); code != 0 || !strings.Contains(out, keyA.String()) {
		t.Fatalf("key from sysfs: %d %q %q", code, out, errs)
	}
}

// TestFenceOnLoopDevice runs the real path (sysfs discovery, open, identity
// check, SG_IO) on a loop device: the host has no SCSI, and a loop device
// answers SG_IO the way virtio-blk does, so the disk has no PR.
func TestFenceOnLoopDevice(t *testing.T) {
	hosttest.NeedRoot(t, "needs root to attach a loop device")
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	b, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, b)
	}
	loop := strings.TrimSpace(string(b))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })

	code, out, errs := runFenceCLI(t, "show", loop, "--uuid", cliUUIDA, "--json")
	var show struct {
		OK   bool `json:"ok"`
		Disk struct {
			DevPath string `json:"dev_path"`
		} `json:"disk"`
		Status struct {
			Support fence.Support `json:"support"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(out), &show); err != nil || code != 0 || show.Disk.DevPath != loop ||
		show.Status.Support.Method != fence.MethodNone || !strings.Contains(show.Status.Support.Reason, "not a SCSI device") {
		t.Fatalf("show on %s: %d %q %q", loop, code, out, errs)
	}
	if code, _, errs := runFenceCLI(t, "acquire", loop, "--uuid", cliUUIDA); code != 1 || !strings.Contains(errs, "not supported") {
		t.Fatalf("acquire on %s: %d %q", loop, code, errs)
	}
}
