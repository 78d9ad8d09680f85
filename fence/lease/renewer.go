package lease

// The renewal goroutine: renews at its interval until stopped.

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// chanLock is a mutex made of a channel. The engine holds its lock across
// lease I/O and the waits of an acquisition; a goroutine waiting for it is
// then blocked on a channel, which the schedule simulator's fake clock
// (testing/synctest, sim_test.go) can tell from a running one.
type chanLock chan struct{}

func (l chanLock) Lock()   { l <- struct{}{} }
func (l chanLock) Unlock() { <-l }

// renewer is the goroutine that renews a held lease.
type renewer struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

func (r *renewer) signal()      { r.once.Do(func() { close(r.stop) }) }
func (r *renewer) stopAndWait() { r.signal(); <-r.done }

// stopRenewer stops the renewer, if one runs, and waits for it to end;
// called without e.mu, which a renewal in progress holds.
func (e *Engine) stopRenewer() {
	e.mu.Lock()
	r := e.renewer
	e.renewer = nil
	e.mu.Unlock()
	if r != nil {
		r.stopAndWait()
	}
}

func (e *Engine) startRenewer() {
	r := &renewer{stop: make(chan struct{}), done: make(chan struct{})}
	e.renewer = r
	go e.renew(r)
}

// renew rewrites our slot every Renew and declares the claim lost when no
// renewal succeeded for Fail; the timer fires at that deadline even when
// renewals keep failing or hang.
func (e *Engine) renew(r *renewer) {
	defer close(r.done)
	t := time.NewTimer(e.cfg.Timing.Renew)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
		}
		e.mu.Lock()
		if e.renewer != r {
			e.mu.Unlock()
			return
		}
		next := e.cfg.Timing.Renew
		if !e.paused {
			ctx, cancel := context.WithTimeout(context.Background(), 2*e.cfg.Timing.IOTimeout)
			a, err := e.readOnce(ctx)
			if err == nil {
				err = e.renewLocked(ctx, a)
			} else {
				e.stats.RenewFailures++
				e.renewErr = err
				if l := e.deadline(); l != nil {
					err = l
				}
			}
			cancel()
			var lost *fence.LostError
			if errors.As(err, &lost) {
				e.mu.Unlock()
				return
			}
			if err != nil {
				e.log.Warn("lease renewal failed", "error", err, "deadline_in", (e.cfg.Timing.Fail - time.Since(e.lastOK)).String())
			}
			next = min(next, max(e.cfg.Timing.Fail-time.Since(e.lastOK), 0)+time.Millisecond)
		}
		e.mu.Unlock()
		t.Reset(next)
	}
}
