package lease

import (
	"context"
	"crypto/rand"
	"fmt"
	"time"
)

// FormatAdopted writes a lease header on a disk whose data the agent has
// just moved to DataOffset (package agent/adopt: a volume of the driver
// this one replaces, whose filesystem started at byte 0). It is the one
// header written on a disk that is not blank, and only over a lease area
// that reads as zeros: the adoption zeroed it after the move, and nothing
// else writes there.
func FormatAdopted(ctx context.Context, d *Device, o FormatOptions) error {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTiming().IOTimeout
	}
	area, err := d.read(ctx, 0, AreaSize, o.Timeout)
	if err != nil {
		return err
	}
	if !allZero(area) {
		return fmt.Errorf("%s: the first %d bytes are not zero; a lease area is written only over zeros", d.name, AreaSize)
	}
	h := Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset,
		Created: time.Now().Unix(), Creator: o.Key}
	if _, err := rand.Read(h.VolumeID[:]); err != nil {
		return err
	}
	return d.write(ctx, 0, EncodeHeader(h), o.Timeout)
}
