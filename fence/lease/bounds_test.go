package lease

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// A live holder superseded by a grant, with the default timing and lease
// I/O of milliseconds, has let go and the taker holds the disk within
// Bounds().GrantLive, under 10 s, even when the taker's claim lands just
// after the holder's renewal (the holder sees it only at its next one).
func TestGrantedTakeoverOfALiveHolderWithinItsBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		const io = 5 * time.Millisecond
		tm := DefaultTiming()
		node := func(key fence.Key, node string) *Engine {
			e, err := New(&Device{name: node, f: &simDevice{disk: disk, script: func(bool) time.Duration { return io }},
				sem: make(chan struct{}, 1), size: 1 << 30},
				Config{Key: key, Node: node, Timing: tm, OnLost: func(*fence.LostError) bool { return true }})
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		holder, taker := node(0xa, uuidA), node(0xb, uuidB)
		if _, err := holder.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		// Just past the holder's first renewal.
		time.Sleep(tm.Renew + 50*time.Millisecond)
		if holder.Stats().Renewals != 1 {
			t.Fatalf("holder renewed %d times in its first interval", holder.Stats().Renewals)
		}
		start := time.Now()
		c, err := taker.Acquire(context.Background(), &fence.Grant{Node: uuidB, Supersedes: []fence.Key{0xa}})
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		b := tm.Bounds()
		if took > b.GrantLive+20*io || took >= 10*time.Second {
			t.Fatalf("granted takeover of a live holder took %s; bound max(2d, R) + d/2 = %s, and under 10s", took, b.GrantLive)
		}
		if len(c.Preempted) != 1 || c.Preempted[0] != 0xa || holder.Lost() == nil {
			t.Fatalf("claim %+v, holder's loss %v", c, holder.Lost())
		}
		taker.Release(context.Background())
	})
}

// Every bound is the formula docs/fencing.md states, and the defaults
// meet the targets: a dead holder taken over within 60 s, a live one with
// a grant within 10 s.
func TestDefaultBounds(t *testing.T) {
	tm := DefaultTiming()
	d, r, f, w := tm.IOTimeout, tm.Renew, tm.Fail, tm.Watchdog
	b := tm.Bounds()
	if b.DeadTakeover != max(f+w+d, r+6*d)+2*d || b.DeadTakeover != f+w+3*d || b.DeadTakeover > time.Minute {
		t.Errorf("dead-holder takeover %s: want max(F+W+d, R+6d) + 2d = F+W+3d within 60s", b.DeadTakeover)
	}
	if b.GrantLive != max(2*d, r)+d/2 || b.GrantLive >= 10*time.Second {
		t.Errorf("granted live takeover %s: want max(2d, R) + d/2 under 10s", b.GrantLive)
	}
	if b.Refusal != r+d || b.GrantLiveSlowIO != r+5*d+d/2 {
		t.Errorf("bounds %+v", b)
	}
	if err := tm.validate(); err != nil || d < MinIOTimeout {
		t.Errorf("default timing %s: %v", tm, err)
	}
}
