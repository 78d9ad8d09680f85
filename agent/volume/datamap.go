package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// A fencing method that keeps metadata at the start of the disk (the
// on-disk lease) reports where the volume's data begins; everything the
// agent puts on the volume (LUKS2, filesystem, raw block) then lives on a
// loop device over the disk from that offset, so nothing ever writes the
// metadata area. Loop devices are present on every Linux host, unlike
// device-mapper. A raw block volume's pod is given the pod device over the
// data mapping, never the data mapping itself (poddev.go).

// dataMapping returns the loop device over disk at offset, attaching one
// when there is none. A mapping found from before may have been set
// read-only when an earlier claim was lost (drainData); a writable stage
// clears that.
func (m *Manager) dataMapping(disk string, offset int64, readOnlyStage bool) (string, error) {
	// The mapping reads through the disk's page cache, which may still
	// hold what the disk held before another node wrote it (an earlier
	// claim of ours, a probe of the blank disk): drop it first.
	blank.DropBuffers(disk)
	p, ok := m.findDataMapping(disk, offset)
	if !ok {
		var err error
		if p, err = loopdev.Attach(disk, offset, false); err != nil {
			return "", fmt.Errorf("mapping the data area of %s from byte %d: %w", disk, offset, err)
		}
	}
	// The read-only flag of a loop device outlives its detach, so a free
	// one may come with it set by its last user.
	if !readOnlyStage {
		if err := clearReadOnly(p); err != nil {
			return "", fmt.Errorf("data mapping %s of %s: %w", p, disk, err)
		}
	}
	blank.DropBuffers(p)
	return p, nil
}

// findDataMapping looks for a loop device over disk at offset in sysfs.
func (m *Manager) findDataMapping(disk string, offset int64) (string, bool) {
	root := sysfsRoot(m.finder)
	ents, err := os.ReadDir(filepath.Join(root, "block"))
	if err != nil {
		return "", false
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		dir := filepath.Join(root, "block", e.Name(), "loop")
		b, err1 := os.ReadFile(filepath.Join(dir, "backing_file"))
		o, err2 := os.ReadFile(filepath.Join(dir, "offset"))
		if err1 != nil || err2 != nil || strings.TrimSpace(string(b)) != disk || strings.TrimSpace(string(o)) != strconv.FormatInt(offset, 10) {
			continue
		}
		return filepath.Join(devRoot(m.finder), e.Name()), true
	}
	return "", false
}

// dropDataMapping detaches the loop device of a claim's data area.
func dropDataMapping(p string) error {
	if p == "" {
		return nil
	}
	if _, err := os.Stat(p); err != nil || !loopBound(p) {
		// Gone, or detached already (an unstage retried after a later
		// step failed): a detached loop device keeps its node.
		return nil
	}
	// Not left behind for the loop device's next user (drainData set it
	// when the claim was lost).
	_ = clearReadOnly(p)
	if err := loopdev.Detach(p); err != nil {
		return fmt.Errorf("the data mapping: %w", err)
	}
	return nil
}

// loopBound reports whether the loop device at p is attached to a
// backing file; anything else (not a loop device, not readable) counts as
// bound, so that the caller goes on and reports what it finds.
func loopBound(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return true
	}
	defer f.Close()
	_, err = unix.IoctlLoopGetStatus64(int(f.Fd()))
	return !errors.Is(err, unix.ENXIO)
}

// growDataMapping makes the loop device see a grown disk.
func growDataMapping(p string) error {
	if err := loopdev.Resize(p); err != nil {
		return fmt.Errorf("growing the data mapping: %w", err)
	}
	return nil
}

// clearReadOnly clears the block layer's read-only flag of the device at p.
func clearReadOnly(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if ro, err := readOnly(f); err != nil || !ro {
		return err
	}
	return setReadOnly(f, false)
}
