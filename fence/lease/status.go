package lease

// Reading a lease area without holding it, for status and inspection.

import (
	"context"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Status is the lease state of a disk, for display.
type Status struct {
	Device   string     `json:"device"`
	OwnKey   fence.Key  `json:"own_key"`
	Owner    *Slot      `json:"owner,omitempty"`
	Slots    []SlotInfo `json:"slots"`
	VolumeID string     `json:"volume_id"`
}

// SlotInfo is one used slot.
type SlotInfo struct {
	Index int `json:"index"`
	Slot
	Corrupt bool `json:"corrupt,omitempty"`
}

// ReadStatus reads the lease area once.
func ReadStatus(ctx context.Context, d *Device, own fence.Key, timeout time.Duration) (Status, *Area, error) {
	b, err := d.ReadArea(ctx, timeout)
	if err != nil {
		return Status{}, nil, err
	}
	a, err := DecodeArea(b)
	if err != nil {
		return Status{}, nil, fmt.Errorf("%s: %w", d.name, err)
	}
	st := Status{Device: d.name, OwnKey: own, VolumeID: fmt.Sprintf("%x", a.Header.VolumeID)}
	if o := a.Owner(); o >= 0 {
		s := a.Slots[o]
		st.Owner = &s
	}
	for i, s := range a.Slots {
		if s.State != StateEmpty || a.Corrupt[i] {
			st.Slots = append(st.Slots, SlotInfo{Index: i, Slot: s, Corrupt: a.Corrupt[i]})
		}
	}
	return st, a, nil
}

// Inspect reads the lease area of path once, through its own O_DIRECT
// descriptor, and returns the owning slot: nil when nobody holds the
// lease, an error wrapping ErrNoLease when the disk has no lease area.
// It is the quick look a hot-plug refusal needs: one read, no waiting. An
// owner found here may have expired; refusing it is still right, since
// only a stage request (Acquire, which waits) may take the disk.
func Inspect(ctx context.Context, path string, timeout time.Duration) (*Slot, error) {
	d, err := OpenDeviceReadOnly(path)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	b, err := d.ReadArea(ctx, timeout)
	if err != nil {
		return nil, err
	}
	a, err := DecodeArea(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if o := a.Owner(); o >= 0 {
		s := a.Slots[o]
		return &s, nil
	}
	return nil, nil
}
