package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
)

// DiskKind is how a disk is presented to a guest.
type DiskKind string

const (
	// SCSIBlock passes SCSI commands through to the iSCSI target, so
	// persistent reservations reach tgt: the cloud's shared disks.
	SCSIBlock DiskKind = "scsi-block"
	// SCSIHD is a SCSI disk emulated by QEMU; it answers PR commands with
	// "invalid opcode", like a disk without PR.
	SCSIHD DiskKind = "scsi-hd"
	// VirtioBlk is a virtio-blk-pci disk: no SCSI, no PR.
	VirtioBlk DiskKind = "virtio-blk"
)

// Disk is a disk to give a guest, backed by an iSCSI LUN or a host file.
type Disk struct {
	ID     string // QEMU device id; the block node is "bd-"+ID
	Kind   DiskKind
	LUN    *LUN   // iSCSI backend, or
	File   string // a host file (raw)
	Serial string // for scsi-hd and virtio-blk; scsi-block shows the target's
}

// GuestConfig describes one guest.
type GuestConfig struct {
	Name      string
	UUID      string // SMBIOS system UUID
	Initiator string // iSCSI initiator name
	MemMB     int
	CPUs      int
	Disks     []Disk
	// System, if set, boots the guest from a root disk with a kernel,
	// initrd and init (systemd) of its own instead of the lab's busybox
	// initramfs (debian.go).
	System *SystemBoot
	// Forwards, if any, give the guest a virtio-net NIC on QEMU user
	// networking with restrict=on (no route anywhere) whose only ways out
	// are these: each takes the guest's connections to a 10.0.2.x address
	// and port to a port on the host's loopback. The guest finds the NIC by its
	// MAC address, 52:54:00:12:34:56, and configures it itself (10.0.2.15/24).
	Forwards []Forward
	// Inbound are ports of the guest the host reaches on its loopback
	// (QEMU hostfwd), on the same NIC as Forwards: 127.0.0.1:HostPort
	// is the guest's GuestPort.
	Inbound []Inbound
	// Reboots lets the guest reboot (a reset starts it again, its
	// hot-plugged disks and its root overlay kept) instead of QEMU
	// exiting when it resets (reboot.go).
	Reboots bool
}

// Inbound takes the host's connections to 127.0.0.1:HostPort to the
// guest's GuestPort.
type Inbound struct {
	HostPort, GuestPort int
}

// Forward takes a guest's TCP connections to GuestAddr (a 10.0.2.x
// address and port) to 127.0.0.1:HostPort, one `busybox nc` per
// connection.
type Forward struct {
	GuestAddr string
	HostPort  int
}

// netArgs is the QEMU networking of cfg: none, or the restricted user
// network with its forwards both ways.
func netArgs(cfg GuestConfig) []string {
	if len(cfg.Forwards) == 0 && len(cfg.Inbound) == 0 {
		return []string{"-nic", "none"}
	}
	nd := "user,id=net0,restrict=on,net=10.0.2.0/24"
	for _, f := range cfg.Forwards {
		nd += fmt.Sprintf(",guestfwd=tcp:%s-cmd:busybox nc 127.0.0.1 %d", f.GuestAddr, f.HostPort)
	}
	for _, in := range cfg.Inbound {
		nd += fmt.Sprintf(",hostfwd=tcp:127.0.0.1:%d-:%d", in.HostPort, in.GuestPort)
	}
	return []string{"-netdev", nd, "-device", "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56"}
}

// Guest is a running QEMU guest.
type Guest struct {
	GuestConfig
	Dir        string
	QMPSocket  string
	ExecSocket string
	Console    string
	Proc       *Proc
	// BootTime is from starting QEMU until the guest's exec server answered.
	BootTime time.Duration

	qmp *QMP

	mu     sync.Mutex // guards exec, which a reboot replaces
	exec   *guestexec.Client
	bootID string // the boot the exec channel was dialed in (reboot.go)
	// lastReset is when the reset WaitReset last returned happened.
	lastReset time.Time
}

// qemuArgs is the guest's command line. The machine starts paused (-S) so
// disks are added through the same QMP path hot-plug uses, then resumed.
func qemuArgs(cfg GuestConfig, k *Kernel, initrd, dir string) []string {
	kernel, appendArgs := k.Vmlinuz, "console=ttyS0 panic=-1 loglevel=4 vco.node="+cfg.Name
	var root []string
	if sb := cfg.System; sb != nil {
		kernel, initrd = sb.Kernel, sb.Initrd
		appendArgs = "root=/dev/vda rw " + appendArgs + " systemd.hostname=" + cfg.Name + " systemd.show_status=0"
		// snapshot=on: the guest writes to a temporary overlay QEMU drops
		// when it exits, so guests share one root image and never change it.
		root = []string{"-drive", "file=" + sb.Root + ",format=raw,if=virtio,snapshot=on"}
	}
	return append([]string{
		"-name", cfg.Name,
		"-machine", "pc", "-accel", "tcg", "-cpu", "max",
		"-m", strconv.Itoa(cfg.MemMB), "-smp", strconv.Itoa(cfg.CPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-vga", "none",
		"-S",
		"-kernel", kernel, "-initrd", initrd,
		"-append", appendArgs,
		"-chardev", "file,id=con,path=" + filepath.Join(dir, "console.log"),
		"-serial", "chardev:con",
		"-qmp", "unix:" + filepath.Join(dir, "qmp.sock") + ",server=on,wait=off",
		"-chardev", "socket,id=exec,path=" + filepath.Join(dir, "exec.sock") + ",server=on,wait=off",
		"-device", "virtio-serial-pci,id=vser",
		"-device", "virtserialport,bus=vser.0,chardev=exec,name=" + guestexec.PortName,
		"-device", "virtio-scsi-pci,id=scsi0",
		"-smbios", "type=1,uuid=" + cfg.UUID,
	}, append(append(netArgs(cfg), root...), rebootArgs(cfg)...)...)
}

// startGuest starts QEMU paused, attaches the disks, resumes it and waits
// for the exec server. On error the QEMU process is killed.
func startGuest(ctx context.Context, cfg GuestConfig, k *Kernel, initrd, dir, pidDir string, spawn spawner) (_ *Guest, err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	for _, s := range []string{"qmp.sock", "exec.sock"} {
		_ = os.Remove(filepath.Join(dir, s))
	}
	g := &Guest{
		GuestConfig: cfg, Dir: dir,
		QMPSocket:  filepath.Join(dir, "qmp.sock"),
		ExecSocket: filepath.Join(dir, "exec.sock"),
		Console:    filepath.Join(dir, "console.log"),
	}
	logf, err := os.Create(filepath.Join(dir, "qemu.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command("qemu-system-x86_64", qemuArgs(cfg, k, initrd, dir)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	started := time.Now()
	g.Proc, err = spawn.start("qemu-"+cfg.Name, cmd, pidDir)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			g.Stop()
			err = fmt.Errorf("guest %s: %w (QEMU log %s, console %s)", cfg.Name, err, filepath.Join(dir, "qemu.log"), g.Console)
		}
	}()
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	g.qmp, err = DialQMP(qctx, g.QMPSocket)
	cancel()
	if err != nil {
		return nil, err
	}
	for _, d := range cfg.Disks {
		if err := g.AttachDisk(ctx, d); err != nil {
			return nil, err
		}
	}
	if _, err := g.qmp.Execute(ctx, "cont", nil); err != nil {
		return nil, err
	}
	if err := g.redial(ctx, 5*time.Minute); err != nil {
		return nil, err
	}
	g.BootTime = time.Since(started)
	return g, nil
}

// errNoAnswer is a guest whose exec server did not answer within the boot
// wait.
var errNoAnswer = errors.New("guest did not come up")

// bootRetrying runs start, which boots a guest whose files are in dir, and
// runs it once more when the guest did not answer: now and then a TCG
// guest hangs in early boot on a busy host (RCU stalls, "timer wakeup
// didn't happen" on one vCPU, udev workers blocked) and its next boot is
// sound. The hung boot's console is kept as console-hung.log.
func bootRetrying(ctx context.Context, dir string, start func() (*Guest, error)) (*Guest, error) {
	g, err := start()
	if !errors.Is(err, errNoAnswer) || ctx.Err() != nil {
		return g, err
	}
	_ = os.Rename(filepath.Join(dir, "console.log"), filepath.Join(dir, "console-hung.log"))
	g, err2 := start()
	if err2 != nil {
		return nil, fmt.Errorf("%w; booted once more: %w", err, err2)
	}
	return g, nil
}

func (d Disk) nodeName() string { return "bd-" + d.ID }

// blockdev is the QMP blockdev-add argument for the disk's backend.
func (d Disk) blockdev(initiator string) (map[string]any, error) {
	switch {
	case d.LUN != nil:
		return map[string]any{
			"driver": "iscsi", "node-name": d.nodeName(),
			"transport": "tcp", "portal": d.LUN.Portal, "target": d.LUN.IQN, "lun": 1,
			"initiator-name": initiator,
		}, nil
	case d.File != "":
		return map[string]any{
			"driver": "raw", "node-name": d.nodeName(),
			"file": map[string]any{"driver": "file", "filename": d.File, "locking": "off"},
		}, nil
	}
	return nil, fmt.Errorf("disk %s has neither a LUN nor a file", d.ID)
}

// device is the QMP device_add argument for the disk's frontend.
func (d Disk) device() (map[string]any, error) {
	dev := map[string]any{"id": d.ID, "drive": d.nodeName()}
	switch d.Kind {
	case SCSIBlock:
		if d.LUN == nil {
			return nil, fmt.Errorf("disk %s: scsi-block needs an iSCSI LUN", d.ID)
		}
		dev["driver"] = "scsi-block"
		dev["bus"] = "scsi0.0"
	case SCSIHD:
		dev["driver"] = "scsi-hd"
		dev["bus"] = "scsi0.0"
		dev["share-rw"] = true
	case VirtioBlk:
		dev["driver"] = "virtio-blk-pci"
		dev["share-rw"] = true
	default:
		return nil, fmt.Errorf("disk %s: unknown kind %q", d.ID, d.Kind)
	}
	if d.Serial != "" && d.Kind != SCSIBlock {
		dev["serial"] = d.Serial
	}
	return dev, nil
}

// AttachDisk adds the disk's backend and device (hot-plug if the guest runs).
func (g *Guest) AttachDisk(ctx context.Context, d Disk) error {
	bd, err := d.blockdev(g.Initiator)
	if err != nil {
		return err
	}
	dev, err := d.device()
	if err != nil {
		return err
	}
	if _, err := g.qmp.Execute(ctx, "blockdev-add", bd); err != nil {
		return fmt.Errorf("attaching disk %s to %s: %w", d.ID, g.Name, err)
	}
	if _, err := g.qmp.Execute(ctx, "device_add", dev); err != nil {
		_, _ = g.qmp.Execute(ctx, "blockdev-del", map[string]any{"node-name": d.nodeName()})
		return fmt.Errorf("attaching disk %s to %s: %w", d.ID, g.Name, err)
	}
	return nil
}

// DetachDisk unplugs the device, waits for QEMU to report it gone (for PCI
// devices that takes the guest's cooperation), and drops its backend.
func (g *Guest) DetachDisk(ctx context.Context, id string) error {
	if _, err := g.qmp.Execute(ctx, "device_del", map[string]any{"id": id}); err != nil {
		return fmt.Errorf("detaching disk %s from %s: %w", id, g.Name, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	_, err := g.qmp.WaitEvent(wctx, "DEVICE_DELETED", func(data json.RawMessage) bool {
		var d struct {
			Device string `json:"device"`
		}
		return json.Unmarshal(data, &d) == nil && d.Device == id
	})
	if err != nil {
		return fmt.Errorf("detaching disk %s from %s: guest did not release the device: %w", id, g.Name, err)
	}
	if _, err := g.qmp.Execute(ctx, "blockdev-del", map[string]any{"node-name": Disk{ID: id}.nodeName()}); err != nil {
		return fmt.Errorf("detaching disk %s from %s: %w", id, g.Name, err)
	}
	return nil
}

// Pause stops the guest's CPUs (QMP stop): a node that hangs.
func (g *Guest) Pause(ctx context.Context) error {
	_, err := g.qmp.Execute(ctx, "stop", nil)
	return err
}

// Resume restarts the guest's CPUs (QMP cont).
func (g *Guest) Resume(ctx context.Context) error {
	_, err := g.qmp.Execute(ctx, "cont", nil)
	return err
}

// QMP gives direct access to the guest's QMP connection.
func (g *Guest) QMP() *QMP { return g.qmp }

// Exec is the guest's command channel.
func (g *Guest) Exec() *guestexec.Client {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.exec
}

// setExec puts c as the guest's command channel and closes the one before.
func (g *Guest) setExec(c *guestexec.Client) {
	g.mu.Lock()
	old := g.exec
	g.exec = c
	g.mu.Unlock()
	if old != nil {
		old.Close()
	}
}

// Run runs argv in the guest (see guestexec.Client.Run).
func (g *Guest) Run(ctx context.Context, argv ...string) (*guestexec.Result, error) {
	return g.Exec().Run(ctx, 0, argv...)
}

// Sh runs a shell command line in the guest.
func (g *Guest) Sh(ctx context.Context, script string) (*guestexec.Result, error) {
	return g.Exec().Sh(ctx, script)
}

// MustSh runs a shell command line and fails unless it exits 0; the error
// carries the command's output.
func (g *Guest) MustSh(ctx context.Context, script string) (string, error) {
	r, err := g.Exec().Sh(ctx, script)
	if err != nil {
		return "", fmt.Errorf("%s: %w", g.Name, err)
	}
	if r.Exit != 0 {
		return r.Stdout, fmt.Errorf("%s: %q: %s", g.Name, script, r)
	}
	return r.Stdout, nil
}

// ConsoleTail returns the end of the guest's console log (diagnostics).
func (g *Guest) ConsoleTail(n int) string {
	b, _ := os.ReadFile(g.Console)
	return LastLines(string(b), n)
}

// LastLines is the last n lines of s, for error texts that quote a log.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Stop kills QEMU and closes the channels.
func (g *Guest) Stop() error {
	if c := g.Exec(); c != nil {
		c.Close()
	}
	if g.qmp != nil {
		g.qmp.Close()
	}
	if g.Proc == nil {
		return nil
	}
	return g.Proc.Kill()
}
