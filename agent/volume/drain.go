package volume

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// When a lease holder loses its claim while it is alive, the taker waits
// for the holder's slot to say fenced before it uses the disk. That mark
// is only honest once nothing of this host can still reach the disk: the
// filesystem shut down is not enough, because writes it issued earlier
// may sit in the page cache of a device below it or in a queue on the
// way down (the data mapping is a buffered loop device, so even the
// disk's own page cache can hold them). drainData pushes each layer out,
// top first, while the disk is read-only: what was queued then either
// reaches the disk before the mark or fails, and nothing is left to land
// after it.

// drainTimeout bounds the wait for a layer's in-flight requests.
const drainTimeout = 10 * time.Second

// drainData makes the volume's device stack quiet after a loss: the device
// the pod or filesystem uses is set read-only (a raw block volume's
// writer is refused from now on), every layer's page cache is written out
// or failed, its in-flight requests are waited for, and the disk itself is
// flushed last. It reports the first layer that could not be shown quiet.
func drainData(sysfs string, c *Claim, disk *os.File) error {
	var layers []string
	if c.Mapper != "" {
		layers = append(layers, c.Mapper)
	}
	if c.PodDevice != "" {
		layers = append(layers, c.PodDevice)
	}
	if c.DataDevice != "" {
		layers = append(layers, c.DataDevice)
	}
	for i, p := range layers {
		f, err := os.Open(p)
		if err != nil {
			return fmt.Errorf("opening %s to drain it: %w", p, err)
		}
		if i == 0 {
			if err := setReadOnly(f, true); err != nil {
				f.Close()
				return err
			}
		}
		// fsync writes the layer's dirty pages down to the next layer (or
		// fails them against the read-only disk) and waits for them.
		err = syncWithin(f, drainTimeout)
		f.Close()
		if err != nil {
			return err
		}
		if err := waitInflight(sysfs, p, drainTimeout); err != nil {
			return err
		}
	}
	if err := syncWithin(disk, drainTimeout); err != nil {
		return err
	}
	return waitInflight(sysfs, disk.Name(), drainTimeout)
}

// syncWithin is fsync that gives up waiting after timeout (a disk that no
// longer answers keeps it forever). Its error, a write that failed, is no
// concern here: failing is what the read-only disk makes of a stale write.
func syncWithin(f *os.File, timeout time.Duration) error {
	done := make(chan struct{})
	go func() { _ = f.Sync(); close(done) }()
	select {
	case <-done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("flushing %s did not finish within %s", f.Name(), timeout)
	}
}

// waitInflight waits until the block device at p has no request in flight
// (sysfs inflight: reads and writes).
func waitInflight(sysfs, p string, timeout time.Duration) error {
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return fmt.Errorf("resolving %s: %w", p, err)
	}
	sys := filepath.Join(sysfs, "class", "block", filepath.Base(real), "inflight")
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(sys)
		if err != nil {
			return fmt.Errorf("reading %s: %w", sys, err)
		}
		f := strings.Fields(string(b))
		if len(f) == 2 && f[0] == "0" && f[1] == "0" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s still has requests in flight (%s) after %s", p, strings.TrimSpace(string(b)), timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
