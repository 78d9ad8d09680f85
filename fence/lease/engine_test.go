package lease

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"golang.org/x/sys/unix"
)

func heldBy(t *testing.T, err error, holder fence.Key, node string) {
	t.Helper()
	var he *fence.HeldError
	if !errors.As(err, &he) {
		t.Fatalf("want a refusal naming %s, got %v", holder, err)
	}
	if he.Holder != holder || he.HolderNode != node {
		t.Fatalf("refusal names %s (%q), want %s (%q): %v", he.Holder, he.HolderNode, holder, node, err)
	}
	if !strings.Contains(err.Error(), holder.String()) || !strings.Contains(err.Error(), node) {
		t.Fatalf("refusal text does not name the holder: %v", err)
	}
}

func lostTo(t *testing.T, err error, holder fence.Key) *fence.LostError {
	t.Helper()
	var le *fence.LostError
	if !errors.As(err, &le) {
		t.Fatalf("want a lost claim, got %v", err)
	}
	if le.Holder != holder {
		t.Fatalf("lost claim names holder %s, want %s: %v", le.Holder, holder, err)
	}
	return le
}

func TestProbeFormatAndRetry(t *testing.T) {
	ctx := context.Background()
	for _, sector := range []int{512, 4096} {
		dev := loopDevice(t, 8<<20, sector, nil)
		a := newNode(t, dev, uuidA, "node-a")
		sup, err := a.e.Probe(ctx)
		if err != nil || sup.Method != fence.MethodLease || !strings.Contains(sup.Reason, "blank") {
			t.Fatalf("sector %d: probe of a blank disk: %+v %v", sector, sup, err)
		}
		if _, err := a.e.Acquire(ctx, nil); !errors.Is(err, fence.ErrNotSupported) {
			t.Fatalf("sector %d: acquire before format: %v", sector, err)
		}
		for i, want := range []bool{true, false} {
			wrote, err := Format(ctx, a.e.Device(), FormatOptions{Key: keyA, Blkid: true})
			if err != nil || wrote != want {
				t.Fatalf("sector %d: format #%d: wrote %v, %v", sector, i+1, wrote, err)
			}
		}
		sup, err = a.e.Probe(ctx)
		if err != nil || sup.Method != fence.MethodLease || sup.Reason != "" {
			t.Fatalf("sector %d: probe after format: %+v %v", sector, sup, err)
		}
		if out, err := exec.Command("blkid", "-p", dev).CombinedOutput(); err == nil {
			t.Fatalf("blkid recognises the lease area as something: %s", out)
		}
		c, err := a.e.Acquire(ctx, nil)
		if err != nil || c.Method != fence.MethodLease || c.Key != keyA || c.Already {
			t.Fatalf("sector %d: acquire: %+v %v", sector, c, err)
		}
		if err := a.e.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// L1: a second node is refused while the first renews, and is told who
// holds the disk, within about one renewal interval (not the expiry bound).
func TestL1DoubleClaimRefused(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 4096)
	a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err := b.e.Acquire(ctx, nil)
	heldBy(t, err, keyA, "node-a")
	t.Logf("refused after %s (renewal interval %s, expiry bound %s)", time.Since(t0).Round(time.Millisecond), testTiming.Renew, testTiming.Expiry())
	st := status(t, dev)
	if st.Owner == nil || st.Owner.Key != keyA || len(st.Slots) != 1 {
		t.Fatalf("after the refusal the lease area shows %+v; want only node A's slot", st)
	}
	// A grant naming another key changes nothing.
	g := &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{0x7663000000000001}}
	_, err = b.e.Acquire(ctx, g)
	heldBy(t, err, keyA, "node-a")
	if !strings.Contains(err.Error(), "grant does not name") {
		t.Errorf("refusal with a non-matching grant does not say so: %v", err)
	}
	if err := a.e.Check(ctx); err != nil {
		t.Fatalf("holder's check after the refusals: %v", err)
	}
	if s := a.e.Stats(); s.Renewals == 0 {
		t.Fatalf("holder never renewed: %+v", s)
	}
	// A second acquire by the holder is a no-op.
	if c, err := a.e.Acquire(ctx, nil); err != nil || !c.Already {
		t.Fatalf("re-acquire by the holder: %+v %v", c, err)
	}
}

// L2: release, then the other node acquires without waiting for expiry.
func TestL2Handover(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 512)
	a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if err := a.e.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.e.Release(ctx); err != nil {
		t.Fatalf("second release: %v", err)
	}
	t0 := time.Now()
	c, err := b.e.Acquire(ctx, nil)
	if err != nil || len(c.Preempted) != 0 {
		t.Fatalf("acquire after release: %+v %v", c, err)
	}
	t.Logf("handover took %s (settle %s)", time.Since(t0).Round(time.Millisecond), testTiming.Settle())
	if err := b.e.Check(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.e.Check(ctx); err == nil {
		t.Fatal("released node's check succeeds")
	}
	_, err = a.e.Acquire(ctx, nil)
	heldBy(t, err, keyB, "node-b")
	// B hands back.
	if err := b.e.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatalf("acquire back: %v", err)
	}
}

// A release write that outlasts the I/O timeout (here: an earlier request
// still holds the device) is written again, so the next holder is handed
// the lease instead of waiting out the expiry bound.
func TestReleaseOutlastsASlowWrite(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 512)
	a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	// What Release does up to its write, with the renewer stopped so the
	// stalled device is met by the release write alone.
	a.stopRenewing()
	ar, err := a.e.read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	i := ar.Find(keyA)
	s := ar.Slots[i]
	s.State = StateReleased
	s.Counter++
	s.Written = time.Now().UnixNano()

	a.e.dev.sem <- struct{}{}
	stall := testTiming.IOTimeout * 3 / 2
	go func() { time.Sleep(stall); <-a.e.dev.sem }()
	t0 := time.Now()
	if err := a.e.writeReleased(ctx, i, EncodeSlot(s)); err != nil {
		t.Fatalf("release write past a %s stall: %v", stall, err)
	}
	if el := time.Since(t0); el < stall {
		t.Fatalf("release write returned after %s, before the stalled device was free", el)
	}
	if ar, err = a.e.read(ctx); err != nil {
		t.Fatal(err)
	}
	if ar.Slots[i].State != StateReleased {
		t.Fatalf("A's slot after the release write: %+v", ar.Slots[i])
	}
	c, err := b.e.Acquire(ctx, nil)
	if err != nil || len(c.Preempted) != 0 {
		t.Fatalf("acquire after the slow release: %+v %v", c, err)
	}
	if err := b.e.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A claim write that outlasts the I/O timeout may still land, after the
// racers' settle waits assumed it would have. The acquisition starts over;
// a claim that landed late is withdrawn, never resumed as ours, and the
// lease is claimed afresh with a new settle wait.
func TestTimedOutClaimWriteIsWithdrawnNotResumed(t *testing.T) {
	for _, lands := range []bool{false, true} {
		t.Run(map[bool]string{false: "lost", true: "landed-late"}[lands], func(t *testing.T) {
			ctx := context.Background()
			dev := formattedLoop(t, 512)
			var logs bytes.Buffer
			a := newNodeWith(t, dev, uuidA, "node-a", "", &logs)
			stall := testTiming.IOTimeout * 3 / 2
			var late []byte
			var once sync.Once
			testHookClaimWrite = func(e *Engine, idx int, blk []byte) {
				once.Do(func() {
					// An earlier request holds the device past the claim
					// write's timeout; with lands, the claim is written
					// while it is held, as a request stuck in the device
					// queue completes.
					e.dev.sem <- struct{}{}
					late = blk
					go func() {
						time.Sleep(stall)
						if lands {
							buf := alignedBuf(BlockSize)
							copy(buf, blk)
							if _, err := e.dev.f.WriteAt(buf, int64(BlockSize*(1+idx))); err != nil {
								t.Error(err)
							}
						}
						<-e.dev.sem
					}()
				})
			}
			t.Cleanup(func() { testHookClaimWrite = nil })
			c, err := a.e.Acquire(ctx, nil)
			if err != nil {
				t.Fatalf("acquire after a timed-out claim write: %v\n%s", err, logs.String())
			}
			unsettled := a.e.unconfirmed != nil
			ar, err := a.e.read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// Released before the log is read: the renewer logs too.
			if err := a.e.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if c.Already {
				t.Fatalf("the timed-out claim was resumed: %+v\n%s", c, logs.String())
			}
			if o := ar.Owner(); o < 0 || bytes.Equal(ar.Raw[o], late) || ar.Slots[o].Key != keyA {
				t.Fatalf("owner after the acquisition: %d %+v", o, ar.Slots)
			}
			if unsettled {
				t.Fatal("the timed-out claim is still unsettled after a successful acquisition")
			}
			if !strings.Contains(logs.String(), "lease claim write timed out; starting over") {
				t.Fatalf("no word of the timed-out claim write:\n%s", logs.String())
			}
			if got := strings.Contains(logs.String(), "withdrawing our lease claim that landed after the I/O timeout"); got != lands {
				t.Fatalf("withdrawal logged %v, want %v:\n%s", got, lands, logs.String())
			}
		})
	}
}

// L3: the holder freezes (stops renewing). Without a grant, the other
// node takes over after the expiry bound and clears the frozen node's
// slot; the frozen node, when it runs again, finds out, reports the loss
// naming the new holder, and never claims again.
func TestL3TakeoverAfterExpiry(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 4096)
	a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	a.pause(true)
	t0 := time.Now()
	c, err := b.e.Acquire(ctx, nil)
	el := time.Since(t0)
	if err != nil {
		t.Fatalf("takeover of an expired lease: %v", err)
	}
	if len(c.Preempted) != 1 || c.Preempted[0] != keyA {
		t.Fatalf("claim does not record the superseded key: %+v", c)
	}
	if el < testTiming.Expiry() {
		t.Fatalf("takeover after %s, before the expiry bound %s", el, testTiming.Expiry())
	}
	t.Logf("takeover after %s (expiry bound %s, settle %s)", el, testTiming.Expiry(), testTiming.Settle())
	lostTo(t, a.e.Check(ctx), keyB)
	a.pause(false)
	select {
	case l := <-a.lost:
		if l.Holder != keyB || l.HolderNode != "node-b" {
			t.Fatalf("OnLost: %v", l)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("OnLost was not called")
	}
	_, err = a.e.Acquire(ctx, nil)
	lostTo(t, err, keyB)
	// The taker cleared the slot it waited out; the frozen node never
	// writes it again (no fenced mark over a slot that is no longer its
	// own); B keeps the lease.
	time.Sleep(3 * testTiming.Renew)
	for _, s := range status(t, dev).Slots {
		if s.Key == keyA {
			t.Fatalf("the frozen node's slot, cleared by the taker, was written again: %+v", s)
		}
	}
	if err := b.e.Check(ctx); err != nil {
		t.Fatalf("new holder lost its claim: %v", err)
	}
	// Even after B releases, the lost engine does not re-claim.
	if err := b.e.Release(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = a.e.Acquire(ctx, nil)
	lostTo(t, err, keyB)
}

// L3 with a grant: a frozen holder is taken over after the expiry bound
// (a grant cannot make it stop), a live one lets go within a renewal.
func TestL3TakeoverWithGrant(t *testing.T) {
	ctx := context.Background()
	grant := &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{keyA}}

	t.Run("frozen holder", func(t *testing.T) {
		dev := formattedLoop(t, 4096)
		a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			t.Fatal(err)
		}
		a.pause(true)
		t0 := time.Now()
		c, err := b.e.Acquire(ctx, grant)
		if err != nil || len(c.Preempted) != 1 || c.Preempted[0] != keyA {
			t.Fatalf("granted takeover: %+v %v", c, err)
		}
		if el := time.Since(t0); el < testTiming.Expiry() {
			t.Fatalf("granted takeover of a frozen holder returned after %s, before its expiry bound %s", el, testTiming.Expiry())
		}
		lostTo(t, a.e.Check(ctx), keyB)
		a.pause(false)
		_, err = a.e.Acquire(ctx, nil)
		lostTo(t, err, keyB)
		if err := b.e.Check(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("live holder", func(t *testing.T) {
		dev := formattedLoop(t, 512)
		a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		c, err := b.e.Acquire(ctx, grant)
		el := time.Since(t0)
		if err != nil || len(c.Preempted) != 1 {
			t.Fatalf("granted takeover: %+v %v", c, err)
		}
		t.Logf("granted takeover of a live holder: %s (ends on its acknowledgement; expiry bound %s)", el.Round(time.Millisecond), testTiming.Expiry())
		select {
		case l := <-a.lost:
			if l.Holder != keyB {
				t.Fatalf("OnLost names %s", l.Holder)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the superseded holder did not notice")
		}
		waitSlotState(t, dev, keyA, StateFenced)
		lostTo(t, a.e.Check(ctx), keyB)
		if err := b.e.Check(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("grant for another node", func(t *testing.T) {
		dev := formattedLoop(t, 4096)
		b := newNode(t, dev, uuidB, "node-b")
		g := &fence.Grant{Disk: "disk-1", Node: uuidA, Supersedes: []fence.Key{keyA}}
		if _, err := b.e.Acquire(ctx, g); err == nil || !strings.Contains(err.Error(), "not this node") {
			t.Fatalf("grant for node A accepted on node B: %v", err)
		}
	})
}

// L4: two nodes acquire a free disk at the same moment, 20 rounds:
// exactly one wins each time, and the other is told who.
func TestL4Race(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 4096)
	wins := map[fence.Key]int{}
	contended := 0
	for round := range 20 {
		a, b := newNode(t, dev, uuidA, "node-a"), newNode(t, dev, uuidB, "node-b")
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make([]error, 2)
		for i, n := range []*node{a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, errs[i] = n.e.Acquire(ctx, nil)
			}()
		}
		close(start)
		wg.Wait()
		var winner, loser *node
		var loserErr error
		switch {
		case errs[0] == nil && errs[1] != nil:
			winner, loser, loserErr = a, b, errs[1]
		case errs[1] == nil && errs[0] != nil:
			winner, loser, loserErr = b, a, errs[0]
		default:
			t.Fatalf("round %d: want exactly one winner, got errors %v and %v", round, errs[0], errs[1])
		}
		wk := winner.e.cfg.Key
		heldBy(t, loserErr, wk, map[fence.Key]string{keyA: "node-a", keyB: "node-b"}[wk])
		wins[wk]++
		if err := winner.e.Check(ctx); err != nil {
			t.Fatalf("round %d: winner's check: %v", round, err)
		}
		if loser.e.Lost() != nil {
			t.Fatalf("round %d: a refused node must not be marked lost", round)
		}
		st := status(t, dev)
		if st.Owner == nil || st.Owner.Key != wk {
			t.Fatalf("round %d: owner on disk %+v, winner %s", round, st.Owner, wk)
		}
		for _, s := range st.Slots {
			if s.Key != wk && s.Live() {
				t.Fatalf("round %d: loser's slot still held: %+v", round, s)
			}
		}
		for _, s := range st.Slots {
			if s.Key == loser.e.cfg.Key && s.State == StateReleased {
				contended++
			}
		}
		if err := winner.e.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("wins: %v; rounds in which both nodes wrote a claim: %d", wins, contended)
}

// A renewal that keeps failing (the device turned read-only underneath)
// loses the claim at the fail bound.
func TestRenewalFailureSelfFences(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 4096)
	a := newNode(t, dev, uuidA, "node-a")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("blockdev", "--setro", dev).CombinedOutput(); err != nil {
		t.Fatalf("blockdev --setro: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("blockdev", "--setrw", dev).Run() })
	t0 := time.Now()
	select {
	case l := <-a.lost:
		el := time.Since(t0)
		if !strings.Contains(l.Reason, "no successful lease renewal") {
			t.Fatalf("loss reason: %v", l)
		}
		// A safety bound, not a speed figure: takers rely on the holder
		// giving up within Fail of its last successful renewal, which was
		// at most one renewal interval before the device turned read-only.
		if el > testTiming.Fail+testTiming.Renew+testTiming.IOTimeout {
			t.Errorf("self-fenced %s after renewals began failing; bound is %s", el, testTiming.Fail)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no self-fencing after renewals failed")
	}
	if s := a.e.Stats(); s.RenewFailures == 0 {
		t.Fatalf("no renewal failures counted: %+v", s)
	}
	var le *fence.LostError
	if err := a.e.Check(ctx); !errors.As(err, &le) {
		t.Fatalf("check after self-fencing: %v", err)
	}
}

// An agent restart on the holder resumes its own record; the other node
// is still refused.
func TestRestartResumesOwnRecord(t *testing.T) {
	ctx := context.Background()
	dev := formattedLoop(t, 4096)
	a := newNode(t, dev, uuidA, "node-a")
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	// The old agent dies without releasing.
	a.stopRenewing()
	a2 := newNode(t, dev, uuidA, "node-a")
	c, err := a2.e.Acquire(ctx, nil)
	if err != nil || !c.Already {
		t.Fatalf("restarted agent: %+v %v", c, err)
	}
	b := newNode(t, dev, uuidB, "node-b")
	_, err = b.e.Acquire(ctx, nil)
	heldBy(t, err, keyA, "node-a")
	if err := a2.e.Check(ctx); err != nil {
		t.Fatal(err)
	}
}

// An agent that stops hands its lease to the next process: one renewal
// as it stops, none after, the slot still held; the next process resumes
// a record younger than the renewal interval. A lease taken over while
// the agent ran is found lost by that last renewal, and an engine that
// holds nothing writes nothing.
func TestHandoffRenewsOnceThenStops(t *testing.T) {
	ctx := context.Background()
	tm := Timing{IOTimeout: 250 * time.Millisecond, Renew: time.Second, Fail: 4 * time.Second}
	dev := formattedLoop(t, 4096)
	a := newNodeTiming(t, dev, uuidA, "node-a", tm)
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	written := func() (int64, State) {
		st := status(t, dev)
		if st.Owner == nil || st.Owner.Key != keyA {
			t.Fatalf("node A does not own the lease: %+v", st)
		}
		return st.Owner.Written, st.Owner.State
	}
	time.Sleep(tm.Renew / 2)
	before, _ := written()
	t0 := time.Now()
	if err := a.e.Handoff(ctx); err != nil {
		t.Fatal(err)
	}
	at, state := written()
	if at <= before || at < t0.UnixNano() || state != StateHeld {
		t.Fatalf("after the hand-off the slot was written at %d (state %s); want a held record written after %d (the hand-off began at %d)", at, state, before, t0.UnixNano())
	}
	time.Sleep(tm.Renew + tm.Renew/2)
	if again, _ := written(); again != at {
		t.Fatalf("the slot was written again %s after the hand-off: the renewer kept running", time.Duration(again-at))
	}
	var log bytes.Buffer
	a2 := newNodeTiming(t, dev, uuidA, "node-a", tm)
	a2.e.log = slog.New(slog.NewTextHandler(&log, nil))
	if c, err := a2.e.Acquire(ctx, nil); err != nil || !c.Already {
		t.Fatalf("the next process does not resume the handed-off record: %+v %v\n%s", c, err, log.String())
	}
	if !strings.Contains(log.String(), "lease resumed from an earlier run") {
		t.Fatalf("the next process did not say it resumed the record:\n%s", log.String())
	}

	// A second host took the disk over (a granted takeover) while the
	// first one ran; the hand-off's renewal finds the loss.
	dev2 := formattedLoop(t, 4096)
	h := newNodeTiming(t, dev2, uuidA, "node-a", tm)
	if _, err := h.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	h.stopRenewing()
	b := newNodeTiming(t, dev2, uuidB, "node-b", tm)
	if _, err := b.e.Acquire(ctx, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	lostTo(t, h.e.Handoff(ctx), keyB)

	// An engine that holds nothing hands nothing off.
	dev3 := formattedLoop(t, 4096)
	idle := newNodeTiming(t, dev3, uuidA, "node-a", tm)
	if err := idle.e.Handoff(ctx); err != nil {
		t.Fatal(err)
	}
	if st := status(t, dev3); len(st.Slots) != 0 {
		t.Fatalf("a hand-off by an engine that holds nothing wrote %+v", st.Slots)
	}
}

func waitSlotState(t *testing.T, dev string, k fence.Key, want State) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := status(t, dev)
		for _, s := range st.Slots {
			if s.Key == k && s.State == want {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("slot of %s never reached state %s: %+v", k, want, st.Slots)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The fenced mark is the acknowledgement a granted taker waits for: it is
// written only when OnLost reports the host's I/O stopped, and it gets
// past the read-only flag that stopped it, which stays set.
func TestFencedMarkFollowsStoppedIO(t *testing.T) {
	ctx := context.Background()
	t.Run("stopped, disk set read-only", func(t *testing.T) {
		dev := formattedLoop(t, 512)
		a := newNode(t, dev, uuidA, "node-a")
		ro := openDev(t, dev)
		a.stop = func() bool {
			if err := unix.IoctlSetPointerInt(int(ro.Fd()), unix.BLKROSET, 1); err != nil {
				t.Error(err)
				return false
			}
			return true
		}
		t.Cleanup(func() { _ = unix.IoctlSetPointerInt(int(ro.Fd()), unix.BLKROSET, 0) })
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			t.Fatal(err)
		}
		a.e.MarkLost("test: the claim is lost")
		<-a.lost
		waitSlotState(t, dev, keyA, StateFenced)
		if v, err := unix.IoctlGetInt(int(ro.Fd()), unix.BLKROGET); err != nil || v != 1 {
			t.Fatalf("the disk is no longer read-only after the fenced mark: BLKROGET %d %v", v, err)
		}
	})
	t.Run("not shown stopped", func(t *testing.T) {
		dev := formattedLoop(t, 512)
		a := newNode(t, dev, uuidA, "node-a")
		done := make(chan struct{})
		a.stop = func() bool { defer close(done); return false }
		if _, err := a.e.Acquire(ctx, nil); err != nil {
			t.Fatal(err)
		}
		a.e.MarkLost("test: the claim is lost")
		<-a.lost
		<-done
		time.Sleep(testTiming.IOTimeout) // room for a mark that must not come
		for _, s := range status(t, dev).Slots {
			if s.Key == keyA && s.State != StateHeld {
				t.Fatalf("slot of a holder whose I/O was not shown stopped is %s, want still held", s.State)
			}
		}
	})
}

// A clone of a disk in use (or a volume restored from a snapshot of one)
// starts with the source's held slots. Told the disk was given to no node
// before, AcquireFirst sets such copies aside: at once when the slot names
// another disk's serial, after one renewal interval without a change when
// it names none; a slot that changes is a live holder and is refused.
func TestAcquireFirstSetsCopiedSlotsAside(t *testing.T) {
	ctx := context.Background()
	src := formattedLoop(t, 512)
	a := newNodeWith(t, src, uuidA, "node-a", "disk-src", nil)
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	// The copies are taken while A holds the source and renews.
	clone := func() string {
		return loopDevice(t, 8<<20, 512, func(img string) {
			b, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(img, b, 0o644); err != nil {
				t.Fatal(err)
			}
		})
	}
	heldBy := func(dev string, k fence.Key) bool {
		for _, s := range status(t, dev).Slots {
			if s.Key == k && s.State == StateHeld {
				return true
			}
		}
		return false
	}

	t.Run("copy naming another disk", func(t *testing.T) { copiedSlotsCopyNamingAnotherDisk(t, ctx, clone, heldBy) })
	t.Run("copy naming no disk", func(t *testing.T) { copiedSlotsCopyNamingNoDisk(t, ctx, clone, heldBy) })
	t.Run("live holder", func(t *testing.T) { copiedSlotsLiveHolder(t, ctx, src, heldBy) })
}

func copiedSlotsCopyNamingAnotherDisk(t *testing.T, ctx context.Context, clone func() string, heldBy func(string, fence.Key) bool) {
	dev := clone()
	if !heldBy(dev, keyA) {
		t.Fatal("the clone does not carry the source's held slot")
	}
	var log bytes.Buffer
	b := newNodeWith(t, dev, uuidB, "node-b", "disk-clone", &log)
	c, err := b.e.AcquireFirst(ctx)
	if err != nil || len(c.Preempted) != 0 {
		t.Fatalf("first claim of the clone: %+v %v", c, err)
	}
	b.stopRenewing() // its warnings would write the log read below
	if strings.Contains(log.String(), "watching them") || strings.Contains(log.String(), "waiting for the lease to expire") {
		t.Fatalf("a slot naming another disk's serial was waited for:\n%s", log.String())
	}
	if heldBy(dev, keyA) || status(t, dev).Owner.Key != keyB {
		t.Fatalf("after the first claim: %+v", status(t, dev))
	}
}

func copiedSlotsCopyNamingNoDisk(t *testing.T, ctx context.Context, clone func() string, heldBy func(string, fence.Key) bool) {
	dev := clone()
	var log bytes.Buffer
	b := newNodeWith(t, dev, uuidB, "node-b", "", &log)
	if _, err := b.e.AcquireFirst(ctx); err != nil {
		t.Fatal(err)
	}
	b.stopRenewing() // its warnings would write the log read below
	if !strings.Contains(log.String(), "watching them for a renewal") || strings.Contains(log.String(), "waiting for the lease to expire") {
		t.Fatalf("a slot of unknown disk was not watched for one renewal interval, or was waited out:\n%s", log.String())
	}
	if heldBy(dev, keyA) || status(t, dev).Owner.Key != keyB {
		t.Fatalf("after the first claim: %+v", status(t, dev))
	}
}

func copiedSlotsLiveHolder(t *testing.T, ctx context.Context, src string, heldBy func(string, fence.Key) bool) {
	// The controller's word is wrong: A renews on this very disk.
	b := newNodeWith(t, src, uuidB, "node-b", "disk-src", nil)
	_, err := b.e.AcquireFirst(ctx)
	var held *fence.HeldError
	if !errors.As(err, &held) || held.Holder != keyA {
		t.Fatalf("first claim of a disk a live node renews: %v, want refused naming %s", err, keyA)
	}
	if !heldBy(src, keyA) || status(t, src).Owner.Key != keyA {
		t.Fatalf("the live holder's slot was touched: %+v", status(t, src))
	}
}

// newNodeWith is newNode with the disk's serial and, when log is set, the
// engine's log.
func newNodeWith(t *testing.T, dev, uuid, name, serial string, log *bytes.Buffer) *node {
	t.Helper()
	n := newNode(t, dev, uuid, name)
	n.e.cfg.Serial = serial
	if log != nil {
		n.e.log = slog.New(slog.NewTextHandler(log, nil))
	}
	return n
}

// After a reboot longer than the fail bound the holder's record is too
// old to resume; Retake acquires it anew when every held slot is ours,
// and leaves a lease with another host's held slot as it is.
func TestRetakeAcquiresOwnStaleRecordAnew(t *testing.T) {
	ctx := context.Background()
	tm := Timing{IOTimeout: 100 * time.Millisecond, Renew: 200 * time.Millisecond, Fail: 800 * time.Millisecond}
	dev := formattedLoop(t, 4096)
	a := newNodeTiming(t, dev, uuidA, "node-a", tm)
	if _, err := a.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	a.stopRenewing()
	time.Sleep(tm.Fail + tm.Renew)
	a2 := newNodeTiming(t, dev, uuidA, "node-a", tm)
	var lost *fence.LostError
	if err := a2.e.Resume(ctx); !errors.As(err, &lost) || !strings.Contains(lost.Reason, "beyond the fail bound") {
		t.Fatalf("resuming a record older than the fail bound: %v, want a loss past the fail bound", err)
	}
	before := status(t, dev).Owner.Written
	c, err := a2.e.Retake(ctx)
	if err != nil || c.Already {
		t.Fatalf("retaking our own stale record: %+v %v, want a new claim", c, err)
	}
	if st := status(t, dev); st.Owner == nil || st.Owner.Key != keyA || st.Owner.Written <= before {
		t.Fatalf("after the retake: %+v, want our key owning a record written after %d", st.Owner, before)
	}
	if err := a2.e.Check(ctx); err != nil {
		t.Fatalf("the retaken lease's check: %v", err)
	}
	b := newNodeTiming(t, dev, uuidB, "node-b", tm)
	_, err = b.e.Acquire(ctx, nil)
	heldBy(t, err, keyA, "node-a")

	// Another host's slot is held (a takeover in progress, a holder
	// our record superseded): not retaken, nothing written.
	dev2 := formattedLoop(t, 4096)
	h := newNodeTiming(t, dev2, uuidA, "node-a", tm)
	if _, err := h.e.Acquire(ctx, nil); err != nil {
		t.Fatal(err)
	}
	h.stopRenewing()
	o := newNodeTiming(t, dev2, uuidB, "node-b", tm)
	if _, err := o.e.Acquire(ctx, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{keyA}}); err != nil {
		t.Fatal(err)
	}
	o.stopRenewing()
	raw := status(t, dev2)
	h2 := newNodeTiming(t, dev2, uuidA, "node-a", tm)
	if _, err := h2.e.Retake(ctx); !errors.Is(err, ErrNotRetakable) {
		t.Fatalf("retaking a lease another host owns: %v, want ErrNotRetakable", err)
	}
	if st := status(t, dev2); st.Owner == nil || st.Owner.Key != keyB || st.Owner.Written != raw.Owner.Written {
		t.Fatalf("a refused retake changed the lease: %+v, was %+v", st.Owner, raw.Owner)
	}
}
