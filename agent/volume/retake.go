package volume

// The lease of a staged volume taken back when its record is too old to
// resume and nothing of the volume is in use (the host rebooted, or the
// agent stopped, for longer than the lease's fail bound).

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// retaker is a fencer that can acquire anew a claim of its own too old to
// resume (lease.Engine.Retake has the rule).
type retaker interface {
	Retake(ctx context.Context) (fence.Acquired, error)
}

// retakeOutcome is what retakenUnused did.
type retakeOutcome int

const (
	// retakeNone: the loss stands (not a record of ours too old alone,
	// something of the volume in use, or the lease not ours alone).
	retakeNone retakeOutcome = iota
	// retakeDone: the claim is held again.
	retakeDone
	// retakeLater: a step failed on its way (the proof could not be
	// made, the host watchdog not ready, the lease's I/O), which says
	// nothing of the lease: the claim is left for the periodic check to
	// take back, as a fence that could not be resumed is.
	retakeLater
)

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
// lost claim's; so does a lease Retake leaves as it is or another host
// won. A failure that decides nothing (retakeLater) leaves the claim to
// the next check.
func (m *Manager) retakenUnused(ctx context.Context, c *Claim, dev *Device, ch Choice, lost *fence.LostError) retakeOutcome {
	r, ok := ch.Fencer.(retaker)
	if !ok || c.State != StateHeld || c.Phase != PhaseStaged || lost.Holder != 0 {
		return retakeNone
	}
	log := m.log.With("volume", c.Volume, "device", dev.Path)
	if err := m.host.InUse(usageOf(c, dev.Path)); err != nil {
		if inUse(err) {
			log.Warn("the lease past its fail bound is not taken back: something of the volume is in use", "err", err)
			return retakeNone
		}
		log.Warn("the lease past its fail bound is not taken back yet: the proof that nothing of the volume is in use could not be made; the periodic check tries again", "err", err)
		return retakeLater
	}
	if ch.Prepare != nil {
		if _, err := ch.Prepare(ctx); err != nil {
			log.Warn("the lease past its fail bound is not taken back yet: the host watchdog is not ready; the periodic check tries again", "err", err)
			return retakeLater
		}
	}
	claim, err := r.Retake(ctx)
	switch {
	case errors.Is(err, lease.ErrNotRetakable), errors.As(err, new(*fence.HeldError)), errors.As(err, new(*fence.LostError)):
		log.Warn("the lease past its fail bound is not taken back", "err", err)
		return retakeNone
	case err != nil:
		log.Warn("the lease past its fail bound is not taken back yet; the periodic check tries again", "err", err)
		return retakeLater
	}
	msg := fmt.Sprintf("volume %s: the host or its agent was down longer than the lease's fail bound (%s); this node's record still owned the lease on %s and no other host held it, and nothing of the volume was in use, so the lease was acquired anew with key %s",
		c.Volume, lost.Reason, dev.Path, claim.Key)
	m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: c.Serial,
		HolderKey: uint64(claim.Key), Reason: "lease-retaken", Message: msg})
	log.Warn("lease past its fail bound taken back", "reason", lost.Reason)
	return retakeDone
}
