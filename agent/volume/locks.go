package volume

import (
	"sync"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// locks serializes operations per volume. A second operation on a volume
// is not queued: it fails at once with Aborted, as CSI expects, and the
// caller retries.
type locks struct {
	mu   sync.Mutex
	busy map[string]string
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
		delete(l.busy, volume)
		l.mu.Unlock()
	}, nil
}
