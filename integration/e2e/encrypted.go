package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// e6: an encrypted volume. Each guest reaches the transit engine on the
// host only through a restricted user-network NIC whose one forward leads
// to it (simlab.ConnectTransit), and its node plugin is restarted with
// --vault-addr. First use on node-a formats LUKS2 with a passphrase the
// engine wrapped; data written there reads back on node-b after a move;
// node-b then grows the volume online, dm-crypt mapping and filesystem,
// while it stays mounted; cryptsetup in node-b accepts the passphrase
// unwrapped from the LUKS2 token read off the disk's backing file, and
// refuses another.
//
// The disk is shown as virtio-blk over its backing file
// (simlab.FileVirtioBlk), the lab's only disk that can grow while a
// guest uses it (see e7), so the agent fences it with its on-disk lease
// and LUKS2 sits on the data area past the lease.
func (s *story) e6(ctx context.Context) (err error) {
	const sc = "E6"
	if s.o.TransitPort == 0 {
		s.r.NotRun = append(s.r.NotRun, "E6 encrypted volume: no transit engine given")
		return nil
	}
	for _, g := range []*lab.Guest{s.a, s.b} {
		g := g
		if err := s.step(sc, g.Name, "transit link (restricted user network) and vco-csi with --vault-addr", func() (string, error) {
			return s.e6TransitLink(ctx, g)
		}); err != nil {
			return err
		}
	}
	c := *s
	c.name, c.pod, c.kind = "pvc-e2e-crypt", "pod-crypt-", simlab.FileVirtioBlk
	if err := s.step(sc, "controller", "CreateVolume pvc-e2e-crypt (1 GiB, encryption=true, "+string(c.kind)+")", func() (string, error) {
		return c.e6Create(ctx)
	}); err != nil {
		return err
	}
	pc, err := c.publish(ctx, sc, s.a)
	if err != nil {
		return err
	}
	if err := c.stageAndPublish(ctx, sc, s.a, pc); err != nil {
		if r, _ := s.a.Sh(ctx, "tail -n 25 /var/log/vco-agent.log /var/log/vco-csi.log; dmesg | tail -n 8"); r != nil {
			s.progress("         %s logs after the failed stage:\n%s", s.a.Name, r.Stdout)
		}
		return err
	}
	var sum string
	if err := s.step(sc, s.a.Name, "write 8 MiB to data.bin (through dm-crypt)", func() (string, error) {
		detail, written, err := c.e6WriteThroughDMCrypt(ctx, s.a)
		sum = written
		return detail, err
	}); err != nil {
		return err
	}
	if err := c.unpublishAndUnstage(ctx, sc, s.a); err != nil {
		return err
	}
	if err := c.unpublish(ctx, sc, s.a); err != nil {
		return err
	}
	if pc, err = c.publish(ctx, sc, s.b); err != nil {
		return err
	}
	if err := c.stageAndPublish(ctx, sc, s.b, pc); err != nil {
		return err
	}
	if err := s.readBack(ctx, sc, s.b, c.pod+s.b.Name, "read data.bin", sum,
		"the encrypted volume moved to "+s.b.Name, "opened, not formatted again"); err != nil {
		return err
	}
	for _, g := range []*lab.Guest{s.a, s.b} {
		if err := s.step(sc, g.Name, "the agent unlocked the volume through luks.go", func() (string, error) {
			return unlockedBy(ctx, g, c.volID)
		}); err != nil {
			return err
		}
	}
	if err := c.growOnline(ctx, sc, s.b, sum); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "cryptsetup accepts the unwrapped passphrase, refuses another", func() (string, error) {
		return c.cryptsetupCheck(ctx, s.b)
	}); err != nil {
		return err
	}
	return c.takeDown(ctx, sc, s.b)
}

// e6TransitLink links g to the transit engine and restarts its node
// plugin with --vault-addr.
func (s *story) e6TransitLink(ctx context.Context, g *lab.Guest) (string, error) {
	engine := s.o.TransitEngine
	if engine == "" {
		engine = fmt.Sprintf("transit engine on 127.0.0.1:%d", s.o.TransitPort)
	}
	if err := simlab.ConnectTransit(ctx, g, s.o.TransitPort); err != nil {
		return "", err
	}
	if err := simlab.StopNodeStack(ctx, g); err != nil {
		return "", err
	}
	addr := simlab.TransitGuestAddr
	if len(s.o.TransitCA) > 0 {
		addr = simlab.TransitGuestTLSAddr
	}
	return fmt.Sprintf("%s; the guest reaches it at %s", engine, addr),
		simlab.StartNodeStackWith(ctx, g, simlab.StackOptions{VaultAddr: addr, VaultToken: s.o.TransitToken, VaultCA: s.o.TransitCA})
}

// e6Create creates c's encrypted volume.
func (c *story) e6Create(ctx context.Context) (string, error) {
	req := VolumeRequest(c.name)
	req.Parameters = map[string]string{"encryption": "true"}
	v, err := c.createVolume(ctx, req)
	if err != nil {
		return "", err
	}
	c.volCtx = v.VolumeContext
	return fmt.Sprintf("volume %s, context %v", c.volID, c.volCtx), nil
}

// e6WriteThroughDMCrypt writes 8 MiB to data.bin in c's pod on g, whose
// staging path must be mounted from a dm-crypt mapping, and returns the
// step's detail and the file's sha256.
func (c *story) e6WriteThroughDMCrypt(ctx context.Context, g *lab.Guest) (detail, sum string, err error) {
	out, err := g.MustSh(ctx, "awk '$2==\""+stagingPath(c.name)+"\"{print $1}' /proc/mounts")
	if err != nil {
		return "", "", err
	}
	if !strings.HasPrefix(strings.TrimSpace(out), "/dev/mapper/") && !strings.HasPrefix(strings.TrimSpace(out), "/dev/dm-") {
		return "", "", fmt.Errorf("the staging path is mounted from %q, not a dm-crypt mapping", strings.TrimSpace(out))
	}
	sum, err = writeFile(ctx, g, c.pod+g.Name, "data.bin", 8)
	if err != nil {
		return "", "", err
	}
	return "mounted from " + strings.TrimSpace(out) + "; sha256 " + sum, sum, nil
}

// cryptsetupCheck finds the device under the volume's dm-crypt mapping in
// g, reads the vco-transit token from the LUKS2 header where that device
// starts in the disk's backing file on the host, has the transit engine
// unwrap the passphrase, and asks cryptsetup in g whether it opens the
// device with it (and refuses the passphrase changed).
func (s *story) cryptsetupCheck(ctx context.Context, g *lab.Guest) (string, error) {
	// The mapping's device, and where it starts on the disk: a loop
	// device over the data area past the lease, or the disk itself.
	out, err := g.MustSh(ctx, `for m in /dev/mapper/*; do cryptsetup status ${m##*/} 2>/dev/null | awk '$1=="device:"{print $2}'; done | head -n 1`)
	if err != nil {
		return "", err
	}
	dev := strings.TrimSpace(out)
	if dev == "" {
		return "", fmt.Errorf("no dm-crypt mapping in %s names its disk", g.Name)
	}
	var offset int64
	if name, ok := strings.CutPrefix(dev, "/dev/loop"); ok {
		o, err := g.MustSh(ctx, "cat /sys/block/loop"+name+"/loop/offset")
		if err != nil {
			return "", err
		}
		if offset, err = strconv.ParseInt(strings.TrimSpace(o), 10, 64); err != nil {
			return "", fmt.Errorf("loop%s offset %q: %w", name, o, err)
		}
	}
	tok, err := tokenAt(s.env.Backend.DiskFile(s.diskID), offset, filepath.Join(s.env.Lab.Dir(), "e6-header.img"))
	if err != nil {
		return "", err
	}
	tc, err := s.hostTransit(tok.Mount)
	if err != nil {
		return "", err
	}
	pass, err := tc.Decrypt(ctx, tok.KeyName, tok.Ciphertext)
	if err != nil {
		return "", fmt.Errorf("unwrapping the token's passphrase: %w", err)
	}
	// The passphrase goes in on stdin (--key-file -), never on a
	// command line.
	try := func(p []byte) (bool, string, error) {
		r, err := g.Exec().RunInput(ctx, 0, p, "cryptsetup", "open", "--test-passphrase", "--key-file", "-", dev)
		if err != nil {
			return false, "", err
		}
		return r.Exit == 0 && !r.TimedOut, strings.TrimSpace(r.Stdout + r.Stderr), nil
	}
	ok, okOut, err := try(pass)
	if err != nil {
		return "", err
	}
	bad, badOut, err := try(append([]byte("not-"), pass...))
	if err != nil {
		return "", err
	}
	if !ok || bad {
		return "", fmt.Errorf("cryptsetup on %s: unwrapped passphrase accepted %v (%s), another accepted %v (%s)", dev, ok, okOut, bad, badOut)
	}
	return fmt.Sprintf("LUKS2 header at byte %d of the disk; token key %s version %d; %s opens with the unwrapped passphrase, not with another", offset, tok.KeyName, tok.KeyVersion, dev), nil
}

// hostTransit is a transit client of the engine from the host, for mount.
func (s *story) hostTransit(mount string) (*transit.Client, error) {
	cfg := transit.Config{Address: fmt.Sprintf("http://127.0.0.1:%d", s.o.TransitPort), Mount: mount, Token: s.o.TransitToken}
	if len(s.o.TransitCA) > 0 {
		ca := filepath.Join(s.env.Lab.Dir(), "transit-ca.pem")
		if err := os.WriteFile(ca, s.o.TransitCA, 0o644); err != nil {
			return nil, err
		}
		cfg.Address, cfg.CACertFile = fmt.Sprintf("https://127.0.0.1:%d", s.o.TransitPort), ca
	}
	return transit.New(cfg)
}

// tokenAt reads the vco-transit token of the LUKS2 volume that starts
// offset bytes into file, through a copy of its header area at tmp.
func tokenAt(file string, offset int64, tmp string) (*luks2.TransitToken, error) {
	// Both header copies and the keyslots lie in the first 16 MiB.
	const area = 16 << 20
	src, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	dst, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp)
	_, err = io.Copy(dst, io.NewSectionReader(src, offset, area))
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("copying the header area of %s at byte %d: %w", file, offset, err)
	}
	v, err := luks2.Open(tmp, false)
	if err != nil {
		return nil, fmt.Errorf("reading the LUKS2 header at byte %d of %s: %w", offset, file, err)
	}
	defer v.Close()
	_, tok, err := v.TransitToken()
	if err == nil && tok == nil {
		err = fmt.Errorf("the LUKS2 header at byte %d of %s has no %s token", offset, file, luks2.TransitTokenType)
	}
	return tok, err
}

// unlockedBy reads from g's agent log which code unlocked volume at each
// of its stages there, and fails unless luks.go did every time.
func unlockedBy(ctx context.Context, g *lab.Guest, volume string) (string, error) {
	out, err := g.MustSh(ctx, `grep 'msg="volume staged"' /var/log/vco-agent.log || true`)
	if err != nil {
		return "", err
	}
	n := 0
	for _, line := range strings.Split(out, "\n") {
		if !strings.Contains(line, "volume="+volume+" ") && !strings.Contains(line, `volume="`+volume+`"`) {
			continue
		}
		n++
		if !strings.Contains(line, "unlocked_by=luks.go") {
			return "", fmt.Errorf("a stage of %s was not unlocked by luks.go: %s", volume, line)
		}
	}
	if n == 0 {
		return "", fmt.Errorf("the agent's log has no stage of %s", volume)
	}
	return fmt.Sprintf("%d stage(s) of %s, each unlocked_by=luks.go", n, volume), nil
}
