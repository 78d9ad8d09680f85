package reliability

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
)

// TestKillAtEveryHelper explores, one by one, every moment at which the
// agent runs a helper program (blkid, mkfs, fsck, e2fsck, resize2fs) during
// a volume's life: stage a blank disk, write a file, unstage, stage again,
// read it back, unstage. For the k-th helper run of that life it kills the
// agent's process group just before the helper, right after it, and, for
// mkfs, in the middle (the filesystem made without its superblock, as a
// kill in mke2fs leaves it); the agent is restarted and the cut-off call
// retried, as the kubelet does. Where TestCrashLoop kills at random
// moments and meets a given helper only by chance, this meets each of
// them, on a disk fenced by nothing (loop devices' default) and on one
// fenced by the on-disk lease (the helpers then run on the data mapping).
//
// After each life: the file reads back, the second stage mounted the
// filesystem of the first (same UUID), no mount, claim record or data
// mapping is left, and exactly one kill happened.
func TestKillAtEveryHelper(t *testing.T) {
	for _, fenced := range []bool{false, true} {
		name := "unfenced"
		if fenced {
			name = "lease"
		}
		t.Run(name, func(t *testing.T) {
			runs := helperLife(t, fenced, 0, "")
			if !slices.Contains(runs, "blkid") || !slices.Contains(runs, "mkfs.ext4") || !slices.Contains(runs, "fsck") {
				t.Fatalf("a volume's life ran %v; the exploration expects blkid, mkfs.ext4 and fsck at least", runs)
			}
			lives := 0
			for k := 1; k <= len(runs); k++ {
				modes := []string{"before", "after"}
				if runs[k-1] == "mkfs.ext4" {
					modes = append(modes, "during")
				}
				for _, mode := range modes {
					helperLife(t, fenced, k, mode)
					lives++
				}
			}
			t.Logf("%s: a volume's life runs %d helpers (%s); %d lives, each killed once", name, len(runs), strings.Join(runs, ", "), lives)
			figures.add("helper kills: agent lives, each killed once at a helper ("+name+")", lives)
		})
	}
}

// helperWrapper runs in front of one helper program. Every run is counted
// (under a lock: the agent may run two at once); the run numbered kill_at
// kills the agent's process group before the real program, after it, or
// (mkfs.ext4 only) after it with the primary superblock zeroed.
const helperWrapper = `#!/bin/sh
S=%[1]s
exec 9>>"$S/lock"
flock 9
n=$(( $(cat "$S/count") + 1 ))
echo "$n" >"$S/count"
echo "$n %[2]s $*" >>"$S/runs"
flock -u 9
exec 9>&-
if [ "$n" = "$(cat "$S/kill_at")" ]; then
	echo killed >"$S/killed"
	mode=$(cat "$S/mode")
	if [ "$mode" = before ]; then kill -KILL 0; fi
	%[3]s "$@"
	if [ "$mode" = during ] && [ "%[2]s" = mkfs.ext4 ]; then
		for dev; do :; done
		dd if=/dev/zero of="$dev" bs=2048 count=1 conv=notrunc,fsync status=none
	fi
	kill -KILL 0
fi
exec %[3]s "$@"
`

// helperLife runs one volume's life with a kill at the killAt-th helper
// run (none for 0), checks what it left, and returns the helpers it ran,
// in order. The runs before the kill are those of a life without one: the
// periodic claim check, which could run helpers at moments of its own, is
// held off.
func helperLife(t *testing.T, fenced bool, killAt int, mode string) []string {
	t.Helper()
	l := &life{t: t, h: newHost(t), fenced: fenced, name: fmt.Sprintf("kill at helper run %d (%s)", killAt, mode)}
	defer l.h.close()
	if killAt == 0 {
		l.name = "no kill"
	}
	l.configure()
	l.wrapHelpers(killAt, mode)
	start := time.Now()
	defer func() { t.Logf("%s: %s", l.name, time.Since(start).Round(10*time.Millisecond)) }()
	l.h.start()
	l.live()
	runs := l.runs()
	_, err := os.Stat(filepath.Join(l.state, "killed"))
	if killed := err == nil; killed != (killAt > 0) {
		t.Fatalf("%s: killed %v, after helper runs %v", l.name, killed, runs)
	}
	return runs
}

// life is one of TestKillAtEveryHelper's volume lives.
type life struct {
	t      *testing.T
	h      *host
	fenced bool
	name   string
	state  string // the wrappers' counters and log
}

// configure holds the claim check off and, for a fenced life, has loop
// devices fenced by the lease.
func (l *life) configure() {
	b, err := os.ReadFile(l.h.cfg)
	if err != nil {
		l.t.Fatal(err)
	}
	cfg := strings.Replace(string(b), "  check_interval: 200ms\n", "  check_interval: 1h\n", 1)
	if l.fenced {
		// This host has no watchdog device (nor softdog): the lease is
		// held without one, which the guests' tests do not allow. Its
		// timing is short (a settle of 0.5 s, not 4 s), as nothing here
		// is slow.
		cfg = strings.Replace(cfg, "  allow_loop_devices: true\n",
			"  allow_loop_devices: true\n  lease_loop_devices: true\n  lease:\n    watchdog_device: none-unsafe\n"+
				"    io_timeout: 250ms\n    renew: 500ms\n    fail: 2s\n    watchdog: 0s\n", 1)
	}
	if err := os.WriteFile(l.h.cfg, []byte(cfg), 0o644); err != nil {
		l.t.Fatal(err)
	}
}

// wrapHelpers puts helperWrapper in front of every helper the agent runs.
func (l *life) wrapHelpers(killAt int, mode string) {
	t := l.t
	l.state = filepath.Join(l.h.dir, "helpers")
	bin := filepath.Join(l.state, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for f, v := range map[string]string{"count": "0", "kill_at": strconv.Itoa(killAt), "mode": mode} {
		if err := os.WriteFile(filepath.Join(l.state, f), []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, helper := range []string{"blkid", "mkfs.ext4", "fsck", "e2fsck", "resize2fs"} {
		real, err := exec.LookPath(helper)
		if err != nil {
			t.Fatalf("%s is not installed", helper)
		}
		script := fmt.Sprintf(helperWrapper, l.state, helper, real)
		if err := os.WriteFile(filepath.Join(bin, helper), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	l.h.env = []string{"PATH=" + bin + ":" + os.Getenv("PATH")}
}

// live stages, writes, unstages, stages again, reads and unstages, each
// call retried through the agent's deaths; then nothing may be left.
func (l *life) live() {
	t, h := l.t, l.h
	staging := filepath.Join(h.kubelet, "plugins", "kubernetes.io", "csi", "cloud.whitesky.csi", "vol-helpers", "globalmount")
	req := &api.StageVolumeRequest{VolumeId: "loc-1/4713", Device: &api.DeviceLocator{LoopBackingFile: h.img},
		StagingPath: staging, FsType: "ext4", AllowUnfenced: !l.fenced}
	stage := func(ctx context.Context) error { return h.stage(ctx, req) }
	unstage := func(ctx context.Context) error { return h.unstage(ctx, req.VolumeId, staging) }
	l.call("first stage", stage)
	uuid := blkidUUIDIn(t, h, l.fenced)
	writeMarker(t, staging, 1)
	l.call("first unstage", unstage)
	l.call("second stage", stage)
	if got := blkidUUIDIn(t, h, l.fenced); got != uuid {
		t.Fatalf("%s: the second stage mounted filesystem %s, the first made %s", l.name, got, uuid)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "marker-0001")); err != nil || string(b) != markerText(1) {
		t.Fatalf("%s: the file written after the first stage reads %q, %v", l.name, b, err)
	}
	l.call("second unstage", unstage)
	if n := countMountsAt(staging); n != 0 {
		t.Fatalf("%s: %d mounts left at the staging path", l.name, n)
	}
	if ents, _ := os.ReadDir(filepath.Join(h.state, "volumes")); len(ents) != 0 {
		t.Fatalf("%s: %d claim records left after unstage", l.name, len(ents))
	}
	if loops := h.loopDevices(); len(loops) != 1 {
		t.Fatalf("%s: loop devices over the disk after unstage: %v, want the disk's own", l.name, loops)
	}
}

// call runs op until it succeeds, restarting the agent when it died
// under it; an error from a live agent fails the test.
func (l *life) call(what string, op func(ctx context.Context) error) {
	t, h := l.t, l.h
	t.Helper()
	for restarts := 0; ; restarts++ {
		ctx, cancel := context.WithTimeout(context.Background(), askTimeout)
		err := op(ctx)
		cancel()
		if err == nil {
			return
		}
		select {
		case <-h.done:
		case <-time.After(3 * time.Second):
			t.Fatalf("%s: %s failed with the agent running: %v\nhelper runs: %v", l.name, what, err, l.runs())
		}
		h.closeClient()
		t.Logf("%s: %s cut off; restarting the agent", l.name, what)
		if restarts > 3 {
			t.Fatalf("%s: %s still failing after %d restarts: %v", l.name, what, restarts, err)
		}
		h.start()
	}
}

// runs are the helpers run so far, in order.
func (l *life) runs() []string {
	var runs []string
	b, _ := os.ReadFile(filepath.Join(l.state, "runs"))
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if f := strings.Fields(line); len(f) > 1 {
			runs = append(runs, f[1])
		}
	}
	return runs
}

// blkidUUIDIn is the UUID of the volume's filesystem: on the disk, or on
// the lease disk's data area (from 1 MiB).
func blkidUUIDIn(t *testing.T, h *host, fenced bool) string {
	t.Helper()
	if !fenced {
		return blkidUUID(t, h.loop)
	}
	out, err := exec.Command("blkid", "-p", "-O", strconv.Itoa(1<<20), "-o", "value", "-s", "UUID", h.loop).Output()
	if err != nil || strings.TrimSpace(string(out)) == "" {
		t.Fatalf("blkid of the data area of %s: %v %q", h.loop, err, out)
	}
	return strings.TrimSpace(string(out))
}
