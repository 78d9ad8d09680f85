package e2e_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// labBinaries is a directory with the three static binaries vco-lab puts
// in its guests: make's bin/ (VCO_LAB_BIN), or built here.
func labBinaries(t *testing.T) string {
	if d := os.Getenv("VCO_LAB_BIN"); d != "" {
		return d
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	d := t.TempDir()
	cmd := exec.Command("go", "build", "-trimpath", "-o", d+"/", "./cmd/vco-lab", "./cmd/vco-agent", "./cmd/vco-csi")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the lab binaries: %v\n%s", err, out)
	}
	return d
}

// TestUpSimExecDown is the hands-on path: `vco-lab up -sim` leaves the
// simulator, tgtd and two guests with their node stacks running; a CSI
// call and an agent command run in a guest through `vco-lab exec`; the
// simulator answers with a VM per guest; `vco-lab down` stops every
// process it started.
func TestUpSimExecDown(t *testing.T) {
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	bin := labBinaries(t)
	dir := t.TempDir()
	vcoLab := func(args ...string) (string, error) {
		full := append([]string{args[0], "-dir", dir, "-bin", bin}, args[1:]...)
		out, err := exec.Command(filepath.Join(bin, "vco-lab"), full...).CombinedOutput()
		return string(out), err
	}
	t.Cleanup(func() { _, _ = vcoLab("down") })
	if out, err := vcoLab("up", "-sim"); err != nil {
		t.Fatalf("vco-lab up -sim: %v\n%s", err, out)
	}
	si := readSimInfo(t, dir)
	checkNodeStacksAnswer(t, vcoLab)
	if out, err := vcoLab("status"); err != nil || !strings.Contains(out, si.APIURL) {
		t.Errorf("vco-lab status does not show the simulator at %s: %v\n%s", si.APIURL, err, out)
	}
	out, err := vcoLab("down")
	if err != nil {
		t.Fatalf("vco-lab down: %v\n%s", err, out)
	}
	for _, want := range []string{"qemu-node-a", "qemu-node-b", "tgtd", "vco-lab-sim"} {
		if !strings.Contains(out, "killed "+want) {
			t.Errorf("vco-lab down did not stop %s:\n%s", want, out)
		}
	}
	// The simulator process is gone (reaped by init once killed).
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(si.PID, 0) == nil {
		if time.Now().After(deadline) {
			t.Errorf("simulator pid %d still present after down", si.PID)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// simInfo is what `vco-lab up -sim` writes to sim.json.
type simInfo struct {
	APIURL string           `json:"api_url"`
	VMs    map[string]int64 `json:"vms"`
	PID    int              `json:"pid"`
}

// readSimInfo reads the lab's sim.json: the simulator has a VM for each
// guest.
func readSimInfo(t *testing.T, dir string) simInfo {
	t.Helper()
	var si simInfo
	b, err := os.ReadFile(filepath.Join(dir, "sim.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &si); err != nil {
		t.Fatal(err)
	}
	if len(si.VMs) != 2 || si.VMs["node-a"] == 0 || si.VMs["node-b"] == 0 {
		t.Errorf("simulator VMs %v, want node-a and node-b", si.VMs)
	}
	return si
}

// checkNodeStacksAnswer: through `vco-lab exec`, node-a's plugin answers
// a CSI call with its node id, and node-b's agent lists its events.
func checkNodeStacksAnswer(t *testing.T, vcoLab func(args ...string) (string, error)) {
	t.Helper()
	out, err := vcoLab("exec", "node-a", "--", "/bin/vco-lab", "csi-call", "NodeGetInfo", "{}")
	if err != nil {
		t.Fatalf("csi-call NodeGetInfo: %v\n%s", err, out)
	}
	var rep struct {
		OK    bool `json:"ok"`
		Reply struct {
			NodeID string `json:"nodeId"`
		} `json:"reply"`
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &rep); err != nil || !rep.OK || rep.Reply.NodeID != lab.NodeUUID("node-a") {
		t.Errorf("NodeGetInfo in node-a: %q (%v); want node id %s", out, err, lab.NodeUUID("node-a"))
	}
	if out, err := vcoLab("exec", "node-b", "--", "/bin/vco-agent", "events"); err != nil || !strings.Contains(out, "AgentStarted") {
		t.Errorf("vco-agent events in node-b: %v\n%s", err, out)
	}
}
