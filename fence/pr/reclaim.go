package pr

import (
	"context"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

var _ fence.WaitingAcquirer = (*Engine)(nil)

// awaitHolder runs when a claim without a grant finds the target pristine
// (no registration since it started). A blank disk is new: st is returned
// as it is and the disk claimed. A disk holding data may be one whose
// target restarted and forgot its holder's claim: its holder gets w.Wait
// to re-establish it, the target read every w.Poll. It returns the state
// to decide on (a reservation that appeared is refused by the caller), a
// *fence.HeldError when at the end of the wait a foreign key is registered
// without a reservation (a holder half-way through re-establishing), or
// the context's error.
func (e *Engine) awaitHolder(ctx context.Context, st state, w fence.ReclaimWait) (state, error) {
	what := "contents not examined"
	if w.Contents != nil {
		c, err := w.Contents(ctx)
		switch {
		case err != nil:
			what = fmt.Sprintf("contents unknown: %v", err)
		case c == "":
			return st, nil
		default:
			what = c
		}
	}
	poll := w.Poll
	if poll <= 0 {
		poll = time.Second
	}
	e.log.Warn("the target shows no registration since it started, but the disk holds data: it may have restarted and forgotten a holder's claim; waiting for a holder to re-establish it",
		"contents", what, "wait", w.Wait.String())
	ended := func() error {
		return fmt.Errorf("%s: waiting %s for a holder to re-establish its claim, since the target shows no registration since it started but the disk holds data (%s): %w",
			e.name, w.Wait, what, ctx.Err())
	}
	deadline := time.Now().Add(w.Wait)
	for left := w.Wait; left > 0 && !st.res.Present; left = time.Until(deadline) {
		t := time.NewTimer(min(poll, left))
		select {
		case <-ctx.Done():
			t.Stop()
			return st, ended()
		case <-t.C:
		}
		var err error
		if st, err = e.read(ctx); err != nil {
			if ctx.Err() != nil {
				return st, ended()
			}
			return st, err
		}
	}
	if st.res.Present {
		e.log.Warn("a holder re-established its claim during the wait", "holder", st.holder().String(), "holder_node", e.resolve(st.holder()))
		return st, nil
	}
	if f := st.foreign(e.cfg.Key); len(f) > 0 {
		he := &fence.HeldError{Device: e.name, Holder: f[0], HolderNode: e.resolve(f[0]), Registered: f}
		e.log.Warn("disk refused: a key registered during the wait, without a reservation yet (a holder re-establishing its claim)", "holder", f[0].String(), "holder_node", he.HolderNode)
		return st, he
	}
	e.log.Info("no holder re-established a claim during the wait; claiming the disk", "waited", w.Wait.String())
	return st, nil
}
