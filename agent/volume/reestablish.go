package volume

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// reestablish gives a fencer whose check reported lost the chance to take
// the claim back, which it does only when the storage itself forgot the
// claim (an iSCSI target restarted and lost its reservations) and no
// other node has registered since (fence.Reestablisher; fence/pr says
// exactly when). It returns nil when the claim is held again; otherwise
// the loss to act on: the fencer's own refusal when it tried (it names a
// foreign key that appeared), else lost.
func (m *Manager) reestablish(ctx context.Context, c *Claim, dev *Device, r fence.Reestablisher, lost *fence.LostError) *fence.LostError {
	claim, err := r.Reestablish(ctx)
	var refused *fence.LostError
	switch {
	case err == nil:
		m.o.Metrics.reestablishes.WithLabelValues("ok").Inc()
		if c.Detail != "" {
			c.Detail = ""
			if err := m.store.Put(c); err != nil {
				m.log.Error("recording the re-established claim", "volume", c.Volume, "err", err)
			}
		}
		msg := fmt.Sprintf("volume %s: the storage target forgot every reservation on %s (it restarted or was reset) and no other node had registered since; the claim was re-established with %s key %s (%s)",
			c.Volume, dev.Path, c.Method, claim.Key, claim.Type)
		m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: c.Serial,
			HolderKey: uint64(claim.Key), Reason: "reservation-reestablished", Message: msg})
		m.log.Warn("claim re-established after the storage target forgot it", "volume", c.Volume, "device", dev.Path, "type", claim.Type.String())
		return nil
	case errors.As(err, &refused):
		if refused == lost {
			// The fencer did not try: the loss was not the storage
			// forgetting (a preemption, a write refused).
			return lost
		}
		m.o.Metrics.reestablishes.WithLabelValues("refused").Inc()
		return refused
	}
	m.o.Metrics.reestablishes.WithLabelValues("error").Inc()
	m.log.Error("re-establishing a claim the storage target forgot failed; fencing", "volume", c.Volume, "device", dev.Path, "err", err)
	l := *lost
	l.Reason = fmt.Sprintf("%s; re-establishing the claim failed: %v", lost.Reason, err)
	return &l
}
