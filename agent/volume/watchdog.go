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
// one held before an agent restart that could not be resumed yet.
func (m *Manager) Leases() []watchdog.Lease {
	m.mu.Lock()
	fs := make(map[string]*leaseFencer, len(m.live))
	var out []watchdog.Lease
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
