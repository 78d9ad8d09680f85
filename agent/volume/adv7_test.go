package volume

// Directed reproductions, seventh adversarial round, over the manager
// simulation's modelled node (sim_test.go, break_test.go).

import (
	"context"
	"strings"
	"sync"
	"testing"

	utilexec "k8s.io/utils/exec"
)

// adv7Exec stands in for the commands a filesystem grow runs (blkid,
// resize2fs): the simulation's disks are no files, so nothing real can
// run. It records each command line and answers blkid with ext4.
type adv7Exec struct {
	utilexec.Interface
	mu   *sync.Mutex
	runs *[]string
}

type adv7Cmd struct {
	utilexec.Cmd
	out []byte
}

func (c adv7Cmd) CombinedOutput() ([]byte, error) { return c.out, nil }

func (e adv7Exec) Command(name string, args ...string) utilexec.Cmd {
	e.mu.Lock()
	*e.runs = append(*e.runs, strings.Join(append([]string{name}, args...), " "))
	e.mu.Unlock()
	if name == "blkid" {
		return adv7Cmd{out: []byte("DEVNAME=" + args[len(args)-1] + "\nTYPE=ext4\n")}
	}
	return adv7Cmd{}
}

func (e adv7Exec) CommandContext(_ context.Context, name string, args ...string) utilexec.Cmd {
	return e.Command(name, args...)
}

// adv7ExpandAfterNodeReused stages the filesystem volume a without
// fencing (the explicit opt-in), then (swap) its disk leaves the node and
// the kernel gives its device node to another disk, node-b's, before the
// agent has handled the removal's uevent; then the kubelet calls
// NodeExpand. It checks that no grow runs on that other disk.
func adv7ExpandAfterNodeReused(t *testing.T, swap bool) {
	a := &simVolume{id: "pvc-a", serial: "sim0"}
	runBreak(t, false, []*simVolume{a}, func(r *simRun, h *hookHost) {
		ctx := context.Background()
		var mu sync.Mutex
		var runs []string
		r.m.exec = adv7Exec{mu: &mu, runs: &runs}
		r.m.o.Config.AllowUnfenced = true
		r.m.o.Fencers = noFencingNow{simFencers{w: r.w, gen: r.w.gen}}
		req := r.stageReq(a)
		req.AllowUnfenced = true
		if _, err := r.m.Stage(ctx, req); err != nil {
			t.Fatalf("stage %s: %v", a.id, err)
		}
		var path string
		r.w.mu.Lock()
		path = r.w.disks[a.serial].path
		if swap {
			d := r.w.disks[a.serial]
			d.present, d.removed = false, true
			r.w.minor++
			r.w.disks["sim9"] = &simDiskState{serial: "sim9", path: d.path, minor: r.w.minor, present: true, lease: true, leaseArea: true, holder: "other"}
		}
		r.w.mu.Unlock()
		if swap {
			r.logBreak("disk %s leaves the node; disk sim9 (node-b's, fenced with the lease, which blocks no write) appears at its node %s; the removal's uevent is not handled yet", a.serial, path)
		}
		n, err := r.m.Expand(ctx, a.id, a.staging, 0)
		mu.Lock()
		got := append([]string(nil), runs...)
		mu.Unlock()
		r.logBreak("NodeExpand %s: %d bytes, %s; commands run: %q", a.id, n, errText(err), got)
		grew := false
		for _, c := range got {
			if strings.HasPrefix(c, "resize2fs ") && strings.HasSuffix(c, " "+path) || c == "resize2fs "+path {
				grew = true
			}
		}
		r.w.mu.Lock()
		defer r.w.mu.Unlock()
		switch {
		case swap && grew:
			r.w.violate("P1: NodeExpand of %s ran resize2fs on %s, which is now disk sim9 (node-b's volume, not %s's disk %s), and answered %d bytes, %s", a.id, path, a.id, a.serial, n, errText(err))
		case !swap && (err != nil || !grew):
			t.Errorf("control: NodeExpand of %s did not grow its own disk %s: %v; commands %q", a.id, path, err, got)
		}
	})
}

// NodeExpand of a staged volume grows "the filesystem" by the device node
// path recorded at stage time (c.Device, through the claim's
// MountDevice) without proving that the node is still the volume's disk:
// Expand checks only the record (staged, not abnormal); it runs neither
// the disk's Verify nor the fence check that Publish now runs
// (stillOurs). When the disk leaves the node and the kernel gives its
// node name to another disk before the agent has handled the removal (the
// watcher lags, or its netlink socket overflowed and the rescan is to
// come), blkid and resize2fs run on that other disk -- another node's
// volume, whose lease blocks none of this node's writes -- and the
// kubelet is told the volume grew to that disk's size.
func TestAdv7ExpandGrowsWhateverDiskNowHasTheNodeName(t *testing.T) {
	adv7ExpandAfterNodeReused(t, true)
}

// Control: the disk stays; NodeExpand grows the volume's own disk.
func TestAdv7ExpandGrowsItsOwnDiskControl(t *testing.T) {
	adv7ExpandAfterNodeReused(t, false)
}
