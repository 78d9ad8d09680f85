package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// A disk this node has staged: the agent (node B) holds its lease and
// renews it, the lease's data area is mapped (a loop device at byte
// 1048576, what the agent's stage makes), and the agent's claim record
// names the disk. Nothing may give that fence up from the command line
// (docs/architecture.md, "The release guard": a fence is given up only
// when this node has proven nothing of the volume is in use).
type stagedLeaseDisk struct {
	dev, stateDir, data string
	agent               *lease.Engine
	keyB                fence.Key
}

func stageLeaseDiskAsAgent(t *testing.T) *stagedLeaseDisk {
	t.Helper()
	dev := leaseLoop(t, nil)
	if code, out, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDB); code != 0 {
		t.Fatalf("format: %d %q %q", code, out, errs)
	}
	keyB, _ := fence.KeyFromUUID(cliUUIDB)
	d, err := lease.OpenDevice(dev)
	if err != nil {
		t.Fatal(err)
	}
	dir, _ := fence.NewDirectory(nil)
	agent, err := lease.New(d, lease.Config{Key: keyB, Node: cliUUIDB, NodeName: "node-b", Resolver: dir,
		Timing: lease.Timing{IOTimeout: 100 * time.Millisecond, Renew: 200 * time.Millisecond, Fail: 800 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agent.Acquire(context.Background(), nil); err != nil {
		t.Fatalf("the agent's acquire: %v", err)
	}
	t.Cleanup(func() { agent.Release(context.Background()); d.Close() })
	out, err := exec.Command("losetup", "--find", "--show", "--offset", fmt.Sprint(lease.DataOffset), dev).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup of the data area: %v: %s", err, out)
	}
	data := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", data).Run() })
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	staged := t.TempDir()
	writeClaim(t, filepath.Join(staged, "volumes", "dm9sLTE.json"), fmt.Sprintf(`{"volume":"vol-1","device":%q,"devnum":"%d:%d","phase":"staged","state":"held","method":"lease"}`,
		dev, unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	return &stagedLeaseDisk{dev: dev, stateDir: staged, data: data, agent: agent, keyB: keyB}
}

// heldByAgent fails the test unless node B still owns the disk's lease.
func (s *stagedLeaseDisk) heldByAgent(t *testing.T, after string) {
	t.Helper()
	owner, err := lease.Inspect(context.Background(), s.dev, time.Second)
	if err != nil {
		t.Fatalf("after %s: reading the lease: %v", after, err)
	}
	if owner == nil || owner.Key != s.keyB {
		t.Errorf("after %s the lease of %s, staged on this node and mapped at %s, is no longer held by this node (owner %v): its fence was given up while the volume is in use",
			after, s.dev, s.data, owner)
	}
}

// `vco-agent lease release` of a disk this node has staged, mounted or
// mapped marks this node's slot released: it makes no proof that nothing
// of the disk is in use (clear does), so the lease the agent renews for a
// mapped volume is given up, and another node's stage may take the disk
// without waiting while this node still writes through the mapping.
func TestBreakLeaseReleaseOfStagedDisk(t *testing.T) {
	s := stageLeaseDiskAsAgent(t)
	code, out, errs := runLeaseCLI(t, nil, "release", s.dev, "--uuid", cliUUIDB, "--state-dir", s.stateDir)
	if code == 0 {
		t.Errorf("lease release of a staged, mapped disk succeeded: %q %q; want a refusal naming what uses it", out, errs)
	}
	s.heldByAgent(t, "lease release")
}

// `vco-agent lease acquire --hold-for` of a disk this node has staged
// resumes the agent's own claim (same node key), then releases it when
// the hold ends: the fence of a mapped volume is given up, with no proof.
func TestBreakLeaseAcquireReleasesStagedDisk(t *testing.T) {
	s := stageLeaseDiskAsAgent(t)
	code, out, errs := runLeaseCLI(t, nil, "acquire", s.dev, "--uuid", cliUUIDB, "--state-dir", s.stateDir, "--hold-for", "300ms")
	t.Logf("lease acquire: %d %q %q", code, out, errs)
	s.heldByAgent(t, "lease acquire --hold-for")
}
