package volume

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/agent/events"
)

// fakeLUKS is a FAKE Encryption, labelled as such: this host's kernel has
// no device-mapper, so dm-crypt cannot run here (package crypt is tested
// against real dm-crypt in lab guests). It keeps what the manager relies
// on: a header only on a blank device, a passphrase check, and a mapping
// that is a real block device — a loop device over the data area past a
// 1 MiB header, unencrypted — so that mkfs, mount and resize run for real.
type fakeLUKS struct {
	t      *testing.T
	mu     sync.Mutex
	maps   map[string]string
	opened int
	closed int
	resize int
}

const fakeHeader = 1 << 20

func (f *fakeLUKS) Open(_ context.Context, device, name string, pass []byte, formatIfBlank, _ bool) (string, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sum := sha256.Sum256(pass)
	kind := blkid(f.t, device, "TYPE")
	formatted := false
	switch {
	case kind == "" && formatIfBlank:
		h := make([]byte, 4096)
		copy(h, "LUKS\xba\xbe\x00\x02")
		copy(h[1024:], sum[:])
		fh, err := os.OpenFile(device, os.O_WRONLY, 0)
		if err != nil {
			return "", false, err
		}
		_, err = fh.Write(h)
		fh.Close()
		if err != nil {
			return "", false, err
		}
		formatted = true
	case kind == "":
		return "", false, errors.New("no LUKS2 header on the device")
	case kind != "crypto_LUKS":
		return "", false, fmt.Errorf("the device carries %s, not LUKS2; not formatting over it", kind)
	}
	fh, err := os.Open(device)
	if err != nil {
		return "", false, err
	}
	h := make([]byte, 4096)
	_, err = fh.ReadAt(h, 0)
	fh.Close()
	if err != nil {
		return "", false, err
	}
	if !bytes.Equal(h[1024:1024+32], sum[:]) {
		return "", false, errors.New("no key slot opens with this passphrase")
	}
	out, err := exec.Command("losetup", "--find", "--show", "--offset", fmt.Sprint(fakeHeader), device).CombinedOutput()
	if err != nil {
		return "", false, fmt.Errorf("losetup: %v %s", err, out)
	}
	mapped := strings.TrimSpace(string(out))
	f.t.Cleanup(func() { exec.Command("losetup", "-d", mapped).Run() })
	if f.maps == nil {
		f.maps = map[string]string{}
	}
	f.maps[name] = mapped
	f.opened++
	return mapped, formatted, nil
}

func (f *fakeLUKS) Close(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if m, ok := f.maps[name]; ok {
		if out, err := exec.Command("losetup", "-d", m).CombinedOutput(); err != nil {
			return fmt.Errorf("%v %s", err, out)
		}
		delete(f.maps, name)
		f.closed++
	}
	return nil
}

func (f *fakeLUKS) Resize(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resize++
	return exec.Command("losetup", "-c", f.maps[name]).Run()
}

const secret = "correct horse battery staple"

func TestEncryptedVolumeOpensLUKSBeforeTheFilesystem(t *testing.T) {
	needRoot(t)
	crypt := &fakeLUKS{t: t}
	e := newEnvWith(t, nil)
	e.crypt = crypt
	e.start()
	ctx := context.Background()
	// xfs: it grows online with the capabilities this host grants.
	img, dev := loop(t, 320)
	req := e.stageReq("vol-enc", img, "staging/enc")
	req.FsType = "xfs"
	req.Encrypted, req.Passphrase, req.FormatLUKS = true, []byte(secret), true
	res, err := e.m.Stage(ctx, req)
	if err != nil || !res.Formatted || res.Device == dev {
		t.Fatalf("encrypted stage: %+v %v", res, err)
	}
	if blkid(t, dev, "TYPE") != "crypto_LUKS" || blkid(t, res.Device, "TYPE") != "xfs" || !isMounted(t, req.StagingPath) {
		t.Fatalf("layers: disk %q, mapping %q", blkid(t, dev, "TYPE"), blkid(t, res.Device, "TYPE"))
	}
	os.WriteFile(filepath.Join(req.StagingPath, "data"), []byte("x"), 0o644)
	if res2, err := e.m.Stage(ctx, req); err != nil || res2.Formatted || crypt.opened != 1 {
		t.Fatalf("retried encrypted stage: %+v %v (opened %d)", res2, err, crypt.opened)
	}
	if err := os.Truncate(img, 640<<20); err != nil {
		t.Fatal(err)
	}
	exec.Command("losetup", "-c", dev).Run()
	if n, err := e.m.Expand(ctx, "vol-enc", "", 0); err != nil || n != 640<<20-fakeHeader || crypt.resize != 1 {
		t.Fatalf("expand: %d %v (resized %d)", n, err, crypt.resize)
	}
	if err := e.m.Unstage(ctx, "vol-enc", req.StagingPath); err != nil || crypt.closed != 1 {
		t.Fatalf("unstage: %v (closed %d)", err, crypt.closed)
	}
	// A wrong passphrase opens nothing and mounts nothing.
	bad := req
	bad.Passphrase = []byte("wrong")
	_, err = e.m.Stage(ctx, bad)
	wantCode(t, err, codes.FailedPrecondition, "opening LUKS2", "passphrase")
	if isMounted(t, req.StagingPath) {
		t.Fatal("mounted with a wrong passphrase")
	}
	// The right one: not formatted again, data there.
	if res, err := e.m.Stage(ctx, req); err != nil || res.Formatted {
		t.Fatalf("restage: %+v %v", res, err)
	}
	if _, err := os.Stat(filepath.Join(req.StagingPath, "data")); err != nil {
		t.Fatal(err)
	}
	// The passphrase is nowhere: not in the claim record, the log, or any
	// event.
	b, _ := os.ReadFile(e.m.Store().file("vol-enc"))
	if bytes.Contains(b, []byte(secret)) || bytes.Contains(e.logs.Bytes(), []byte(secret)) {
		t.Fatal("the passphrase was written to the claim record or the log")
	}
	for _, ev := range e.bus.Recent() {
		if strings.Contains(fmt.Sprintf("%+v", ev), secret) {
			t.Fatalf("the passphrase is in an event: %+v", ev)
		}
	}
	if !strings.Contains(string(b), `"encrypted": true`) {
		t.Fatalf("record does not say the volume is encrypted: %s", b)
	}

	// A failure after the mapping was opened closes it again: here the
	// volume comes back asking for ext4 on the xfs inside.
	if err := e.m.Unstage(ctx, "vol-enc", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	closed := crypt.closed
	wrongFS := req
	wrongFS.FsType = "ext4"
	_, err = e.m.Stage(ctx, wrongFS)
	wantCode(t, err, codes.FailedPrecondition, `carries "xfs"`)
	if crypt.closed != closed+1 || len(crypt.maps) != 0 || isMounted(t, req.StagingPath) {
		t.Fatalf("after a failed stage: %d closes (was %d), mappings %v", crypt.closed, closed, crypt.maps)
	}

	// A disk with a filesystem is never given a LUKS2 header.
	img2, dev2 := loop(t, 64)
	exec.Command("mkfs.ext4", "-q", dev2).Run()
	req2 := e.stageReq("vol-enc2", img2, "staging/enc2")
	req2.Encrypted, req2.Passphrase, req2.FormatLUKS = true, []byte(secret), true
	_, err = e.m.Stage(ctx, req2)
	wantCode(t, err, codes.FailedPrecondition, "not formatting")
	if blkid(t, dev2, "TYPE") != "ext4" {
		t.Fatal("a filesystem was overwritten with a LUKS2 header")
	}
	for _, ev := range e.bus.Recent() {
		if ev.Type == events.DiskClaimed && ev.Volume == "vol-enc2" {
			t.Fatal("a failed encrypted stage was announced as claimed")
		}
	}
	if c, _ := e.m.Store().Get("vol-enc2"); c != nil {
		t.Fatalf("a failed first stage left a record: %+v", c)
	}
}

func TestEncryptedVolumeWithoutLUKSSupportIsRefused(t *testing.T) {
	e := newEnv(t)
	img, dev := loop(t, 16)
	req := e.stageReq("vol-e", img, "staging/e")
	req.Encrypted, req.Passphrase = true, []byte(secret)
	_, err := e.m.Stage(context.Background(), req)
	wantCode(t, err, codes.FailedPrecondition, "no LUKS2 support")
	if blkid(t, dev, "TYPE") != "" || isMounted(t, req.StagingPath) {
		t.Fatal("an encrypted volume was formatted or mounted without LUKS2")
	}
	req.Passphrase = nil
	_, err = e.m.Stage(context.Background(), req)
	wantCode(t, err, codes.InvalidArgument, "no passphrase")
}
