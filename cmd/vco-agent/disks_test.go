package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// TestVolumeAPIAndDisksCommand drives the built agent over its socket: a
// blank loop device (no reservations) is staged fenced by the on-disk
// lease, listed by `vco-agent disks`, counted on the metrics endpoint, and
// unstaged; a loop device with a foreign filesystem is staged only with
// the explicit opt-in in both the configuration and the request.
func TestVolumeAPIAndDisksCommand(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and mounts")
	dir := t.TempDir()
	kubelet := filepath.Join(dir, "kubelet")
	os.MkdirAll(kubelet, 0o755)
	t.Cleanup(func() {
		unix.Unmount(kubeletpath.Staging(kubelet, "cloud.whitesky.csi", "vol-cli"), unix.MNT_DETACH)
	})
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(img, 64<<20)
	dev := losetup(t, img)

	// The identity comes from a fixture; disks from the real sysfs.
	root := sysfs(t)
	for _, d := range []string{"block", "dev"} {
		if err := os.Symlink("/sys/"+d, filepath.Join(root, d)); err != nil {
			t.Fatal(err)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := l.Addr().String()
	l.Close()
	// The disk watcher is off: with loop devices admitted it would check
	// (and refuse) the loop devices of other tests running beside this
	// one; the lab's scenarios test it on real hot-plugged disks.
	cfg := filepath.Join(dir, "config.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf("state_dir: %s\nvolumes:\n  kubelet_root: %s\n  allow_unfenced: true\n  allow_loop_devices: true\n  lease_loop_devices: true\n  check_interval: 200ms\n  watch_disks: false\n  claimed_dir: %s\n  lease: {io_timeout: 500ms, renew: 1s, fail: 4s, watchdog: 0s, watchdog_device: none-unsafe}\nmetrics:\n  listen: %s\n",
		filepath.Join(dir, "state"), kubelet, filepath.Join(dir, "claimed"), metricsAddr)), 0o644)
	sock := filepath.Join(dir, "agent.sock")
	c := serveAgent(t, cfg, sock, root)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e := &disksEnv{t: t, ctx: ctx, c: c, sock: sock, dir: dir, kubelet: kubelet, staging: kubeletpath.Staging(kubelet, "cloud.whitesky.csi", "vol-cli"), img: img, dev: dev}

	res, mark := e.stageBlankUnderTheLease()
	e.disksListTheLeasedClaim()
	e.tokenAndStatsOfTheStagedVolume(res.Device)
	checkClaimMetricsAndUnsafeWatchdog(t, metricsAddr, sock)

	// The claim check runs every 200 ms here; a call that meets it is
	// answered ABORTED and asked again.
	if err := client.AskAgain(ctx, func(ctx context.Context) error {
		_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-cli", StagingPath: e.staging})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(mark); err == nil {
		t.Fatal("the udev claim mark stayed after unstage")
	}
	out2, _, _ := run(t, "disks", "--socket", sock)
	if strings.Contains(out2, "vol-cli") {
		t.Fatalf("volume still listed after unstage:\n%s", out2)
	}

	e.foreignDiskStagedOnlyWithBothOptIns()
}

// losetup attaches a loop device to img, detached when the test ends.
func losetup(t *testing.T, img string) string {
	t.Helper()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// disksEnv is TestVolumeAPIAndDisksCommand's agent, its client and the
// blank loop device img (dev) it stages as vol-cli at staging.
type disksEnv struct {
	t                                     *testing.T
	ctx                                   context.Context
	c                                     *client.Client
	sock, dir, kubelet, staging, img, dev string
}

// stageBlankUnderTheLease: a stage outside the kubelet root is an invalid
// argument; the token command reads the blank device without touching
// it; the stage formats it fenced by the disk lease, on a mapping of its
// own, leaves a lease area at the start of the disk and the claim mark
// the udev rules look for. It returns the answer and the mark's path.
func (e *disksEnv) stageBlankUnderTheLease() (*api.StageVolumeResponse, string) {
	t := e.t
	t.Helper()
	req := &api.StageVolumeRequest{VolumeId: "vol-cli", Device: &api.DeviceLocator{LoopBackingFile: e.img}, StagingPath: e.staging, FsType: "ext4"}
	// A path outside the kubelet root is an invalid argument.
	bad := &api.StageVolumeRequest{VolumeId: "vol-cli", Device: req.Device, StagingPath: e.kubelet + "/../x"}
	if _, err := e.c.StageVolume(e.ctx, bad); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("stage outside the kubelet root: %v", err)
	}
	// The token command reads the device without touching it.
	tokOut, errs, code := run(t, "volume", "token", "vol-cli", "--loop-backing-file", e.img, "--socket", e.sock, "--json")
	if code != 0 || !strings.Contains(tokOut, `"content":"VOLUME_CONTENT_BLANK"`) {
		t.Fatalf("volume token of a blank disk: exit %d %s %s", code, tokOut, errs)
	}
	res, err := e.c.StageVolume(e.ctx, req)
	if err != nil || !strings.HasPrefix(res.Device, "/dev/loop") || res.Device == e.dev || !res.Formatted || res.Fencing != api.FencingMethod_FENCING_METHOD_DISK_LEASE {
		t.Fatalf("stage: %v %v", res, err)
	}
	if b, _ := os.ReadFile(e.img); !bytes.HasPrefix(b, []byte("VCOLEASE")) {
		t.Fatal("no lease area at the start of the disk")
	}
	// The claim mark the udev rules look for.
	mark := filepath.Join(e.dir, "claimed", filepath.Base(e.dev))
	if _, err := os.Stat(mark); err != nil {
		t.Fatalf("no udev claim mark for the staged disk: %v", err)
	}
	return res, mark
}

// disksListTheLeasedClaim: vco-agent disks, as a table and as JSON, lists
// vol-cli on its device, held under the disk lease, at its staging path.
func (e *disksEnv) disksListTheLeasedClaim() {
	t := e.t
	t.Helper()
	out2, errs, code := run(t, "disks", "--socket", e.sock)
	if code != 0 {
		t.Fatalf("disks: exit %d %s", code, errs)
	}
	var line string
	for _, l := range strings.Split(out2, "\n") {
		if strings.Contains(l, "vol-cli") {
			line = l
		}
	}
	if !strings.HasPrefix(out2, "DEVICE") || !strings.Contains(line, e.dev) || !strings.Contains(line, " disk-lease ") || !strings.Contains(line, " held ") {
		t.Fatalf("disks output:\n%s", out2)
	}
	out2, _, code = run(t, "disks", "--json", "--socket", e.sock)
	var j struct {
		Disks []struct {
			Device      string `json:"device"`
			VolumeID    string `json:"volume_id"`
			State       string `json:"state"`
			Fencing     string `json:"fencing"`
			StagingPath string `json:"staging_path"`
		} `json:"disks"`
	}
	if err := json.Unmarshal([]byte(out2), &j); err != nil || code != 0 {
		t.Fatalf("disks --json: %v %q", err, out2)
	}
	found := false
	for _, d := range j.Disks {
		if d.VolumeID == "vol-cli" {
			found = d.Device == e.dev && d.State == "CLAIM_STATE_HELD" && d.Fencing == "FENCING_METHOD_DISK_LEASE" && d.StagingPath == e.staging
		}
	}
	if !found {
		t.Fatalf("disks --json lacks the leased claim: %s", out2)
	}
}

// tokenAndStatsOfTheStagedVolume: the token command finds an ext4
// filesystem on the staged volume's device; volume stats wants a volume;
// the volume's stats are normal.
func (e *disksEnv) tokenAndStatsOfTheStagedVolume(device string) {
	t := e.t
	t.Helper()
	tokOut, _, code := run(t, "volume", "token", "vol-cli", "--socket", e.sock)
	if code != 0 || !strings.Contains(tokOut, "vol-cli on "+device+": other (") || !strings.Contains(tokOut, "ext") {
		t.Fatalf("volume token of the staged ext4 volume: exit %d %s", code, tokOut)
	}
	if _, errs, code := run(t, "volume", "stats", "--socket", e.sock); code != 2 || !strings.Contains(errs, "volume id comes first") {
		t.Fatalf("volume stats without a volume: exit %d %s", code, errs)
	}
	st, err := e.c.GetVolumeStats(e.ctx, &api.GetVolumeStatsRequest{VolumeId: "vol-cli"})
	if err != nil || st.TotalBytes <= 0 || st.Abnormal {
		t.Fatalf("stats: %v %v", st, err)
	}
}

// checkClaimMetricsAndUnsafeWatchdog: the periodic check runs every 200ms;
// its counter shows on /metrics. The lease is held without a host
// watchdog, by the configuration's explicit unsafe setting: the metrics
// and the status say so.
func checkClaimMetricsAndUnsafeWatchdog(t *testing.T, metricsAddr, sock string) {
	t.Helper()
	held := func(body string) bool {
		return strings.Contains(body, `vco_agent_claims{state="held"} 1`) && strings.Contains(body, `vco_agent_claim_checks_total{result="ok"}`)
	}
	var body string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := http.Get("http://" + metricsAddr + "/metrics")
		if err != nil {
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body = string(b)
		if held(body) {
			break
		}
	}
	if !held(body) {
		t.Fatalf("metrics lack the claim and its checks:\n%s", body)
	}
	if !strings.Contains(body, "vco_agent_host_watchdog_unsafe 1") || !strings.Contains(body, "vco_agent_host_watchdog_leases 1") ||
		!strings.Contains(body, "vco_agent_host_watchdog_armed 0") {
		t.Fatalf("metrics do not show the lease held without a watchdog:\n%s", body)
	}
	if out, errs, code := run(t, "status", "--socket", sock); code != 0 || !strings.Contains(out, "Host watchdog:") || !strings.Contains(out, "UNSAFE") || !strings.Contains(out, "1 leases held without one") {
		t.Fatalf("status with a lease held without a watchdog: exit %d\n%s%s", code, out, errs)
	}
}

// foreignDiskStagedOnlyWithBothOptIns: a foreign filesystem and no
// reservations: no fencing at all, staged only with both opt-ins (the
// configuration's and the request's), never formatted, listed unfenced.
func (e *disksEnv) foreignDiskStagedOnlyWithBothOptIns() {
	t := e.t
	t.Helper()
	img2 := filepath.Join(e.dir, "foreign.img")
	os.WriteFile(img2, nil, 0o600)
	os.Truncate(img2, 64<<20)
	if out, err := exec.Command("mkfs.ext4", "-q", img2).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	dev2 := losetup(t, img2)
	req2 := &api.StageVolumeRequest{VolumeId: "vol-foreign", Device: &api.DeviceLocator{LoopBackingFile: img2}, StagingPath: e.staging, FsType: "ext4"}
	err := client.AskAgain(e.ctx, func(ctx context.Context) error { _, err := e.c.StageVolume(ctx, req2); return err })
	if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "offers no fencing") || !strings.Contains(st.Message(), "never formatted") {
		t.Fatalf("stage of a foreign disk without opt-in: %v", err)
	}
	req2.AllowUnfenced = true
	var res2 *api.StageVolumeResponse
	err = client.AskAgain(e.ctx, func(ctx context.Context) (err error) { res2, err = e.c.StageVolume(ctx, req2); return err })
	if res := res2; err != nil || res.Device != dev2 || res.Formatted || res.Fencing != api.FencingMethod_FENCING_METHOD_NONE {
		t.Fatalf("stage of a foreign disk with opt-in: %v %v", res, err)
	}
	out2, _, _ := run(t, "disks", "--socket", e.sock)
	if !strings.Contains(out2, " none ") || !strings.Contains(out2, " unfenced ") {
		t.Fatalf("disks output:\n%s", out2)
	}
	if err := client.AskAgain(e.ctx, func(ctx context.Context) error {
		_, err := e.c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-foreign", StagingPath: e.staging})
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// A lease is never taken on a host whose watchdog cannot be armed, unless
// the configuration says none-unsafe: the stage is refused naming the
// device and the setting, and the status shows the watchdog unarmed.
// The device named is absent from the fixture's sysfs, so nothing on this
// machine is armed (it would reset the host the tests run on).
func TestLeaseRefusedWithoutAHostWatchdog(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	dir := t.TempDir()
	kubelet := filepath.Join(dir, "kubelet")
	os.MkdirAll(kubelet, 0o755)
	img := filepath.Join(dir, "disk.img")
	os.WriteFile(img, nil, 0o600)
	os.Truncate(img, 64<<20)
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	root := sysfs(t)
	for _, d := range []string{"block", "dev"} {
		if err := os.Symlink("/sys/"+d, filepath.Join(root, d)); err != nil {
			t.Fatal(err)
		}
	}
	cfg := filepath.Join(dir, "config.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf("state_dir: %s\nvolumes:\n  kubelet_root: %s\n  allow_loop_devices: true\n  lease_loop_devices: true\n  watch_disks: false\n  claimed_dir: %s\n  lease: {io_timeout: 500ms, renew: 1s, fail: 4s, watchdog: 4s, watchdog_device: /dev/watchdog7}\n",
		filepath.Join(dir, "state"), kubelet, filepath.Join(dir, "claimed"))), 0o644)
	sock := filepath.Join(dir, "agent.sock")
	c := serveAgent(t, cfg, sock, root)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req := &api.StageVolumeRequest{VolumeId: "vol-wd", Device: &api.DeviceLocator{LoopBackingFile: img}, StagingPath: kubeletpath.Staging(kubelet, "cloud.whitesky.csi", "vol-wd"), FsType: "ext4"}
	_, err = c.StageVolume(ctx, req)
	if err == nil {
		// Leave nothing mounted behind the failure.
		c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-wd", StagingPath: req.StagingPath})
	}
	if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "/dev/watchdog7") ||
		!strings.Contains(st.Message(), "none-unsafe") || !strings.Contains(st.Message(), "vol-wd") {
		t.Fatalf("stage of a lease disk without a watchdog: %v", err)
	}
	if b, _ := os.ReadFile(img); bytes.HasPrefix(b, []byte("VCOLEASE")) {
		t.Fatal("the lease area was written although the stage was refused")
	}
	out2, errs, code := run(t, "status", "--socket", sock)
	if code != 0 || !strings.Contains(out2, "Host watchdog:") || !strings.Contains(out2, "not armed") || !strings.Contains(out2, "/dev/watchdog7") {
		t.Fatalf("status: exit %d\n%s%s", code, out2, errs)
	}
}

// serveAgent starts 'vco-agent serve' with cfg on sock and dials it. The
// agent is stopped, and its log printed if the test failed, when the test
// ends.
func serveAgent(t *testing.T, cfg, sock, root string) *client.Client {
	t.Helper()
	agent := vcoAgent("serve", "--config", cfg, "--socket", sock, "--sysfs-root", root, "--dbus=false")
	var agentErr bytes.Buffer
	agent.Stderr = &agentErr
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		agent.Process.Signal(unix.SIGTERM)
		agent.Wait()
		if t.Failed() {
			t.Logf("agent log:\n%s", agentErr.String())
		}
	})
	for deadline := time.Now().Add(20 * time.Second); ; {
		c, err := client.Dial(sock)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not up: %v\n%s", err, agentErr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
