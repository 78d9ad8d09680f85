package lab

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

type recorded struct {
	name  string
	pid   int
	start uint64
}

// waitForPIDFiles waits until the lab in dir has recorded all of names,
// and returns what it recorded.
func waitForPIDFiles(t *testing.T, dir string, names ...string) []recorded {
	t.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	for time.Now().Before(deadline) {
		var recs []recorded
		for _, n := range names {
			b, err := os.ReadFile(filepath.Join(PIDDir(dir), n+".pid"))
			if err != nil {
				break
			}
			var r recorded
			var path string
			if _, err := fmt.Sscanf(string(b), "%d %d %s", &r.pid, &r.start, &path); err != nil {
				break
			}
			r.name = n
			recs = append(recs, r)
		}
		if len(recs) == len(names) {
			return recs
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("the lab in %s did not record %v within 5 minutes", dir, names)
	return nil
}

func waitGone(t *testing.T, recs []recorded) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, r := range recs {
		for Alive(r.pid, r.start) {
			if time.Now().After(deadline) {
				t.Errorf("%s (pid %d) still runs after the lab process ended", r.name, r.pid)
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// startVcoLab runs `vco-lab ARGS` and returns it with its lab directory.
// A run whose boot is what a test waits for leaves E6 out (-transit
// none): E6 builds the Vault server first on a machine without it in the
// cache, minutes before anything boots.
// `run` keeps the lab of each disk kind in a directory of its own under
// -dir; the tests name one kind, and the directory returned is its lab's.
func startVcoLab(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	if ok, why := GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	bin, err := TestBinaries()
	if err != nil {
		t.Fatal(err)
	}
	top := t.TempDir()
	dir := KindDir(top, SCSIBlock)
	cmd := exec.Command(filepath.Join(bin, "vco-lab"), append(args, "-kind", string(SCSIBlock), "-dir", top, "-bin", bin)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		_, _ = DownRun(top)
	})
	return cmd, dir
}

// TestInterruptTearsDown: SIGINT while the lab boots kills every process
// it started, by its recorded PID.
func TestInterruptTearsDown(t *testing.T) {
	cmd, dir := startVcoLab(t, "run", "-transit", "none")
	recs := waitForPIDFiles(t, dir, "tgtd", "qemu-node-a", "qemu-node-b")
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code == 0 {
		t.Errorf("vco-lab run exited 0 after SIGINT during boot")
	}
	waitGone(t, recs)
	if left, _ := filepath.Glob(filepath.Join(PIDDir(dir), "*.pid")); len(left) != 0 {
		t.Errorf("pid files left after an orderly teardown: %v", left)
	}
}

// TestKilledLabTakesItsProcessesAlong: when the lab process is SIGKILLed
// (no handler runs, as when go test's -timeout fires), its guests and tgtd
// die with it.
func TestKilledLabTakesItsProcessesAlong(t *testing.T) {
	cmd, dir := startVcoLab(t, "run", "-transit", "none")
	recs := waitForPIDFiles(t, dir, "tgtd", "qemu-node-a", "qemu-node-b")
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	waitGone(t, recs)
}
