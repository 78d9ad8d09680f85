package server

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/mounttest"
)

// recordingCrypt is a FAKE volume.Encryption (this host has no
// device-mapper): every device holds a LUKS2 header, Open "maps" the
// device as itself, or fails when fail is set, and each passphrase it is
// given is copied, so the test can tell it was used before it was zeroed.
type recordingCrypt struct {
	seen [][]byte
	fail bool
}

func (c *recordingCrypt) Inspect(context.Context, string) (volume.Content, error) {
	return volume.Content{Kind: volume.ContentLUKS2, UUID: "fake"}, nil
}

func (c *recordingCrypt) Format(context.Context, blank.Proof, []byte, luks2.TransitToken) error {
	return errors.New("the fake formats nothing")
}

func (c *recordingCrypt) Open(_ context.Context, device, _ string, pass []byte, _ bool) (volume.Mapped, error) {
	c.seen = append(c.seen, bytes.Clone(pass))
	if c.fail {
		return volume.Mapped{}, errors.New("the fake refuses this passphrase")
	}
	return volume.Mapped{Path: device, Reader: "fake"}, nil
}

func (c *recordingCrypt) Close(context.Context, string) error  { return nil }
func (c *recordingCrypt) Resize(context.Context, string) error { return nil }

func zeroed(b []byte) bool { return len(b) > 0 && bytes.Count(b, []byte{0}) == len(b) }

// The passphrase in a stage request is the agent's to zero once the stage
// is over, whether it succeeded, failed in the manager after the
// passphrase was used, or was refused before it was looked at.
func TestStageVolumeZeroesThePassphrase(t *testing.T) {
	const secret = "correct horse battery staple"
	req := func(loc *api.DeviceLocator, staging string) *api.StageVolumeRequest {
		return &api.StageVolumeRequest{VolumeId: "vol-enc", Device: loc, StagingPath: staging, Block: true, AllowUnfenced: true,
			Encryption: &api.Encryption{Passphrase: []byte(secret)}}
	}
	ctx := context.Background()

	// No volume manager, and a request refused before the manager.
	r := req(&api.DeviceLocator{Serial: "x"}, "/var/lib/kubelet/s")
	if _, err := New(Options{}).StageVolume(ctx, r); agenterr.Code(err) != codes.Unavailable {
		t.Fatalf("stage without a manager: %v", err)
	}
	if !zeroed(r.GetEncryption().GetPassphrase()) {
		t.Fatal("the passphrase of a stage refused for want of a manager was not zeroed")
	}

	hosttest.NeedRoot(t, "the rest stages a loop device, which needs root")
	dir := t.TempDir()
	t.Cleanup(func() { mounttest.UnmountUnder(dir) })
	kubelet := filepath.Join(dir, "kubelet")
	if err := os.MkdirAll(kubelet, 0o755); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil || os.Truncate(img, 16<<20) != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	crypt := &recordingCrypt{}
	key, _ := fence.KeyFromUUID("4c4c4544-0042-3610-8052-b4c04f4e3332")
	m, err := volume.New(volume.Options{
		Config:   config.Volumes{KubeletRoot: kubelet, DevRoot: "/dev", CheckInterval: time.Second, AllowUnfenced: true, AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "state"), SysfsRoot: "/sys", Crypt: crypt,
		Fencers: &volume.Fencing{Key: key, Node: "4c4c4544-0042-3610-8052-b4c04f4e3332"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	s := New(Options{Volumes: m})
	staging := kubeletpath.BlockStaging(kubelet, "enc")

	r = req(&api.DeviceLocator{Serial: "a,b"}, staging)
	if _, err := s.StageVolume(ctx, r); agenterr.Code(err) != codes.InvalidArgument {
		t.Fatalf("stage with a bad locator: %v", err)
	}
	if !zeroed(r.GetEncryption().GetPassphrase()) {
		t.Fatal("the passphrase of a stage refused for its locator was not zeroed")
	}

	crypt.fail = true
	r = req(&api.DeviceLocator{LoopBackingFile: img}, staging)
	if _, err := s.StageVolume(ctx, r); agenterr.Code(err) != codes.FailedPrecondition {
		t.Fatalf("stage whose LUKS2 open fails: %v", err)
	}
	if len(crypt.seen) != 1 || string(crypt.seen[0]) != secret {
		t.Fatalf("the open was given %q, not the passphrase", crypt.seen)
	}
	if !zeroed(r.GetEncryption().GetPassphrase()) {
		t.Fatal("the passphrase of a stage that failed after using it was not zeroed")
	}

	crypt.fail = false
	r = req(&api.DeviceLocator{LoopBackingFile: img}, staging)
	if _, err := s.StageVolume(ctx, r); err != nil {
		t.Fatalf("stage: %v", err)
	}
	if len(crypt.seen) != 2 || string(crypt.seen[1]) != secret {
		t.Fatalf("the open was given %q, not the passphrase", crypt.seen)
	}
	if !zeroed(r.GetEncryption().GetPassphrase()) {
		t.Fatal("the passphrase of a successful stage was not zeroed")
	}
	if _, err := s.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: "vol-enc", StagingPath: staging}); err != nil {
		t.Fatal(err)
	}
	updateTokenZeroesThePassphrase(ctx, t, s, secret)
}

// updateTokenZeroesThePassphrase: a token update's passphrase is zeroed
// too, refused or not.
func updateTokenZeroesThePassphrase(ctx context.Context, t *testing.T, s *Server, secret string) {
	t.Helper()
	u := &api.UpdateVolumeTokenRequest{VolumeId: "vol-enc", Passphrase: []byte(secret)}
	if _, err := s.UpdateVolumeToken(ctx, u); agenterr.Code(err) != codes.InvalidArgument || !zeroed(u.GetPassphrase()) {
		t.Fatalf("token update without tokens: %v, passphrase zeroed %v", err, zeroed(u.GetPassphrase()))
	}
	tok := &api.TransitToken{KeyName: "k", KeyVersion: 1, Ciphertext: "vault:v1:eA"}
	u = &api.UpdateVolumeTokenRequest{VolumeId: "vol-enc", Passphrase: []byte(secret), Replaces: tok, Token: tok}
	if _, err := s.UpdateVolumeToken(ctx, u); agenterr.Code(err) != codes.FailedPrecondition || !zeroed(u.GetPassphrase()) {
		t.Fatalf("token update by an agent whose encryption cannot write tokens: %v, passphrase zeroed %v", err, zeroed(u.GetPassphrase()))
	}
}
