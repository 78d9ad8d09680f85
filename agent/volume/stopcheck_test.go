package volume

import (
	"context"
	"fmt"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// TestTheAgentsStopDuringACheckMarksNoClaimMissing: SIGTERM ends the
// check's context while it runs. A SCSI disk's identity read then fails
// (it honours the context), which says nothing of the disk: the claim is
// not recorded missing, the claims not reached yet are not checked, and a
// claim recorded missing whose disk the next start finds is recorded
// back at once, not only when the first periodic check finds it.
func TestTheAgentsStopDuringACheckMarksNoClaimMissing(t *testing.T) {
	e, _ := newFencedEnv(t)
	ctx := context.Background()
	var reqs []StageRequest
	for i := range 3 {
		img, _ := loop(t, 64)
		r := e.stageReq(fmt.Sprintf("vol-%d", i), img, fmt.Sprintf("s%d", i))
		r.AllowUnfenced = false
		if _, err := e.m.Stage(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	checks := func() float64 {
		return metric(t, e.m, "vco_agent_claim_checks_total", "result", "ok") +
			metric(t, e.m, "vco_agent_claim_checks_total", "result", "missing") +
			metric(t, e.m, "vco_agent_claim_checks_total", "result", "error")
	}

	// The stop arrives while the first claim's identity is read.
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	for _, r := range reqs {
		l := e.m.getLive(r.Volume)
		verify := l.dev.Verify
		l.dev.Verify = func(c context.Context) error {
			stop()
			if c.Err() != nil {
				return fmt.Errorf("%w: reading the serial: %v", discovery.ErrIdentity, c.Err())
			}
			return verify(c)
		}
	}
	before := checks()
	e.m.CheckAll(sctx)
	if n := checks() - before; n != 0 {
		t.Errorf("a check cut short by the stop counted %v claim checks, want 0", n)
	}
	for _, r := range reqs {
		if c, _ := e.m.Store().Get(r.Volume); c == nil || c.Missing || c.State != StateHeld {
			t.Errorf("claim of %s after a check cut short by the stop: %+v", r.Volume, c)
		}
	}
	if got := metric(t, e.m, "vco_agent_claims", "state", "held"); got != 3 {
		t.Errorf("held claims after a check cut short by the stop: %v, want 3", got)
	}

	// A record left missing by an earlier process, whose disk is there.
	c, _ := e.m.Store().Get("vol-1")
	c.Missing, c.Detail = true, "the agent could not find its disk again: test"
	if err := e.m.Store().Put(c); err != nil {
		t.Fatal(err)
	}
	e.start()
	e.m.Reconcile(ctx)
	if c, _ := e.m.Store().Get("vol-1"); c == nil || c.Missing || c.Detail != "" {
		t.Errorf("claim found at start still recorded missing: %+v", c)
	}
	if got := metric(t, e.m, "vco_agent_claims", "state", "held"); got != 3 {
		t.Errorf("held claims after the start: %v, want 3", got)
	}
}
