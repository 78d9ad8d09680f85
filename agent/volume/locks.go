package volume

import (
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// locks serializes operations per volume. A second operation on a volume
// is not queued: it fails at once with Aborted, as CSI expects, and the
// caller retries.
type locks struct {
	mu   sync.Mutex
	busy map[string]string
	// after are what runs, still under the volume's lock, when its
	// current operation releases it (whenFree).
	after map[string][]func()
}

func (l *locks) try(volume, op string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.busy == nil {
		l.busy = map[string]string{}
	}
	if cur, ok := l.busy[volume]; ok {
		return nil, agenterr.New(agenterr.Aborted, "volume %s: %s is in progress on this node; %s must wait and retry", volume, cur, op)
	}
	l.busy[volume] = op
	return func() {
		l.mu.Lock()
		fns := l.after[volume]
		delete(l.after, volume)
		l.mu.Unlock()
		for _, f := range fns {
			f()
		}
		l.mu.Lock()
		delete(l.busy, volume)
		l.mu.Unlock()
	}, nil
}

// tryAWhile is try for a short call that waits out a short holder (the
// periodic claim check, a stats call) for up to two seconds instead of
// failing at once.
func (l *locks) tryAWhile(volume, op string) (func(), error) {
	for i := 0; ; i++ {
		release, err := l.try(volume, op)
		if err == nil || i == 40 {
			return release, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// whenFree has fn run under the volume's lock when the operation that
// holds it now releases it, and reports whether one holds it (false: the
// volume is free, fn is not kept).
func (l *locks) whenFree(volume string, fn func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.busy[volume]; !ok {
		return false
	}
	if l.after == nil {
		l.after = map[string][]func(){}
	}
	l.after[volume] = append(l.after[volume], fn)
	return true
}
