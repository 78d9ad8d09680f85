package lease

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// A node's host goes down holding the lease, past the fail bound. The
// controller grants the disk to node-b, which takes it over (the granted
// victim's held slot, below the taker's claim, is left as it is) and
// later lets it go again (its volume unstaged there, or its claim
// fenced). Our record, below node-b's released or fenced claim, is the
// highest held slot again, but another host claimed the lease after it:
// the volume moved. Retake leaves it as it is (docs/fencing.md: "a lease
// another host claimed ... keeps the loss").
func TestAdv22RetakeRefusesARecordAnotherHostClaimedAbove(t *testing.T) {
	ctx := context.Background()
	tm := Timing{IOTimeout: 100 * time.Millisecond, Renew: 200 * time.Millisecond, Fail: 800 * time.Millisecond}
	for _, end := range []string{"released", "fenced"} {
		t.Run(end, func(t *testing.T) {
			dev := formattedLoop(t, 4096)
			a := newNodeTiming(t, dev, uuidA, "node-a", tm)
			if _, err := a.e.Acquire(ctx, nil); err != nil {
				t.Fatal(err)
			}
			a.stopRenewing()
			b := newNodeTiming(t, dev, uuidB, "node-b", tm)
			if _, err := b.e.Acquire(ctx, &fence.Grant{Disk: "disk-1", Node: uuidB, Supersedes: []fence.Key{keyA}}); err != nil {
				t.Fatal(err)
			}
			switch end {
			case "released":
				if err := b.e.Release(ctx); err != nil {
					t.Fatal(err)
				}
			case "fenced":
				b.e.MarkLost("the test fences node-b's claim")
				select {
				case <-b.e.LossHandled():
				case <-time.After(5 * time.Second):
					t.Fatal("node-b's loss was not handled")
				}
			}
			st := status(t, dev)
			if st.Owner == nil || st.Owner.Key != keyA {
				t.Fatalf("the lease after node-b let go: owner %+v, want our old record (the premise)", st.Owner)
			}
			time.Sleep(tm.Fail)
			a2 := newNodeTiming(t, dev, uuidA, "node-a", tm)
			var lost *fence.LostError
			if err := a2.e.Resume(ctx); !errors.As(err, &lost) || lost.Holder != 0 {
				t.Fatalf("resuming: %v, want a loss with no holder", err)
			}
			before := status(t, dev)
			if c, err := a2.e.Retake(ctx); !errors.Is(err, ErrNotRetakable) {
				t.Fatalf("retaking a record another host claimed above: %+v %v, want ErrNotRetakable", c, err)
			}
			if after := status(t, dev); after.Owner == nil || after.Owner.Written != before.Owner.Written || after.Owner.Epoch != before.Owner.Epoch {
				t.Fatalf("a refused retake changed the lease: %+v, was %+v", after.Owner, before.Owner)
			}
		})
	}
}
