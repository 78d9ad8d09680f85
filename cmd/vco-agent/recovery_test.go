package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// The commands of docs/recovery.md that a rescue machine runs on a
// lease-fenced volume, word for word (the test checks the page still
// says them).
var runbook = []string{
	"vco-agent lease show $DEV",
	"vco-agent lease acquire $DEV --uuid $RESCUE_UUID",
	"LOOP=$(losetup --find --show --read-only --offset 1048576 $DEV)",
	"mount -o ro $LOOP /mnt",
	"umount /mnt",
	"losetup -d $LOOP",
}

// TestRecoveryRunbook follows docs/recovery.md on a loop device: node A's
// agent stages a lease-fenced volume and writes a file, then dies holding
// the lease (SIGKILL; its mount and data mapping are taken away as a
// detach from a dead VM would). A rescue machine with another identity
// runs the runbook's commands: it shows the lease, takes it over once A's
// expiry bound has passed, maps the data at the lease data offset, mounts
// it read-only, reads the file, and hands the disk back (unmount, unmap,
// release). Then node B's agent stages the volume normally and finds the
// file. Loop devices stand in for the rescue VM's disk; the lab's guests
// are not needed for what the commands do.
func TestRecoveryRunbook(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	doc, err := os.ReadFile("../../docs/recovery.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range runbook {
		if !strings.Contains(string(doc), c) {
			t.Errorf("docs/recovery.md no longer says %q", c)
		}
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(img, 64<<20)
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })

	// Node A stages the volume and writes a file.
	nodeA := recoveryNode(t, dir, "a", cliUUIDA)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req := func(staging string) *api.StageVolumeRequest {
		return &api.StageVolumeRequest{VolumeId: "vol-rescue", Device: &api.DeviceLocator{LoopBackingFile: img}, StagingPath: staging, FsType: "ext4"}
	}
	c := nodeA.start(t)
	res, err := c.StageVolume(ctx, req(nodeA.staging))
	if err != nil || res.Fencing != api.FencingMethod_FENCING_METHOD_DISK_LEASE {
		t.Fatalf("node A's stage: %v %v", res, err)
	}
	if err := os.WriteFile(filepath.Join(nodeA.staging, "data.txt"), []byte("written by node A\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	// A dies holding the lease; its VM is stopped, so the disk leaves it.
	nodeA.kill(t)
	if err := unix.Unmount(nodeA.staging, 0); err != nil {
		t.Fatal(err)
	}
	exec.Command("losetup", "-d", res.Device).Run()

	// The rescue machine, in a mount namespace of its own for /mnt.
	bin := filepath.Join(dir, "bin")
	os.MkdirAll(bin, 0o755)
	os.WriteFile(filepath.Join(bin, "vco-agent"), []byte("#!/bin/sh\nVCO_AGENT_MAIN=1 exec "+os.Args[0]+" -test.run='^$' -- \"$@\"\n"), 0o755)
	// The rescue VM's SMBIOS identity: this host has none, so the
	// namespace gets a /sys/class with the DMI attributes (and the real
	// block class).
	script := fmt.Sprintf(`set -eu
mkdir -p %[7]s/blk && mount --bind /sys/class/block %[7]s/blk
mount -t tmpfs tmpfs /sys/class
mkdir -p /sys/class/block /sys/class/dmi/id
mount --bind %[7]s/blk /sys/class/block
echo $RESCUE_UUID >/sys/class/dmi/id/product_uuid
%[1]s | grep ' held epoch'
%[2]s &
ACQ=$!
i=0; until vco-agent lease check $DEV --uuid $RESCUE_UUID >/dev/null 2>&1; do
	i=$((i+1)); [ $i -lt 600 ] || { echo "the rescue did not take the lease"; exit 1; }; sleep 0.2; done
%[3]s
%[4]s
cat /mnt/data.txt
%[5]s
%[6]s
kill -INT $ACQ; wait $ACQ
%[1]s`, runbook[0], runbook[1], runbook[2], runbook[3], runbook[4], runbook[5], dir)
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "DEV="+dev, "RESCUE_UUID="+cliUUIDB)
	start := time.Now()
	b, err := cmd.CombinedOutput()
	t.Logf("the runbook took %s", time.Since(start).Round(time.Second))
	if err != nil {
		t.Fatalf("the runbook failed: %v\n%s", err, b)
	}
	text := string(b)
	if !strings.Contains(text, "written by node A") {
		t.Fatalf("the rescue did not read node A's file:\n%s", text)
	}
	last := text[strings.LastIndex(text, "owner:"):]
	if strings.Contains(last, " held epoch") || !strings.Contains(last, " released epoch") {
		t.Fatalf("the rescue did not hand the disk back released:\n%s", last)
	}

	// Node B stages the volume as usual and finds the data.
	nodeB := recoveryNode(t, dir, "b", "7d3c2b1a-5e4f-4a6b-8c7d-9e0f1a2b3c4d")
	cb := nodeB.start(t)
	res, err = cb.StageVolume(ctx, req(nodeB.staging))
	if err != nil || res.Formatted {
		t.Fatalf("node B's stage after the rescue: %v %v", res, err)
	}
	got, err := os.ReadFile(filepath.Join(nodeB.staging, "data.txt"))
	if err != nil || string(got) != "written by node A\n" {
		t.Fatalf("node B reads %q, %v", got, err)
	}
	if _, err := cb.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-rescue", StagingPath: nodeB.staging}); err != nil {
		t.Fatal(err)
	}
}

type recoveryAgent struct {
	cfg, sock, root, staging string
	cmd                      *exec.Cmd
}

// recoveryNode is an agent's configuration, socket, identity and kubelet
// directory under dir/name, with the fast lease timing of the CLI tests.
func recoveryNode(t *testing.T, dir, name, uuid string) *recoveryAgent {
	t.Helper()
	d := filepath.Join(dir, name)
	kubelet := filepath.Join(d, "kubelet")
	os.MkdirAll(kubelet, 0o755)
	root := filepath.Join(d, "sys")
	id := filepath.Join(root, "class/dmi/id")
	os.MkdirAll(id, 0o755)
	os.WriteFile(filepath.Join(id, "product_uuid"), []byte(uuid+"\n"), 0o400)
	os.WriteFile(filepath.Join(id, "sys_vendor"), []byte("whitesky.cloud\n"), 0o444)
	os.MkdirAll(filepath.Join(root, "class/block"), 0o755)
	for _, l := range []string{"block", "dev"} {
		os.Symlink("/sys/"+l, filepath.Join(root, l))
	}
	cfg := filepath.Join(d, "config.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf("node:\n  name: node-%s\nstate_dir: %s\nvolumes:\n  kubelet_root: %s\n  allow_loop_devices: true\n  lease_loop_devices: true\n  watch_disks: false\n  claimed_dir: %s\n  lease: {io_timeout: 500ms, renew: 1s, fail: 4s, watchdog: 0s, watchdog_device: none-unsafe}\nmetrics:\n  socket: off\n",
		name, filepath.Join(d, "state"), kubelet, filepath.Join(d, "claimed"))), 0o644)
	staging := kubeletpath.Staging(kubelet, "cloud.whitesky.csi", "vol-rescue")
	t.Cleanup(func() { unix.Unmount(staging, unix.MNT_DETACH) })
	return &recoveryAgent{cfg: cfg, sock: filepath.Join(d, "agent.sock"), root: root, staging: staging}
}

// start runs the agent until the test ends (or kill) and dials it.
func (a *recoveryAgent) start(t *testing.T) *client.Client {
	t.Helper()
	a.cmd = vcoAgent("serve", "--config", a.cfg, "--socket", a.sock, "--sysfs-root", a.root, "--dbus=false")
	var logb bytes.Buffer
	a.cmd.Stderr = &logb
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd := a.cmd
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Signal(unix.SIGTERM)
			cmd.Wait()
		}
		if t.Failed() {
			t.Logf("agent %s log:\n%s", a.sock, logb.String())
		}
	})
	for deadline := time.Now().Add(20 * time.Second); ; {
		c, err := client.Dial(a.sock)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not up: %v\n%s", err, logb.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill ends the agent this test started with SIGKILL, as a node dies.
func (a *recoveryAgent) kill(t *testing.T) {
	t.Helper()
	if err := a.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	a.cmd.Wait()
}
