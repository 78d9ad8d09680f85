package volume

import (
	"bytes"
	"context"
	"io"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// A disk that carries the lease area (fence/lease) keeps its volume's data
// past the area, whatever fences it now: reservations (the disk shows up
// on another bus, or the target gained PR), or nothing (the unfenced
// opt-in, or an agent without the lease). Staged at byte 0 its filesystem
// would not be found and the disk would look blank to mkfs; so every
// choice of fencing goes through leaseDataRule.

// leaseDataRule makes ch stage dev through the data offset of the lease
// area dev carries, if any. A lease header this agent cannot read (damaged,
// another version or geometry) refuses the disk: its data offset is not
// known, and byte 0 is the lease's.
func (m *Manager) leaseDataRule(ctx context.Context, dev *Device, volume string, ch *Choice) error {
	b, err := m.host.ReadHead(ctx, dev.Path, lease.BlockSize)
	if err != nil {
		return agenterr.New(agenterr.Unavailable, "volume %s: reading the start of %s for a lease area: %v", volume, dev.Path, err)
	}
	if !bytes.HasPrefix(b, []byte(blank.LeaseMagic)) {
		return nil
	}
	h, err := lease.DecodeHeader(b)
	if err != nil {
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: disk %s carries a lease area whose header this agent cannot use (%v); where its data begins is unknown, so it is neither formatted nor staged from byte 0: stage it with an agent that reads this lease area",
			volume, dev.Path, err)
	}
	off := int64(h.DataOffset)
	switch ch.DataOffset {
	case off:
	case 0:
		m.log.Info("the disk carries a lease area: its volume is staged past it although the disk is not fenced with the lease",
			"volume", volume, "device", dev.Path, "fence", ch.Method, "data_offset", off)
		ch.DataOffset = off
	default:
		return agenterr.New(agenterr.FailedPrecondition,
			"volume %s: fencing disk %s with %s puts the data at byte %d, but the disk's lease area says byte %d; it is refused rather than staged at either",
			volume, dev.Path, ch.Method, ch.DataOffset, off)
	}
	return nil
}

// closeChoice lets go of what a choice holds open (the lease's
// descriptor) when it is not used.
func closeChoice(ch Choice) {
	if cl, ok := ch.Fencer.(io.Closer); ok {
		cl.Close()
	}
}
