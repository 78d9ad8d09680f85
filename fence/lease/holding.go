package lease

import "time"

// Holding reports whether the engine holds its lease and when the last
// successful write of its slot was issued: the instant its fail bound
// counts from (monotonic clock). The agent's host watchdog is fed only
// while that instant is younger than the fail bound (docs/fencing.md).
func (e *Engine) Holding() (held bool, lastWrite time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.held, e.lastOK
}
