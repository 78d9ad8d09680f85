package agentnodetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

// Node is a node plugin in node mode and the real agent on this host,
// staging loop devices of the simulator's host backend (DiskDir) under
// Kubelet, unfenced by both opt-ins (loop devices offer no fencing), with
// the agent's LUKS2 over a FAKE dm-crypt mapping (LoopLUKS: this host has
// no device-mapper) and the transit engine w with key.
type Node struct {
	Driver           *driver.Driver
	Agent            *agentnode.Agent
	Kubelet, DiskDir string
}

// NewNode starts a Node whose SMBIOS UUID is node, in location ch-gen-1;
// it needs root (loop devices and mounts) and stops when t ends, taking
// down what it left mounted.
func NewNode(t testing.TB, node string, w crypt.Wrapper, key crypt.TransitKey) *Node {
	t.Helper()
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	dir := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	n := &Node{Kubelet: filepath.Join(dir, "kubelet"), DiskDir: filepath.Join(dir, "disks")}
	for _, p := range []string{n.Kubelet, n.DiskDir} {
		if err := os.MkdirAll(p, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	fk, err := fence.KeyFromUUID(node)
	if err != nil {
		t.Fatal(err)
	}
	m, err := volume.New(volume.Options{
		Config:   config.Volumes{KubeletRoot: n.Kubelet, DevRoot: "/dev", CheckInterval: time.Hour, AllowUnfenced: true, AllowLoopDevices: true},
		Crypt:    NewLoopLUKS(t),
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Fencers: &volume.Fencing{Key: fk, Node: node},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	n.Agent = ServeAgent(t, filepath.Join(dir, "agent.sock"), m,
		server.NodeIdentity{SystemUUID: node, Location: "ch-gen-1"}, nil,
		agentnode.Options{AllowUnfenced: true, LoopDiskDir: n.DiskDir})
	n.Driver, err = driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, Agent: n.Agent, KubeletRoot: n.Kubelet,
		Transit: w, TransitKey: key})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// LoopDisk makes the simulator host backend's file of disk id in dir
// (64 MiB) and a loop device on it, detached when t ends.
func LoopDisk(t testing.TB, dir string, id int64) (img, dev string) {
	t.Helper()
	img = (&sim.HostBackend{Dir: dir}).DiskFile(id)
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev = strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return img, dev
}
