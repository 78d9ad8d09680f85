package driver

import "sync"

// inflight holds one lock per volume (or name) for the duration of an
// operation. A second operation on the same key does not wait: it answers
// ABORTED at once, and the caller (the CSI sidecar) retries later. Waiting
// would let retries pile up behind a slow cloud call.
type inflight struct {
	mu   sync.Mutex
	keys map[string]struct{}
}

func newInflight() *inflight { return &inflight{keys: map[string]struct{}{}} }

// try takes key, or returns an ErrBusy failure naming it.
func (l *inflight) try(key string) (release func(), err error) { return l.tryAs(key, key) }

// tryAs takes key, or returns an ErrBusy failure naming what, for a key
// that does not name the volume the call is about.
func (l *inflight) tryAs(key, what string) (release func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, busy := l.keys[key]; busy {
		return nil, failf(ErrBusy, "an operation on %s is already in progress; retry later", what)
	}
	l.keys[key] = struct{}{}
	return func() {
		l.mu.Lock()
		delete(l.keys, key)
		l.mu.Unlock()
	}, nil
}
