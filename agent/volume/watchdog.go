package volume

import (
	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
)

// What became of a lost lease's I/O (leaseFencer.loss).
const (
	lossNone int32 = iota
	lossStopping
	lossStopped
	lossRunning
)

func lossOutcome(stopped bool) int32 {
	if stopped {
		return lossStopped
	}
	return lossRunning
}

// Leases lists, for the host watchdog, the on-disk leases whose volumes
// this agent has staged: each held one with the issue time of its last
// renewal, and each lost one with whether its I/O was stopped and drained
// (fenced) or not (then its stale renewal stops the feeding), and each
// one held before an agent restart that is not resumed yet: not looked at
// by the start-up check, or whose resume failed.
func (m *Manager) Leases() []watchdog.Lease {
	m.mu.Lock()
	fs := make(map[string]*leaseFencer, len(m.live))
	var out []watchdog.Lease
	for v := range m.unchecked {
		out = append(out, watchdog.Lease{Volume: v, Unresumed: true})
	}
	for v, l := range m.live {
		if f, ok := l.fencer.(*leaseFencer); ok {
			fs[v] = f
		} else if l.unresumed {
			out = append(out, watchdog.Lease{Volume: v, Unresumed: true})
		}
	}
	m.mu.Unlock()
	for v, f := range fs {
		// Health is read without the engine's lock, which an
		// acquisition or a lease I/O may hold for long.
		h := f.Health()
		held, renewed := h.Held, h.RenewedAt
		l := watchdog.Lease{Volume: v, Renewed: renewed, Fail: f.timing.Fail, IOTimeout: f.timing.IOTimeout}
		switch f.loss.Load() {
		case lossStopped:
			l.Fenced = true
		case lossNone:
			// A claim just lost is no longer held, and its loss handler
			// may not have started yet: it stays listed (stale) until
			// the handler says whether its I/O stopped. An engine that
			// never held has no renewal time.
			if !held && (!h.Lost || renewed.IsZero()) {
				continue
			}
		}
		out = append(out, l)
	}
	return out
}

// ExpectRecordedLeases lists every staged claim recorded as lease-fenced by
// an earlier agent process as not resumed yet, until the start-up check
// (Reconcile) has looked at it: called before the host watchdog runs, so
// that a restarted agent feeds its host only for leases it has seen
// renewed, however long the check of many volumes takes. A claim the check
// cannot locate is let go of the list once looked at (it is reported
// abnormal), so a node whose disk is gone is not reset over and over.
func (m *Manager) ExpectRecordedLeases() {
	claims, _ := m.store.List()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range claims {
		if c.Phase == PhaseStaged && c.State != StateLost && c.Method == MethodLease && m.live[c.Volume] == nil {
			m.unchecked[c.Volume] = true
		}
	}
}

// checked takes a claim off the unchecked list once the start-up check
// has looked at it.
func (m *Manager) checked(volume string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.unchecked, volume)
}
