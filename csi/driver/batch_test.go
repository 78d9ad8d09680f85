package driver

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

// recorder is a fetch that records every request (its asks, and whether
// the one before it had answered when it left) and answers only when its
// gate is opened.
type recorder struct {
	mu       sync.Mutex
	requests [][]int
	// overlapped[i]: request i left while an earlier one was out.
	overlapped []bool
	out        int
	gates      []chan struct{}
	ctxValues  []any
}

type ctxKey struct{}

func (r *recorder) fetch(ctx context.Context, _ string, asks []int) ([]int, error) {
	r.mu.Lock()
	gate := make(chan struct{})
	r.requests = append(r.requests, slices.Clone(asks))
	r.overlapped = append(r.overlapped, r.out > 0)
	r.gates = append(r.gates, gate)
	r.ctxValues = append(r.ctxValues, ctx.Value(ctxKey{}))
	r.out++
	r.mu.Unlock()
	<-gate
	r.mu.Lock()
	r.out--
	r.mu.Unlock()
	return asks, nil
}

// open answers request i once it has been made.
func (r *recorder) open(t *testing.T, i int) {
	t.Helper()
	waitFor(t, func() bool { r.mu.Lock(); defer r.mu.Unlock(); return len(r.gates) > i })
	r.mu.Lock()
	close(r.gates[i])
	r.mu.Unlock()
}

func (r *recorder) made() [][]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.requests)
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting")
		}
		time.Sleep(time.Millisecond)
	}
}

// manualWindows replaces the gathering timers: the test sends a batch
// when it chooses, and sees each window asked for.
type manualWindows struct {
	mu      sync.Mutex
	windows []time.Duration
	sends   []func()
}

func (m *manualWindows) after(d time.Duration, f func()) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.windows = append(m.windows, d)
	m.sends = append(m.sends, f)
}

func (m *manualWindows) pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.sends)
}

// fire sends the i-th gathering batch.
func (m *manualWindows) fire(t *testing.T, i int) {
	t.Helper()
	waitFor(t, func() bool { return m.pending() > i })
	m.mu.Lock()
	f := m.sends[i]
	m.mu.Unlock()
	go f()
}

func newTestShared() (*shared[int, []int], *recorder, *manualWindows) {
	r := &recorder{}
	m := &manualWindows{}
	s := newShared(r.fetch)
	s.after = m.after
	return s, r, m
}

// asked is how many asks the batch gathering for key holds.
func asked(s *shared[int, []int], key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b := s.next[key]; b != nil {
		return len(b.asks)
	}
	return 0
}

type answer struct {
	res []int
	err error
}

func ask(s *shared[int, []int], ctx context.Context, key string, n int) chan answer {
	ch := make(chan answer, 1)
	go func() {
		res, err := s.get(ctx, key, n)
		ch <- answer{res, err}
	}()
	return ch
}

func TestSharedLoneCallerSendsItsOwnAtOnce(t *testing.T) {
	s, r, m := newTestShared()
	ctx := context.WithValue(context.Background(), ctxKey{}, "caller")
	got := ask(s, ctx, "loc", 7)
	r.open(t, 0)
	a := <-got
	if a.err != nil || !slices.Equal(a.res, []int{7}) {
		t.Fatalf("got %v, %v; want its own answer", a.res, a.err)
	}
	if m.pending() != 0 {
		t.Errorf("a lone caller waited for a gathering window (%v)", m.windows)
	}
	if r.ctxValues[0] != "caller" {
		t.Errorf("the lone request was not made in the caller's context")
	}
}

// A caller who asks while a request is out is answered by a request sent
// after it asked, which leaves without waiting for the one out; the
// callers who asked together share it.
func TestSharedCallersNeverGetAnAnswerSentBeforeTheyAsked(t *testing.T) {
	s, r, m := newTestShared()
	first := ask(s, context.Background(), "loc", 1)
	waitFor(t, func() bool { return len(r.made()) == 1 })
	var later []chan answer
	for n := 2; n <= 20; n++ {
		later = append(later, ask(s, context.Background(), "loc", n))
	}
	waitFor(t, func() bool { return asked(s, "loc") == 19 })
	m.fire(t, 0)
	r.open(t, 1) // the second request answers while the first is still out
	for i, ch := range later {
		a := <-ch
		if a.err != nil || len(a.res) != 19 {
			t.Fatalf("caller %d: %v, %v; want the shared answer of the 19 who asked while the first was out", i+2, a.res, a.err)
		}
	}
	select {
	case a := <-first:
		t.Fatalf("the first caller was answered (%v) before its request was", a)
	default:
	}
	r.open(t, 0)
	if a := <-first; !slices.Equal(a.res, []int{1}) {
		t.Fatalf("first caller: %v", a.res)
	}
	reqs := r.made()
	if len(reqs) != 2 || !r.overlapped[1] {
		t.Fatalf("requests %v (second left while the first was out: %v); want two, overlapping", reqs, r.overlapped)
	}
}

// A batch sent takes no one in: who asks after it left joins the next.
func TestSharedBatchSentTakesNoOneIn(t *testing.T) {
	s, r, m := newTestShared()
	ask(s, context.Background(), "loc", 1)
	waitFor(t, func() bool { return len(r.made()) == 1 })
	second := ask(s, context.Background(), "loc", 2)
	waitFor(t, func() bool { return asked(s, "loc") == 1 })
	m.fire(t, 0)
	waitFor(t, func() bool { return len(r.made()) == 2 })
	third := ask(s, context.Background(), "loc", 3)
	waitFor(t, func() bool { return asked(s, "loc") == 1 })
	m.fire(t, 1)
	r.open(t, 2)
	if a := <-third; !slices.Equal(a.res, []int{3}) {
		t.Fatalf("third caller: %v; want a request of its own, sent after it asked", a.res)
	}
	r.open(t, 1)
	if a := <-second; !slices.Equal(a.res, []int{2}) {
		t.Fatalf("second caller: %v", a.res)
	}
	r.open(t, 0)
}

// Keys do not share.
func TestSharedKeysApart(t *testing.T) {
	s, r, m := newTestShared()
	a := ask(s, context.Background(), "loc-a", 1)
	b := ask(s, context.Background(), "loc-b", 2)
	waitFor(t, func() bool { return len(r.made()) == 2 })
	if m.pending() != 0 {
		t.Fatalf("a caller of another key gathered behind a request out (%d windows)", m.pending())
	}
	r.open(t, 0)
	r.open(t, 1)
	for _, ch := range []chan answer{a, b} {
		if x := <-ch; len(x.res) != 1 {
			t.Fatalf("answer %v mixes keys", x.res)
		}
	}
}

// A caller whose context ends stops waiting; the batch still answers the
// others, and the request is not cancelled with it.
func TestSharedCallerGivesUpAlone(t *testing.T) {
	s, r, m := newTestShared()
	ask(s, context.Background(), "loc", 1)
	waitFor(t, func() bool { return len(r.made()) == 1 })
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), ctxKey{}, "leaver"))
	leaver := ask(s, ctx, "loc", 2)
	waitFor(t, func() bool { return asked(s, "loc") == 1 })
	stayer := ask(s, context.Background(), "loc", 3)
	waitFor(t, func() bool { return asked(s, "loc") == 2 })
	cancel()
	if a := <-leaver; !errors.Is(a.err, context.Canceled) {
		t.Fatalf("the caller that gave up got %v, %v", a.res, a.err)
	}
	m.fire(t, 0)
	r.open(t, 1)
	if a := <-stayer; a.err != nil || len(a.res) != 2 {
		t.Fatalf("the caller that stayed got %v, %v", a.res, a.err)
	}
	if r.ctxValues[1] != "leaver" {
		t.Errorf("the batch does not carry its first caller's context values")
	}
	r.open(t, 0)
}

// The window is an eighth of the last request's time, within bounds, and
// follows the key's last request.
func TestSharedWindowFollowsTheAPI(t *testing.T) {
	for took, want := range map[time.Duration]time.Duration{
		0:                      minGather,
		4 * time.Millisecond:   minGather,
		80 * time.Millisecond:  10 * time.Millisecond,
		2 * time.Second:        maxGather,
		160 * time.Millisecond: 20 * time.Millisecond,
	} {
		if got := gatherWindow(took); got != want {
			t.Errorf("window after a %v request: %v, want %v", took, got, want)
		}
	}
	s, r, m := newTestShared()
	ask(s, context.Background(), "loc", 1)
	waitFor(t, func() bool { return len(r.made()) == 1 })
	time.Sleep(40 * time.Millisecond)
	r.open(t, 0)
	waitFor(t, func() bool { s.mu.Lock(); defer s.mu.Unlock(); return s.out["loc"] == 0 })
	ask(s, context.Background(), "loc", 2) // alone again: at once
	waitFor(t, func() bool { return len(r.made()) == 2 })
	ask(s, context.Background(), "loc", 3)
	waitFor(t, func() bool { return m.pending() == 1 })
	if w := m.windows[0]; w < 5*time.Millisecond || w > maxGather {
		t.Errorf("window %v after a request of at least 40 ms, want at least 5 ms", w)
	}
	m.fire(t, 0)
	r.open(t, 1)
	r.open(t, 2)
}

// However many batches are due, at most maxOut requests for a key are
// out: one more waits, still taking callers in, and leaves when one of
// them answers.
func TestSharedAtMostMaxOut(t *testing.T) {
	s, r, m := newTestShared()
	ask(s, context.Background(), "loc", 0)
	waitFor(t, func() bool { return len(r.made()) == 1 })
	for i := 1; i < maxOut; i++ {
		ask(s, context.Background(), "loc", i)
		m.fire(t, i-1)
		waitFor(t, func() bool { return len(r.made()) == i+1 })
	}
	waiting := ask(s, context.Background(), "loc", 100)
	m.fire(t, maxOut-1)
	waitFor(t, func() bool { s.mu.Lock(); defer s.mu.Unlock(); return s.next["loc"] != nil && s.next["loc"].due })
	late := ask(s, context.Background(), "loc", 101)
	waitFor(t, func() bool { return asked(s, "loc") == 2 })
	if n := len(r.made()); n != maxOut || m.pending() != maxOut {
		t.Fatalf("%d requests out, %d windows: want %d out and the due batch held", n, m.pending(), maxOut)
	}
	r.open(t, 3)
	waitFor(t, func() bool { return len(r.made()) == maxOut+1 })
	if got := r.made()[maxOut]; !slices.Equal(got, []int{100, 101}) {
		t.Fatalf("the held batch left with %v, want the callers who joined it while it waited", got)
	}
	r.open(t, maxOut)
	for _, ch := range []chan answer{waiting, late} {
		if a := <-ch; len(a.res) != 2 {
			t.Fatalf("answer %v", a.res)
		}
	}
	for i := range maxOut {
		if i != 3 {
			r.open(t, i)
		}
	}
	waitFor(t, func() bool { s.mu.Lock(); defer s.mu.Unlock(); return len(s.out) == 0 && len(s.next) == 0 })
}
