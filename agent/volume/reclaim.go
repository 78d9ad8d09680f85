package volume

import (
	"context"
	"errors"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// acquire claims the disk for a stage. A fencer whose storage can forget
// claims (fence.WaitingAcquirer: SCSI-3 PR on a target that keeps
// reservations in memory) gets the reclaim wait: a disk holding data that
// looks never claimed since its target started is claimed only after the
// holders' re-establish window (volumes.reclaim_wait) passed without a
// holder coming back. The wait holds only this volume's lock and ends
// with ctx; a retry soon after waits only for what is left, so a caller
// whose deadline is shorter than the wait still gets the disk in the end.
//
// neverPublished skips the wait: the controller says it had given the disk
// to no node before this stage's, so there is no holder to wait for. It
// changes nothing else; a disk that shows a registration or a reservation
// is refused as ever. On a fencer that keeps its claims on the disk
// (fence.FirstClaimer, the lease) it sets aside the claims copied from the
// source of a clone or a restore, unless one shows a live holder.
func (m *Manager) acquire(ctx context.Context, f fence.Fencer, volume string, dev *Device, grant *fence.Grant, neverPublished bool) (fence.Acquired, error) {
	if fc, ok := f.(fence.FirstClaimer); ok && neverPublished && grant == nil {
		// A clone or restore of a disk that was in use carries its
		// source's lease slots; they are no holders of this disk.
		return fc.AcquireFirst(ctx)
	}
	wa, ok := f.(fence.WaitingAcquirer)
	if !ok {
		return f.Acquire(ctx, grant)
	}
	if neverPublished {
		m.mu.Lock()
		delete(m.reclaims, volume)
		m.mu.Unlock()
		m.log.Info("the controller published this disk to no node before: claiming it without the reclaim wait",
			"volume", volume, "device", dev.Path)
		return f.Acquire(ctx, grant)
	}
	return m.acquireWaiting(ctx, wa, volume, dev, grant)
}

// acquireWaiting claims the disk with the reclaim wait, going on from
// where an earlier stage's wait of the volume stopped, and counts the
// waits by their outcome.
func (m *Manager) acquireWaiting(ctx context.Context, wa fence.WaitingAcquirer, volume string, dev *Device, grant *fence.Grant) (fence.Acquired, error) {
	full := m.o.Config.ReclaimAfter()
	wait := full
	m.mu.Lock()
	started, ok := m.reclaims[volume]
	if ok && time.Since(started) < 2*full {
		// The target has shown no registration since then: the holders
		// have had that long already.
		wait = max(full-time.Since(started), time.Millisecond)
	} else {
		started = time.Time{}
	}
	m.mu.Unlock()
	waited := false
	contents := func(ctx context.Context) (string, error) {
		what, err := m.contents(ctx, dev.Path)
		waited = err != nil || what != ""
		if waited && started.IsZero() {
			m.mu.Lock()
			m.reclaims[volume] = time.Now()
			m.mu.Unlock()
		}
		return what, err
	}
	claim, err := wa.AcquireWaiting(ctx, grant, fence.ReclaimWait{Wait: wait, Contents: contents})
	res := ""
	switch {
	case !waited:
	case errors.As(err, new(*fence.HeldError)):
		res = "refused"
	case err != nil && ctx.Err() != nil:
		// The start is kept: the retry goes on from there.
		m.o.Metrics.reclaimWaits.WithLabelValues("ended").Inc()
		return claim, err
	case err != nil:
		res = "error"
	default:
		res = "claimed"
	}
	m.mu.Lock()
	delete(m.reclaims, volume)
	m.mu.Unlock()
	if res != "" {
		m.o.Metrics.reclaimWaits.WithLabelValues(res).Inc()
	}
	return claim, err
}

// contents says what the disk at path holds, "" when it is blank, by the
// proof every format passes (package internal/safety/blank): no signature, no
// lease or LUKS header, zeros at the start, at the lease data offset and
// at the end. The reads bypass the page cache, which may still hold what
// this node read before another node wrote the disk.
func (m *Manager) contents(ctx context.Context, path string) (string, error) {
	_, err := blank.Prove(ctx, path)
	var nb *blank.NotBlankError
	if errors.As(err, &nb) {
		return nb.Found, nil
	}
	return "", err
}
