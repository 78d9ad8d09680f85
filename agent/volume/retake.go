package volume

// The lease of a staged volume taken back when its record is too old to
// resume and nothing of the volume is in use (the host rebooted, or the
// agent stopped, for longer than the lease's fail bound).

import (
	"context"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// retaker is a fencer that can acquire anew a claim of its own too old to
// resume (lease.Engine.Retake has the rule).
type retaker interface {
	Retake(ctx context.Context) (fence.Acquired, error)
}

// retakenUnused takes back the lease of a staged volume whose resume
// found it lost only because this node's record is too old to resume:
// the host was down (a reboot) or the agent stopped for longer than the
// fail bound, the record still owns the lease and no other host's slot is
// held. Nothing of the volume may be in use on this node (after a boot,
// which took every mount and mapping with it, that is the rule), which
// the release guard's proof shows before anything is written; the lease
// is then acquired anew as any stage would (the host watchdog armed
// first), so the kubelet's stage finds the volume held and repairs it,
// rather than the node refusing its own disk. A volume still in use keeps
// the loss: its I/O went on past the fail bound and is stopped as any
// lost claim's. It reports whether the claim is held again; when not,
// lost stands.
func (m *Manager) retakenUnused(ctx context.Context, c *Claim, dev *Device, ch Choice, lost *fence.LostError) bool {
	r, ok := ch.Fencer.(retaker)
	if !ok || c.State != StateHeld || c.Phase != PhaseStaged || lost.Holder != 0 {
		return false
	}
	log := m.log.With("volume", c.Volume, "device", dev.Path)
	if err := m.host.InUse(usageOf(c, dev.Path)); err != nil {
		log.Warn("the lease past its fail bound is not taken back: something of the volume is in use", "err", err)
		return false
	}
	if ch.Prepare != nil {
		if _, err := ch.Prepare(ctx); err != nil {
			log.Warn("the lease past its fail bound is not taken back: the host watchdog is not ready", "err", err)
			return false
		}
	}
	claim, err := r.Retake(ctx)
	if err != nil {
		log.Warn("the lease past its fail bound is not taken back", "err", err)
		return false
	}
	msg := fmt.Sprintf("volume %s: the host or its agent was down longer than the lease's fail bound (%s); this node's record still owned the lease on %s and no other host held it, and nothing of the volume was in use, so the lease was acquired anew with key %s",
		c.Volume, lost.Reason, dev.Path, claim.Key)
	m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: c.Serial,
		HolderKey: uint64(claim.Key), Reason: "lease-retaken", Message: msg})
	log.Warn("lease past its fail bound taken back", "reason", lost.Reason)
	return true
}
