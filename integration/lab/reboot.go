package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
)

// rebootArgs keeps a guest that does not ask for Reboots from starting
// again: QEMU exits when it resets, which is how the lab sees a host
// watchdog's reset.
func rebootArgs(cfg GuestConfig) []string {
	if cfg.Reboots {
		return nil
	}
	return []string{"-no-reboot"}
}

// Reset resets the guest at once (QMP system_reset): a hard reset, as a
// hypervisor's, with nothing in the guest told before.
func (g *Guest) Reset(ctx context.Context) error {
	if !g.Reboots {
		return fmt.Errorf("guest %s does not reboot (GuestConfig.Reboots)", g.Name)
	}
	_, err := g.qmp.Execute(ctx, "system_reset", nil)
	return err
}

// Reboot asks the guest to reboot (systemd's systemctl reboot; reboot -f
// in the lab's initramfs, which has no systemd) and does not wait for
// it: WaitReset and WaitBack do.
func (g *Guest) Reboot(ctx context.Context) error {
	if !g.Reboots {
		return fmt.Errorf("guest %s does not reboot (GuestConfig.Reboots)", g.Name)
	}
	_, err := g.Exec().Start(ctx, "/bin/sh", "-c", "command -v systemctl >/dev/null && exec systemctl reboot; exec reboot -f")
	return err
}

// WaitReset waits for the guest's next reset (QEMU's RESET event, whoever
// asked for it: the guest, its watchdog, Reset) and says who asked. The
// firmware resets the machine once more as it starts; WaitBack forgets
// those resets, so that a WaitReset after it waits for a new one.
func (g *Guest) WaitReset(ctx context.Context) (string, error) {
	ev, err := g.qmp.WaitEvent(ctx, "RESET", nil)
	if err != nil {
		return "", fmt.Errorf("guest %s: %w", g.Name, err)
	}
	var d struct {
		Reason string `json:"reason"`
	}
	_ = json.Unmarshal(ev.Data, &d)
	g.mu.Lock()
	g.lastReset = ev.At
	g.mu.Unlock()
	return d.Reason, nil
}

// LastReset is when the reset WaitReset last returned happened, as QEMU
// says.
func (g *Guest) LastReset() time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.lastReset
}

// WaitBack waits, after a reset, until the guest's exec server answers on
// a new channel from a new boot (its boot_id another than the one the
// guest had), and returns how long that took. A guest that hangs early
// in boot (as a first boot now and then does on a busy TCG host, see
// bootRetrying) is reset once more.
func (g *Guest) WaitBack(ctx context.Context, limit time.Duration) (time.Duration, error) {
	began := time.Now()
	err := g.redial(ctx, limit)
	if errors.Is(err, errNoAnswer) && ctx.Err() == nil {
		if rerr := g.Reset(ctx); rerr != nil {
			return 0, fmt.Errorf("%w; resetting it once more: %w", err, rerr)
		}
		if _, rerr := g.WaitReset(ctx); rerr != nil {
			return 0, rerr
		}
		err = g.redial(ctx, limit)
	}
	if err != nil {
		return 0, fmt.Errorf("guest %s after its reset: %w (console %s)", g.Name, err, g.Console)
	}
	g.qmp.DropEvents("RESET")
	return time.Since(began), nil
}

// bootIDPath names the kernel's boot, another at each boot.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// readBootID is the boot_id of the guest's running kernel.
func readBootID(ctx context.Context, c *guestexec.Client) (string, error) {
	r, err := c.Run(ctx, 10*time.Second, "cat", bootIDPath)
	if err != nil {
		return "", err
	}
	if r.Exit != 0 || strings.TrimSpace(r.Stdout) == "" {
		return "", fmt.Errorf("reading %s: %s", bootIDPath, r)
	}
	return strings.TrimSpace(r.Stdout), nil
}

// redial drops the exec channel (QEMU's socket takes one client at a
// time) and dials a new one, until limit: the first boot's server, or, for
// a guest that reboots, one of another boot than the guest's last.
func (g *Guest) redial(ctx context.Context, limit time.Duration) error {
	if old := g.Exec(); old != nil {
		old.Close()
	}
	dctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	ch := make(chan dialed, 1)
	go func() { ch <- dialNewBoot(dctx, g.ExecSocket, g.bootID) }()
	select {
	case d := <-ch:
		if d.err != nil {
			return fmt.Errorf("%w: %w", errNoAnswer, d.err)
		}
		g.setExec(d.c)
		if g.Reboots {
			g.bootID, _ = readBootID(ctx, d.c)
		}
		return nil
	case <-g.Proc.Exited():
		cancel()
		return fmt.Errorf("QEMU exited: %v", g.Proc.exitErr)
	}
}

// dialNewBoot dials the guest's exec server until one answers whose boot
// is not before's: until the guest has reset, the server of the boot
// before may still answer. With no boot before (the first boot), the
// first server that answers is the one.
func dialNewBoot(ctx context.Context, socket, before string) dialed {
	for {
		c, err := guestexec.Dial(ctx, socket)
		if err != nil || before == "" {
			return dialed{c, err}
		}
		id, err := readBootID(ctx, c)
		if err == nil && id != before {
			return dialed{c, nil}
		}
		c.Close()
		select {
		case <-ctx.Done():
			return dialed{nil, fmt.Errorf("the guest answered from its boot before the reset (boot_id %s): %w", before, ctx.Err())}
		case <-time.After(time.Second):
		}
	}
}

// dialed is what a dial of the exec channel gave.
type dialed struct {
	c   *guestexec.Client
	err error
}
