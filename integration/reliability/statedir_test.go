package reliability

import (
	"context"
	"encoding/base64"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

func claimFile(state, volume string) string {
	return filepath.Join(state, "volumes", base64.RawURLEncoding.EncodeToString([]byte(volume))+".json")
}

// TestStateDirSymlinks plants symlinks in the agent's claims directory
// pointing outside it: as a claim record (to an existing file and to a
// missing one), as the temporary file a record is written through, and as
// the claims directory itself. The agent must refuse or step around each,
// never read a foreign file as a claim and never write through a link.
func TestStateDirSymlinks(t *testing.T) {
	h := newHost(t)
	outside := filepath.Join(h.dir, "outside")
	os.MkdirAll(outside, 0o755)
	precious := filepath.Join(outside, "precious.json")
	const content = `{"volume":"v-link","phase":"staged","staging_path":"/"}`
	os.WriteFile(precious, []byte(content), 0o644)
	os.MkdirAll(filepath.Join(h.state, "volumes"), 0o700)
	// A record that is a symlink to an existing file, and one to a file
	// that does not exist yet.
	os.Symlink(precious, claimFile(h.state, "v-link"))
	os.Symlink(filepath.Join(outside, "created.json"), claimFile(h.state, "v-dangling"))
	// The temporary file of a fresh volume's record.
	os.Symlink(filepath.Join(outside, "tmp-target"), claimFile(h.state, "v-tmp")+".tmp")
	h.start()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	stage := func(vol string) error {
		return h.stage(ctx, &api.StageVolumeRequest{VolumeId: vol, Device: &api.DeviceLocator{LoopBackingFile: h.img},
			StagingPath: kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", vol), FsType: "ext4", AllowUnfenced: true})
	}
	for _, vol := range []string{"v-link", "v-dangling"} {
		before := h.snap()
		err := stage(vol)
		if err == nil || !strings.Contains(status.Convert(err).Message(), "symlink") {
			t.Errorf("stage %s over a symlinked record: %v, want a refusal naming the symlink", vol, err)
		}
		if d := before.diff(h.snap()); d != "" {
			t.Errorf("stage %s: changed the host: %s", vol, d)
		}
		// An unstage may answer as it likes, but must not touch the link.
		before = h.snap()
		h.c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: vol, StagingPath: kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", vol)})
		if d := before.diff(h.snap()); d != "" {
			t.Errorf("unstage %s: changed the host: %s", vol, d)
		}
	}
	// The stray temporary link is removed, not written through; the stage
	// goes ahead with a real file.
	if err := stage("v-tmp"); err != nil {
		t.Fatalf("stage with a stray temporary symlink: %v", err)
	}
	if st, err := os.Lstat(claimFile(h.state, "v-tmp")); err != nil || !st.Mode().IsRegular() {
		t.Errorf("claim record of v-tmp: %v %v, want a regular file", st, err)
	}
	if err := h.unstage(ctx, "v-tmp", kubeletpath.Staging(h.kubelet, "cloud.whitesky.csi", "v-tmp")); err != nil {
		t.Fatalf("unstage v-tmp: %v", err)
	}
	// A restart reads the claims directory again: the links are reported,
	// not followed.
	h.stop()
	h.start()
	h.stop()
	if b, _ := os.ReadFile(precious); string(b) != content {
		t.Errorf("the file behind the symlink changed: %q", b)
	}
	for _, p := range []string{"created.json", "tmp-target"} {
		if _, err := os.Lstat(filepath.Join(outside, p)); err == nil {
			t.Errorf("the agent wrote through a symlink: %s exists", p)
		}
	}
	if st, err := os.Lstat(claimFile(h.state, "v-link")); err != nil || st.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the planted link was replaced: %v %v", st, err)
	}

	// The claims directory itself a symlink: the agent does not start.
	vols := filepath.Join(h.state, "volumes")
	os.RemoveAll(vols)
	os.MkdirAll(filepath.Join(outside, "vols"), 0o700)
	os.Symlink(filepath.Join(outside, "vols"), vols)
	cmd := exec.Command(agentBin, "serve", "--config", h.cfg, "--socket", h.sock+"2", "--sysfs-root", h.sysfs, "--dbus=false")
	out, err := runFor(cmd, 20*time.Second)
	if err == nil || !strings.Contains(out, "symlink") {
		t.Errorf("agent over a symlinked claims directory: %v\n%s", err, out)
	}
	if ents, _ := os.ReadDir(filepath.Join(outside, "vols")); len(ents) != 0 {
		t.Errorf("the agent wrote into the symlinked claims directory: %v", ents)
	}
	figures.add("state directory symlinks planted (none followed)", 4)
}

// runFor runs cmd and kills it if it is still running after d.
func runFor(cmd *exec.Cmd, d time.Duration) (string, error) {
	var b strings.Builder
	cmd.Stdout, cmd.Stderr = &b, &b
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return b.String(), err
	case <-time.After(d):
		cmd.Process.Kill()
		<-done
		return b.String(), nil
	}
}
