package daemon

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// A disk that another node holds by the lease is attached before the
// agent starts (at boot, or while the agent was down): the agent refuses
// it before it tells systemd it is ready. Two loop devices over one image
// stand in for one virtio-blk disk attached to two VMs; node A holds the
// lease from this process.
func TestDiskHeldElsewhereIsRefusedBeforeReady(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and BLKROSET")
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	losetup := func() string {
		out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
		if err != nil {
			t.Fatalf("losetup: %v: %s", err, out)
		}
		dev := strings.TrimSpace(string(out))
		t.Cleanup(func() {
			uevent.SetReadOnly(dev, 0, 0, false)
			exec.Command("losetup", "-d", dev).Run()
		})
		return dev
	}
	devA := losetup()
	d, err := lease.OpenDevice(devA)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	keyA, _ := fence.KeyFromUUID("3f9a7b21-64c5-4d08-a1e2-7b8c9d0e1f2a")
	ctx := context.Background()
	if _, err := lease.Format(ctx, d, lease.FormatOptions{Key: keyA}); err != nil {
		t.Fatal(err)
	}
	e, err := lease.New(d, lease.Config{Key: keyA, Node: "3f9a7b21-64c5-4d08-a1e2-7b8c9d0e1f2a", NodeName: "node-a",
		Timing: lease.Timing{IOTimeout: 100 * time.Millisecond, Renew: 200 * time.Millisecond, Fail: 800 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Release(context.Background()) })

	// This node's disk: attached, writable, before the agent starts.
	devB := losetup()
	if ro, err := uevent.ReadOnly(devB); err != nil || ro {
		t.Fatalf("precondition: %s read-only %v %v", devB, ro, err)
	}
	sysfs := sysfsFixture(t)
	name := filepath.Base(devB)
	if err := os.Symlink("/sys/devices/virtual/block/"+name, filepath.Join(sysfs, "class/block", name)); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("state_dir: "+filepath.Join(dir, "state")+"\nvolumes:\n  kubelet_root: "+filepath.Join(dir, "kubelet")+
		"\n  allow_loop_devices: true\n  lease_loop_devices: true\n  claimed_dir: \"\"\n  lease: {io_timeout: 100ms, renew: 200ms, fail: 800ms, watchdog: 0s, watchdog_device: none-unsafe}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	n := listenNotify(t)
	a := startAgent(t, "serve", []string{"NOTIFY_SOCKET=" + n.path}, nil,
		"--config", cfg, "--socket", filepath.Join(dir, "run", "agent.sock"), "--sysfs-root", sysfs, "--dbus=false", "--node-name", "node-b")
	n.wait(t, "READY=1")
	ro, err := uevent.ReadOnly(devB)
	if err != nil || !ro {
		t.Fatalf("%s is writable when the agent says it is ready (%v); log:\n%s", devB, err, a.stderr)
	}
	f, err := os.OpenFile(devB, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteAt([]byte("node-b's write"), 2<<20)
		f.Close()
	}
	if err == nil {
		t.Fatal("a raw write to the refused disk succeeded")
	}
	a.stop(t)
	log := a.stderr.String()
	if !strings.Contains(log, "VCO_EVENT=DiskRefused") || !strings.Contains(log, "start-up scan") || !strings.Contains(log, "node-a") {
		t.Fatalf("no DiskRefused naming node-a from the start-up scan:\n%s", log)
	}
}
