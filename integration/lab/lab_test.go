package lab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// newTestLab starts a lab with tgtd in a fresh directory and closes it
// when the test ends.
func newTestLab(t *testing.T, ctx context.Context) *Lab {
	t.Helper()
	if ok, why := GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	cfg, err := TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, g := range l.Guests {
				t.Logf("%s console tail:\n%s", g.Name, g.ConsoleTail(30))
			}
		}
		if err := l.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return l
}

// TestLab boots two guests that share a LUN and checks, on the one lab:
// the LUN is the same disk in both, identities are distinct, persistent
// reservations pass through to the target, disks without PR refuse PR,
// hot-plug and unplug, pause and resume, and finally that Close leaves no
// process behind.
func TestLab(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	l := newTestLab(t, ctx)
	shared, err := l.AddLUN(ctx, "shared0", 128<<20)
	if err != nil {
		t.Fatal(err)
	}
	hdLUN, err := l.AddLUN(ctx, "hd0", 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(l.Dir(), "plain.img")
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// Big enough for LUKS2's 16 MiB header plus the 300 MiB XFS minimum.
	if err := os.Truncate(plain, 400<<20); err != nil {
		t.Fatal(err)
	}
	guests, err := l.StartGuests(ctx,
		GuestConfig{Name: "node-a", Disks: []Disk{
			{ID: "shared0", Kind: SCSIBlock, LUN: shared},
			{ID: "hd0", Kind: SCSIHD, LUN: hdLUN, Serial: "hd0"},
			{ID: "vblk0", Kind: VirtioBlk, File: plain, Serial: "vblk0"},
		}, Reboots: true},
		GuestConfig{Name: "node-b", Disks: []Disk{{ID: "shared0", Kind: SCSIBlock, LUN: shared}}},
	)
	if err != nil {
		t.Fatal(err)
	}
	a, b := guests[0], guests[1]
	for _, g := range guests {
		t.Logf("%s booted in %s", g.Name, g.BootTime.Round(time.Millisecond))
	}

	t.Run("identity", func(t *testing.T) { labIdentity(t, ctx, l, guests) })

	t.Run("shared LUN is the same disk in both guests", func(t *testing.T) { labSharedLUNIsTheSameDiskInBothGuests(t, ctx, a, b, shared) })

	t.Run("persistent reservations pass through to the target", func(t *testing.T) { labPersistentReservationsPassThroughToTheTarget(t, ctx, l, shared) })

	t.Run("disks without PR refuse PR", func(t *testing.T) { labDisksWithoutPRRefusePR(t, ctx, a) })

	t.Run("dm-crypt and filesystems", func(t *testing.T) { labDmCryptAndFilesystems(t, ctx, a, plain) })

	t.Run("hot-plug and unplug", func(t *testing.T) { labHotPlugAndUnplug(t, ctx, l, b, shared) })

	t.Run("pause and resume", func(t *testing.T) { labPauseAndResume(t, ctx, b) })

	t.Run("a guest that reboots comes back with its disks", func(t *testing.T) { labRebootKeepsDisks(t, ctx, a, b) })

	t.Run("teardown leaves nothing running", func(t *testing.T) { labTeardownLeavesNothingRunning(t, l, guests) })
}

func labIdentity(t *testing.T, ctx context.Context, l *Lab, guests []*Guest) {
	seen := map[string]string{}
	for _, g := range guests {
		out, err := g.MustSh(ctx, "cat /sys/class/dmi/id/product_uuid")
		if err != nil {
			t.Fatal(err)
		}
		got := strings.TrimSpace(out)
		if got != g.UUID {
			t.Errorf("%s: SMBIOS UUID in guest %q, configured %q", g.Name, got, g.UUID)
		}
		if other, dup := seen[got]; dup {
			t.Errorf("%s and %s share SMBIOS UUID %s", g.Name, other, got)
		}
		seen[got] = g.Name
	}
	// The initiator name is what the target sees: both must be logged
	// in under their own names.
	show, err := l.Target.Show(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range guests {
		if !strings.Contains(show, "Initiator: "+g.Initiator) {
			t.Errorf("tgtd shows no session from initiator %s:\n%s", g.Initiator, show)
		}
	}
}

func labSharedLUNIsTheSameDiskInBothGuests(t *testing.T, ctx context.Context, a *Guest, b *Guest, shared *LUN) {
	da, err := a.DiskBySerial(ctx, shared.Serial)
	if err != nil {
		t.Fatal(err)
	}
	db, err := b.DiskBySerial(ctx, shared.Serial)
	if err != nil {
		t.Fatal(err)
	}
	if da.WWID == "" || da.WWID != db.WWID {
		t.Fatalf("WWIDs differ or are empty: %s %q, %s %q", a.Name, da.WWID, b.Name, db.WWID)
	}
	// Data written through one guest is read through the other.
	marker := fmt.Sprintf("lab-marker-%d", time.Now().UnixNano())
	if _, err := a.MustSh(ctx, "echo "+marker+" | dd of=/dev/"+da.Name+" bs=4096 seek=10 count=1 conv=sync,fsync oflag=direct 2>&1"); err != nil {
		t.Fatal(err)
	}
	out, err := b.MustSh(ctx, "dd if=/dev/"+db.Name+" bs=4096 skip=10 count=1 iflag=direct 2>/dev/null | head -c 64")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out, marker) {
		t.Fatalf("%s reads %q at block 10, %s wrote %q", b.Name, out, a.Name, marker)
	}
	// And it is in the backing file on the host.
	f, err := os.ReadFile(shared.File)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(f[10*4096:]), marker) {
		t.Fatalf("backing file %s does not hold %q at offset %d", shared.File, marker, 10*4096)
	}
}

func labPersistentReservationsPassThroughToTheTarget(t *testing.T, ctx context.Context, l *Lab, shared *LUN) {
	if err := Smoke(ctx, l, shared, testWriter{t}); err != nil {
		t.Fatal(err)
	}
}

func labDisksWithoutPRRefusePR(t *testing.T, ctx context.Context, a *Guest) {
	for _, serial := range []string{"hd0", "vblk0"} {
		d, err := a.DiskBySerial(ctx, serial)
		if err != nil {
			t.Fatal(err)
		}
		r, err := a.Sh(ctx, "sg_persist -n -i -k /dev/"+d.Name)
		if err != nil {
			t.Fatal(err)
		}
		if r.Exit == 0 {
			t.Errorf("sg_persist READ KEYS succeeded on %s (/dev/%s), which should have no PR: %s", serial, d.Name, r)
		}
	}
}

func labDmCryptAndFilesystems(t *testing.T, ctx context.Context, a *Guest, plain string) {
	vd, err := a.DiskBySerial(ctx, "vblk0")
	if err != nil {
		t.Fatal(err)
	}
	hd, err := a.DiskBySerial(ctx, "hd0")
	if err != nil {
		t.Fatal(err)
	}
	// Cheap PBKDF settings: the guest has 384 MiB and an emulated CPU.
	script := fmt.Sprintf(`set -e
dev=/dev/%s
printf lab-secret | cryptsetup luksFormat --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --batch-mode $dev -
printf lab-secret | cryptsetup open $dev labcrypt -
mkfs.xfs -q /dev/mapper/labcrypt
mkdir -p /mnt/x && mount /dev/mapper/labcrypt /mnt/x
echo through-dm-crypt >/mnt/x/file
umount /mnt/x
cryptsetup close labcrypt
printf lab-secret | cryptsetup open $dev labcrypt -
mount /dev/mapper/labcrypt /mnt/x
cat /mnt/x/file
umount /mnt/x
cryptsetup close labcrypt
mkfs.ext4 -q /dev/%s
mkdir -p /mnt/e && mount /dev/%s /mnt/e && echo on-ext4 >/mnt/e/file && cat /mnt/e/file && umount /mnt/e
blkid -o value -s TYPE /dev/%s`, vd.Name, hd.Name, hd.Name, hd.Name)
	out, err := a.MustSh(ctx, script)
	if err != nil {
		t.Fatal(err)
	}
	if out != "through-dm-crypt\non-ext4\next4\n" {
		t.Fatalf("unexpected output from the dm-crypt/xfs/ext4 round trip: %q", out)
	}
	// The host's cryptsetup reads the header the guest wrote.
	dump, err := exec.CommandContext(ctx, "cryptsetup", "luksDump", plain).CombinedOutput()
	if err != nil || !strings.Contains(string(dump), "Version:       	2") {
		t.Fatalf("host cryptsetup luksDump of %s: %v\n%s", plain, err, dump)
	}
}

func labHotPlugAndUnplug(t *testing.T, ctx context.Context, l *Lab, b *Guest, shared *LUN) {
	hot, err := l.AddLUN(ctx, "hot1", 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	vfile := filepath.Join(l.Dir(), "vhot.img")
	if err := os.WriteFile(vfile, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, d := range []Disk{
		{ID: "hot1", Kind: SCSIBlock, LUN: hot},
		{ID: "vhot1", Kind: VirtioBlk, File: vfile, Serial: "vhot1"},
	} {
		serial := d.Serial
		if d.LUN != nil {
			serial = d.LUN.Serial
		}
		if _, err := b.DiskBySerial(ctx, serial); err == nil {
			t.Fatalf("%s already sees a disk with serial %s before the hot-plug", b.Name, serial)
		}
		if err := b.AttachDisk(ctx, d); err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		gd, err := b.WaitDiskBySerial(wctx, serial)
		cancel()
		if err != nil {
			t.Fatalf("after hot-plug of %s (%s): %v", d.ID, d.Kind, err)
		}
		t.Logf("%s appeared in %s as /dev/%s (wwid %q)", d.ID, b.Name, gd.Name, gd.WWID)
		if d.LUN != nil {
			sd, err := b.DiskBySerial(ctx, shared.Serial)
			if err != nil {
				t.Fatal(err)
			}
			if gd.WWID == "" || gd.WWID == sd.WWID {
				t.Errorf("LUNs %s and %s have WWIDs %q and %q; each LUN needs its own", d.ID, shared.Serial, gd.WWID, sd.WWID)
			}
		}
		if err := b.DetachDisk(ctx, d.ID); err != nil {
			t.Fatal(err)
		}
		gone := false
		for i := 0; i < 60 && !gone; i++ {
			if _, err := b.DiskBySerial(ctx, serial); err != nil {
				gone = true
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		if !gone {
			t.Fatalf("%s still sees %s 30s after unplug", b.Name, d.ID)
		}
	}
}

func labPauseAndResume(t *testing.T, ctx context.Context, b *Guest) {
	if err := b.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := b.MustSh(ctx, "true")
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("a paused guest answered a command (err %v)", err)
	case <-time.After(3 * time.Second):
	}
	if err := b.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the guest did not answer within a minute of resuming")
	}
}

// labRebootKeepsDisks resets a (a hard reset from the host, then a reboot
// from inside): each time it comes back on a new exec channel, what it
// kept in memory is gone and its hot-plugged disk is still there; b, which
// does not reboot, refuses a reset.
func labRebootKeepsDisks(t *testing.T, ctx context.Context, a, b *Guest) {
	if err := b.Reset(ctx); err == nil {
		t.Fatalf("%s, which does not reboot, was reset", b.Name)
	}
	for _, c := range []struct {
		how    string
		reset  func(context.Context) error
		reason string
	}{
		{"reset from the host", a.Reset, "host-qmp-system-reset"},
		{"reboot from inside", a.Reboot, "guest-reset"},
	} {
		if _, err := a.MustSh(ctx, "echo before >/run/vco-lab-reboot-marker"); err != nil {
			t.Fatal(err)
		}
		asked := time.Now()
		if err := c.reset(ctx); err != nil {
			t.Fatalf("%s: %v", c.how, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		reason, err := a.WaitReset(wctx)
		cancel()
		if err != nil || reason != c.reason {
			t.Fatalf("%s: reset reason %q (%v), want %q", c.how, reason, err, c.reason)
		}
		if at := a.LastReset(); at.Before(asked.Add(-time.Second)) || at.After(time.Now()) {
			t.Fatalf("%s: the reset is dated %s, asked for at %s", c.how, at, asked)
		}
		took, err := a.WaitBack(ctx, 5*time.Minute)
		if err != nil {
			t.Fatalf("%s: %v", c.how, err)
		}
		t.Logf("%s: back in %s", c.how, took.Round(time.Millisecond))
		if out, err := a.MustSh(ctx, "cat /run/vco-lab-reboot-marker 2>/dev/null || echo gone"); err != nil || strings.TrimSpace(out) != "gone" {
			t.Fatalf("%s: the marker of the boot before: %q %v", c.how, out, err)
		}
		if _, err := a.DiskBySerial(ctx, "vblk0"); err != nil {
			t.Fatalf("%s: the hot-plugged disk after the reset: %v", c.how, err)
		}
	}
}

func labTeardownLeavesNothingRunning(t *testing.T, l *Lab, guests []*Guest) {
	type rec struct {
		name  string
		pid   int
		start uint64
	}
	recs := []rec{{"tgtd", l.Target.Proc.PID, l.Target.Proc.StartTime}}
	for _, g := range guests {
		recs = append(recs, rec{g.Name, g.Proc.PID, g.Proc.StartTime})
	}
	for _, r := range recs {
		if !Alive(r.pid, r.start) {
			t.Fatalf("%s (pid %d) is not running before teardown", r.name, r.pid)
		}
	}
	ctl := l.Target.CtlPort
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if Alive(r.pid, r.start) {
			t.Errorf("%s (pid %d) still runs after Close", r.name, r.pid)
		}
	}
	if pids, _ := filepath.Glob(filepath.Join(PIDDir(l.Dir()), "*.pid")); len(pids) != 0 {
		t.Errorf("pid files left: %v", pids)
	}
	if _, err := os.Stat(fmt.Sprintf("/var/run/tgtd/socket.%d", ctl)); err == nil {
		t.Errorf("tgtd control socket %d left in /var/run/tgtd", ctl)
	}
}

// TestDownKillsLeftovers simulates a crashed run: a detached lab is left
// running, and Down (what `vco-lab down` calls) kills it by its pid files.
func TestDownKillsLeftovers(t *testing.T) {
	if ok, why := GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cfg, err := TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cfg.Detached = true
	l, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// If the test fails half-way, do not leave the lab running.
	t.Cleanup(func() { l.Close() })
	lun, err := l.AddLUN(ctx, "d0", 16<<20)
	if err != nil {
		t.Fatal(err)
	}
	guests, err := l.StartGuests(ctx, GuestConfig{Name: "node-a", Disks: []Disk{{ID: "d0", Kind: SCSIBlock, LUN: lun}}})
	if err != nil {
		t.Fatal(err)
	}
	g := guests[0]
	st, err := ReadState(l.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Guests) != 1 || st.Guests[0].PID != g.Proc.PID || st.TargetPID != l.Target.Proc.PID {
		t.Fatalf("state.json does not record the running processes: %+v", st)
	}
	killed, err := Down(l.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if len(killed) != 2 {
		t.Errorf("Down killed %v, want tgtd and one guest", killed)
	}
	// Down ran in this process, which is also the parent: wait for the
	// reaper goroutines so a zombie is not mistaken for a survivor.
	for _, p := range []*Proc{g.Proc, l.Target.Proc} {
		select {
		case <-p.Exited():
		case <-time.After(30 * time.Second):
			t.Errorf("%s (pid %d) still runs after Down", p.Name, p.PID)
		}
	}
	if _, err := ReadState(l.Dir()); err == nil {
		t.Error("state.json still present after Down")
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestDownRunFindsKindLabs: a run over several disk kinds keeps one lab
// per kind under its directory; DownRun, given the run's directory, kills
// what was recorded there and in each kind's lab, and nothing else.
func TestDownRunFindsKindLabs(t *testing.T) {
	top := t.TempDir()
	var procs []*Proc
	for _, at := range []struct{ name, dir string }{
		{"top-sleeper", top},
		{"virtio-sleeper", KindDir(top, VirtioBlk)},
		{"scsi-sleeper", KindDir(top, SCSIBlock)},
	} {
		p, err := startProc(at.name, exec.Command("sleep", "600"), PIDDir(at.dir))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Kill() })
		procs = append(procs, p)
	}
	bystander, err := startProc("bystander", exec.Command("sleep", "600"), PIDDir(filepath.Join(top, "not-a-kind")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = bystander.Kill() })

	killed, err := DownRun(top)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, k := range killed {
		names = append(names, strings.Fields(k)[0])
	}
	slices.Sort(names)
	if want := []string{"scsi-sleeper", "top-sleeper", "virtio-sleeper"}; !slices.Equal(names, want) {
		t.Errorf("DownRun killed %v, want %v", killed, want)
	}
	for _, p := range procs {
		select {
		case <-p.Exited():
		case <-time.After(10 * time.Second):
			t.Errorf("%s (pid %d) still runs after DownRun", p.Name, p.PID)
		}
	}
	if !Alive(bystander.PID, bystander.StartTime) {
		t.Error("DownRun killed a process recorded outside the run's labs")
	}
}
