package events

import (
	"bytes"
	"errors"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestMessageIDsAreFixedUniqueAndWellFormed(t *testing.T) {
	seen := map[string]Type{}
	hex := regexp.MustCompile(`^[0-9a-f]{32}$`)
	for _, ty := range Types {
		id := ty.MessageID()
		if !hex.MatchString(id) {
			t.Errorf("%v: MESSAGE_ID %q is not 128 bits of hex", ty, id)
		}
		if other, dup := seen[id]; dup {
			t.Errorf("%v and %v share MESSAGE_ID %s", ty, other, id)
		}
		seen[id] = ty
		back, ok := ParseType(ty.String())
		if !ok || back != ty {
			t.Errorf("ParseType(%q) = %v, %v", ty.String(), back, ok)
		}
	}
	// The journal ids are a published interface: changing one breaks
	// operators' journalctl filters.
	if DiskRefused.MessageID() != "4aa8a0fc1a4a92cec915055d97daeec3" {
		t.Errorf("DiskRefused MESSAGE_ID changed to %s", DiskRefused.MessageID())
	}
}

func TestPublishStampsAndRingKeepsNewest(t *testing.T) {
	b := NewBus(3, 4, nil)
	for i := 0; i < 5; i++ {
		e := b.Publish(Event{Type: DiskClaimed, Volume: string(rune('a' + i))})
		if e.Seq != uint64(i+1) || e.Time.IsZero() {
			t.Fatalf("event %d stamped %d at %v", i, e.Seq, e.Time)
		}
	}
	r := b.Recent()
	if len(r) != 3 || r[0].Volume != "c" || r[1].Volume != "d" || r[2].Volume != "e" {
		t.Fatalf("ring = %+v, want c,d,e", r)
	}
	st := b.Stats()
	if st.Published != 5 || st.Recent != 3 || st.RingCapacity != 3 {
		t.Fatalf("stats %+v", st)
	}
}

func TestSlowSubscriberDropsWithoutBlocking(t *testing.T) {
	b := NewBus(16, 2, nil)
	slow := b.Subscribe(false)
	fast := b.Subscribe(false)
	var got []uint64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for e := range fast.C() {
			got = append(got, e.Seq)
		}
	}()
	done := make(chan struct{})
	go func() {
		for i := 0; i < 10; i++ {
			b.Publish(Event{Type: DiskFenced})
			time.Sleep(time.Millisecond) // let the fast reader keep up
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Publish blocked on a subscriber that never reads")
	}
	if slow.Dropped() != 8 {
		t.Fatalf("slow subscriber dropped %d, want 8 (10 events, buffer 2)", slow.Dropped())
	}
	if b.Stats().Dropped < 8 {
		t.Fatalf("bus dropped count %d", b.Stats().Dropped)
	}
	// The slow reader still gets the two that fit, in order.
	if e := <-slow.C(); e.Seq != 1 {
		t.Fatalf("slow first seq %d", e.Seq)
	}
	b.Close()
	wg.Wait()
	if len(got) < 2 || got[0] != 1 {
		t.Fatalf("fast reader got %v", got)
	}
	for i := 1; i < len(got); i++ {
		if got[i] <= got[i-1] {
			t.Fatalf("out of order: %v", got)
		}
	}
}

func TestReplayThenLiveWithoutGapOrDuplicate(t *testing.T) {
	b := NewBus(100, 100, nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
				b.Publish(Event{Type: DiskClaimed})
			}
		}
	}()
	time.Sleep(2 * time.Millisecond)
	s := b.Subscribe(true)
	var seqs []uint64
	for _, e := range s.Replay {
		seqs = append(seqs, e.Seq)
	}
	for len(seqs) < len(s.Replay)+20 {
		e, ok := <-s.C()
		if !ok {
			t.Fatal("closed early")
		}
		seqs = append(seqs, e.Seq)
	}
	close(stop)
	wg.Wait()
	if len(s.Replay) == 0 {
		t.Fatal("nothing replayed")
	}
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 && s.Dropped() == 0 {
			t.Fatalf("gap or duplicate at %d: %v -> %v", i, seqs[i-1], seqs[i])
		}
	}
	s.Close()
	if b.Stats().Subscribers != 0 {
		t.Fatal("closed subscription still registered")
	}
}

type recordSink struct {
	got []Event
	err error
}

func (r *recordSink) Name() string { return "record" }
func (r *recordSink) Emit(e Event) error {
	r.got = append(r.got, e)
	return r.err
}

func TestSinksSeeEveryEventAndFailuresAreLogged(t *testing.T) {
	var logbuf bytes.Buffer
	b := NewBus(4, 4, slog.New(slog.NewTextHandler(&logbuf, nil)))
	ok := &recordSink{}
	bad := &recordSink{err: errors.New("bus gone")}
	b.AddSink(ok)
	b.AddSink(bad)
	b.Publish(Event{Type: DiskRefused, Device: "/dev/sdb", HolderKey: 0x5643000000000001})
	b.Publish(Event{Type: DiskReleased})
	if len(ok.got) != 2 || len(bad.got) != 2 {
		t.Fatalf("sinks got %d and %d events", len(ok.got), len(bad.got))
	}
	if ok.got[0].HolderKeyString() != "5643000000000001" {
		t.Fatalf("holder key %q", ok.got[0].HolderKeyString())
	}
	if !strings.Contains(logbuf.String(), "bus gone") || !strings.Contains(logbuf.String(), "DiskRefused") {
		t.Fatalf("sink failure not logged: %s", logbuf.String())
	}
}

func TestSubscribeAfterCloseGetsClosedChannel(t *testing.T) {
	b := NewBus(1, 1, nil)
	b.Close()
	s := b.Subscribe(false)
	if _, ok := <-s.C(); ok {
		t.Fatal("channel open after bus close")
	}
	b.Publish(Event{Type: DiskClaimed})
	if b.Stats().Published != 0 {
		t.Fatal("published after close")
	}
}

func TestNextDeliveryReportsMissedEvents(t *testing.T) {
	b := NewBus(4, 2, nil)
	s := b.Subscribe(false)
	for i := 0; i < 7; i++ {
		b.Publish(Event{Type: DiskClaimed})
	}
	for _, want := range []uint64{1, 2} {
		if e := <-s.C(); e.Seq != want || e.MissedBefore != 0 {
			t.Fatalf("buffered event %+v", e)
		}
	}
	b.Publish(Event{Type: DiskReleased})
	e := <-s.C()
	if e.Seq != 8 || e.MissedBefore != 5 {
		t.Fatalf("got seq %d missed %d, want seq 8 after 5 missed", e.Seq, e.MissedBefore)
	}
	if r := b.Recent(); r[len(r)-1].MissedBefore != 0 {
		t.Fatal("a subscriber's miss count leaked into the ring")
	}
}
