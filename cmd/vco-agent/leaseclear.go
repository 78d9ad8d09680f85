package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// clear is `vco-agent lease clear DEVICE --yes`: it takes the disk's
// fence state off it for good, for uninstalling (docs/uninstall.md). It
// refuses a disk this node uses (mounted, mapped, or staged in the
// agent's claim records), then acquires the lease as any stage would, so
// that a live holder on another node refuses it and a dead one is waited
// out, releases it, and zeroes the lease area (the first MiB: header and
// host slots). A disk a refusal left read-only is made writable for it,
// as for lease acquire. The volume's data past the lease area is not touched; it
// still starts at byte 1048576 (docs/recovery.md).
func (o *leaseOptions) clear(ctx context.Context, dev *lease.Device, path string) int {
	if !o.yes {
		return o.fail(fmt.Errorf("%s: clearing removes the lease area for good (the volume's data stays, at byte %d); add --yes to do it", dev.Name(), lease.DataOffset))
	}
	if err := o.notInUse(path); err != nil {
		return o.fail(err)
	}
	if _, _, err := lease.ReadStatus(ctx, dev, o.key, o.timing.IOTimeout*4); err != nil {
		return o.fail(fmt.Errorf("%s: no lease area to clear: %w", dev.Name(), err))
	}
	// The command writes nothing but the lease while it holds it: a loss
	// has no other I/O to stop.
	e, err := lease.New(dev, o.engineConfig(func(*fence.LostError) bool { return true }))
	if err != nil {
		return o.fail(err)
	}
	timeout := o.timeout
	if timeout <= 0 {
		timeout = max(o.timing.Expiry(), lease.DefaultTiming().Expiry()) + o.timing.Settle() + time.Minute
	}
	restore, err := o.writableForLease(dev, path)
	if err != nil {
		return o.fail(fmt.Errorf("%s: not cleared: %w", dev.Name(), err))
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	_, err = e.Acquire(actx, o.grantParsed)
	cancel()
	if err != nil {
		restore()
		return o.fail(fmt.Errorf("%s: not cleared: %w", dev.Name(), err))
	}
	if err := e.Release(ctx); err != nil {
		return o.fail(fmt.Errorf("%s: not cleared, releasing the lease it took failed: %w", dev.Name(), err))
	}
	if err := zeroLeaseArea(path); err != nil {
		return o.fail(fmt.Errorf("%s: the lease was released but the area could not be zeroed: %w; run lease clear again", dev.Name(), err))
	}
	if _, _, err := lease.ReadStatus(ctx, dev, o.key, o.timing.IOTimeout*4); err == nil {
		return o.fail(fmt.Errorf("%s: a lease area is still there after clearing: another node may have formatted it meanwhile", dev.Name()))
	}
	return o.ok(fmt.Sprintf("%s: lease released and lease area cleared; the volume's data, if any, starts at byte %d", dev.Name(), lease.DataOffset),
		map[string]any{"cleared": true, "data_offset": lease.DataOffset})
}

// zeroLeaseArea writes zeros over the first lease.AreaSize bytes with
// O_DIRECT|O_DSYNC, as the lease's own I/O is done, so that no page
// cache stands between the write and the disk.
func zeroLeaseArea(path string) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// An anonymous mapping is page-aligned, as O_DIRECT wants, and zero.
	buf, err := unix.Mmap(-1, 0, lease.AreaSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	n, err := unix.Pwrite(fd, buf, 0)
	if err != nil {
		return err
	}
	if n != len(buf) {
		return fmt.Errorf("short write: %d of %d bytes", n, len(buf))
	}
	return nil
}

// notInUse refuses a disk this node uses: mounted, mapped by the lease's
// data mapping or another stacked device, or recorded as staged by the
// agent. Clearing such a disk's fence would leave a live volume unfenced.
func (o *leaseOptions) notInUse(path string) error {
	if err := inuse.Disk(o.sysfsRoot, path); err != nil {
		var ie *inuse.Error
		if errors.As(err, &ie) {
			return fmt.Errorf("%w; unstage the volume (drain the node) first", err)
		}
		return fmt.Errorf("proving that nothing of this node uses %s: %w; nothing was changed", path, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return err
	}
	return o.noClaimRecord(path, fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
}

// noClaimRecord refuses a disk that a claim record of this node's agent
// names (by device node or number): the agent stages it, or will take it
// back at its start. A record that cannot be read or decoded could be
// the disk's, and is refused too, by name.
func (o *leaseOptions) noClaimRecord(path, devnum string) error {
	claims, err := filepath.Glob(filepath.Join(o.stateDir, "volumes", "*.json"))
	if err != nil {
		return err
	}
	for _, f := range claims {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue // removed since the listing
		}
		var c struct {
			Volume string `json:"volume"`
			Device string `json:"device"`
			DevNum string `json:"devnum"`
		}
		if err == nil {
			err = json.Unmarshal(b, &c)
		}
		if err != nil {
			return fmt.Errorf("the claim record %s cannot be read (%v), and it may be %s's; move it away once you know which volume it was, then try again", f, err, path)
		}
		if c.DevNum == devnum || c.Device == path {
			return fmt.Errorf("%s is staged as volume %s (claim record %s); unstage it (drain the node) first", path, c.Volume, f)
		}
	}
	return nil
}
