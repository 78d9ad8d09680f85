package lab

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// Target is a tgtd (Linux SCSI target framework, userspace) serving iSCSI
// on 127.0.0.1 only, with a control port of its own so it never touches
// another tgtd on the machine. tgt implements SCSI-3 persistent
// reservations, which is why the lab uses it (it lacks PREEMPT AND ABORT
// and APTPL).
type Target struct {
	CtlPort int // tgtadm -C
	Port    int // iSCSI portal port on 127.0.0.1
	Proc    *Proc
	dir     string
	nextTID int
	spawn   spawner
}

// LUN is a logical unit the target serves, backed by a sparse file.
type LUN struct {
	IQN    string
	TID    int
	File   string
	Size   int64
	Serial string // VPD 0x80
	SCSIID string // VPD 0x83 identifier as tgt reports it
	Portal string // 127.0.0.1:PORT
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on now.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ctlPortFree reports whether no tgtd holds the lock of control port n.
func ctlPortFree(n int) bool {
	lock := fmt.Sprintf("/var/run/tgtd/socket.%d.lock", n)
	f, err := os.OpenFile(lock, os.O_RDWR, 0)
	if err != nil {
		return os.IsNotExist(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return false
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return true
}

// StartTarget starts tgtd in the foreground under dir and waits until it
// answers tgtadm. Control port and portal are chosen free; a start that
// loses a race for either is retried with new ones.
func StartTarget(ctx context.Context, dir string) (*Target, error) {
	return startTarget(ctx, dir, spawner{})
}

func startTarget(ctx context.Context, dir string, spawn spawner) (*Target, error) {
	tgtd, err := exec.LookPath("tgtd")
	if err != nil {
		return nil, fmt.Errorf("tgtd not found (install Debian package tgt): %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		ctl := 1000 + rand.IntN(29000)
		if !ctlPortFree(ctl) {
			continue
		}
		port, err := FreePort()
		if err != nil {
			return nil, err
		}
		logf, err := os.Create(filepath.Join(dir, "tgtd.log"))
		if err != nil {
			return nil, err
		}
		cmd := exec.Command(tgtd, "-f", "-C", strconv.Itoa(ctl), "--iscsi", fmt.Sprintf("portal=127.0.0.1:%d", port))
		cmd.Stdout, cmd.Stderr = logf, logf
		p, err := spawn.start("tgtd", cmd, PIDDir(dir))
		logf.Close()
		if err != nil {
			return nil, err
		}
		t := &Target{CtlPort: ctl, Port: port, Proc: p, dir: dir, spawn: spawn}
		if err := t.waitReady(ctx); err != nil {
			lastErr = err
			t.Stop()
			if ctx.Err() != nil {
				break
			}
			continue
		}
		return t, nil
	}
	return nil, fmt.Errorf("tgtd did not start (log in %s): %w", filepath.Join(dir, "tgtd.log"), lastErr)
}

func (t *Target) waitReady(ctx context.Context) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case <-t.Proc.Exited():
			return fmt.Errorf("tgtd exited at start: %v", t.Proc.exitErr)
		default:
		}
		_, err := t.tgtadm(ctx, "--mode", "sys", "--op", "show")
		if err == nil {
			// tgtd answers on its control socket before the portal is
			// bound; make sure the portal listens too.
			c, derr := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", t.Port), time.Second)
			if derr == nil {
				c.Close()
				return nil
			}
			err = derr
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("tgtd on control port %d not ready: %w", t.CtlPort, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (t *Target) tgtadm(ctx context.Context, args ...string) (string, error) {
	full := append([]string{"-C", strconv.Itoa(t.CtlPort), "--lld", "iscsi"}, args...)
	out, err := exec.CommandContext(ctx, "tgtadm", full...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("tgtadm %v: %w: %s", full, err, out)
	}
	return string(out), nil
}

// Portal is the iSCSI portal address.
func (t *Target) Portal() string { return fmt.Sprintf("127.0.0.1:%d", t.Port) }

// AddLUN creates a sparse backing file of size bytes and a new target
// named iqn whose LUN 1 serves it with the given unit serial number
// (VPD 0x80) and SCSI ID (VPD 0x83). Every initiator may log in: the
// portal is on loopback only.
func (t *Target) AddLUN(ctx context.Context, iqn, file string, size int64, serial, scsiID string) (*LUN, error) {
	// A fresh file: a LUN never starts with an earlier run's data.
	if err := os.Remove(file); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("removing old LUN backing file: %w", err)
	}
	f, err := os.OpenFile(file, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("sizing LUN backing file %s: %w", file, err)
	}
	return t.ServeFile(ctx, iqn, file, serial, scsiID)
}

// ServeFile makes an existing file LUN 1 of a new target named iqn, with
// the given unit serial number (VPD 0x80) and SCSI ID (VPD 0x83). The
// file's size at this moment is the LUN's size.
func (t *Target) ServeFile(ctx context.Context, iqn, file, serial, scsiID string) (*LUN, error) {
	st, err := os.Stat(file)
	if err != nil {
		return nil, err
	}
	t.nextTID++
	l := &LUN{IQN: iqn, TID: t.nextTID, File: file, Size: st.Size(), Serial: serial, SCSIID: scsiID, Portal: t.Portal()}
	if err := t.serve(ctx, l); err != nil {
		return nil, err
	}
	return l, nil
}

// serve makes tgtd serve l under l's target id.
func (t *Target) serve(ctx context.Context, l *LUN) error {
	tid, iqn, file := strconv.Itoa(l.TID), l.IQN, l.File
	steps := [][]string{
		{"--mode", "target", "--op", "new", "--tid", tid, "-T", iqn},
		{"--mode", "logicalunit", "--op", "new", "--tid", tid, "--lun", "1", "-b", file},
		{"--mode", "logicalunit", "--op", "update", "--tid", tid, "--lun", "1", "--params", "scsi_sn=" + l.Serial + ",scsi_id=" + l.SCSIID},
		{"--mode", "target", "--op", "bind", "--tid", tid, "-I", "ALL"},
	}
	for _, s := range steps {
		if _, err := t.tgtadm(ctx, s...); err != nil {
			return fmt.Errorf("creating LUN %s on %s: %w", iqn, file, err)
		}
	}
	return nil
}

// Restart kills tgtd with SIGKILL -- the reservations it held in memory
// are gone, as tgt keeps no APTPL state -- and starts a new one on the same
// control port and portal serving luns again under their target ids,
// names, serials and backing files, so that initiators reconnect to what
// looks like the same disk after a target reboot.
func (t *Target) Restart(ctx context.Context, luns ...*LUN) error {
	if err := t.Proc.Kill(); err != nil {
		return fmt.Errorf("killing tgtd (pid %d): %w", t.Proc.PID, err)
	}
	logf, err := os.OpenFile(filepath.Join(t.dir, "tgtd.log"), os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command("tgtd", "-f", "-C", strconv.Itoa(t.CtlPort), "--iscsi", fmt.Sprintf("portal=127.0.0.1:%d", t.Port))
	cmd.Stdout, cmd.Stderr = logf, logf
	p, err := t.spawn.start("tgtd", cmd, PIDDir(t.dir))
	logf.Close()
	if err != nil {
		return err
	}
	t.Proc = p
	if err := t.waitReady(ctx); err != nil {
		return fmt.Errorf("restarted tgtd (log %s): %w", filepath.Join(t.dir, "tgtd.log"), err)
	}
	for _, l := range luns {
		if err := t.serve(ctx, l); err != nil {
			return fmt.Errorf("serving %s again: %w", l.IQN, err)
		}
	}
	return nil
}

// RemoveTarget deletes target tid with its LUN, logging out any initiator
// still connected; the backing file stays.
func (t *Target) RemoveTarget(ctx context.Context, tid int) error {
	_, err := t.tgtadm(ctx, "--mode", "target", "--op", "delete", "--force", "--tid", strconv.Itoa(tid))
	return err
}

// Show returns tgtadm's view of all targets (for diagnostics).
func (t *Target) Show(ctx context.Context) (string, error) {
	return t.tgtadm(ctx, "--mode", "target", "--op", "show")
}

// Stop SIGKILLs tgtd (it ignores SIGTERM) and removes the control socket
// files it leaves in /var/run/tgtd.
func (t *Target) Stop() error {
	err := t.Proc.Kill()
	removeCtlSocket(t.CtlPort)
	return err
}

func removeCtlSocket(ctl int) {
	if ctl <= 0 || !ctlPortFree(ctl) {
		return
	}
	s := fmt.Sprintf("/var/run/tgtd/socket.%d", ctl)
	for _, p := range []string{s, s + ".lock"} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
	}
}
