package events

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Sink receives every event, in order, on the publisher's goroutine. A sink
// must not block for long: the journal and D-Bus sinks only write a datagram
// or a message to a local socket.
type Sink interface {
	// Name is used in the log line when Emit fails.
	Name() string
	Emit(Event) error
}

// Bus fans events out. It is safe for concurrent use.
type Bus struct {
	log    *slog.Logger
	subBuf int

	mu     sync.Mutex
	seq    uint64
	ring   []Event // circular, len == capacity once full
	next   int     // where the next event goes in ring
	subs   map[*Subscription]struct{}
	sinks  []Sink
	closed bool

	dropped atomic.Uint64
}

// NewBus makes a bus that keeps ringSize recent events and gives each
// subscriber a buffer of subscriberBuffer events.
func NewBus(ringSize, subscriberBuffer int, log *slog.Logger) *Bus {
	if ringSize < 1 {
		ringSize = 1
	}
	if subscriberBuffer < 1 {
		subscriberBuffer = 1
	}
	return &Bus{
		log:    log,
		subBuf: subscriberBuffer,
		ring:   make([]Event, 0, ringSize),
		subs:   make(map[*Subscription]struct{}),
	}
}

// AddSink attaches a sink for all later events.
func (b *Bus) AddSink(s Sink) {
	b.mu.Lock()
	b.sinks = append(b.sinks, s)
	b.mu.Unlock()
}

// Publish stamps e with the next sequence number (and the time, if unset),
// records it in the ring, hands it to every sink and queues it for every
// subscriber. A subscriber whose buffer is full misses the event; that is
// counted, never waited for. Publish returns the stamped event.
func (b *Bus) Publish(e Event) Event {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return e
	}
	b.seq++
	e.Seq = b.seq
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	if len(b.ring) < cap(b.ring) {
		b.ring = append(b.ring, e)
	} else {
		b.ring[b.next] = e
	}
	b.next = (b.next + 1) % cap(b.ring)
	for s := range b.subs {
		se := e
		se.MissedBefore = s.pending
		select {
		case s.c <- se:
			s.pending = 0
		default:
			s.pending++
			s.dropped.Add(1)
			b.dropped.Add(1)
		}
	}
	sinks := b.sinks
	// Sinks run under the lock so that every sink sees events in sequence
	// order even with concurrent publishers.
	for _, k := range sinks {
		if err := k.Emit(e); err != nil && b.log != nil {
			b.log.Warn("event sink failed", "sink", k.Name(), "event", e.Type.String(), "seq", e.Seq, "err", err)
		}
	}
	b.mu.Unlock()
	return e
}

// Recent returns the events in the ring, oldest first.
func (b *Bus) Recent() []Event {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.recentLocked()
}

func (b *Bus) recentLocked() []Event {
	out := make([]Event, 0, len(b.ring))
	if len(b.ring) < cap(b.ring) {
		return append(out, b.ring...)
	}
	out = append(out, b.ring[b.next:]...)
	return append(out, b.ring[:b.next]...)
}

// Stats is a snapshot of the bus's counters.
type Stats struct {
	Published    uint64
	Recent       int
	RingCapacity int
	Subscribers  int
	Dropped      uint64
}

// Stats returns the current counters.
func (b *Bus) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Stats{
		Published:    b.seq,
		Recent:       len(b.ring),
		RingCapacity: cap(b.ring),
		Subscribers:  len(b.subs),
		Dropped:      b.dropped.Load(),
	}
}

// Subscription is one live reader of the bus.
type Subscription struct {
	bus *Bus
	c   chan Event
	// Replay holds the ring's events at the moment of subscribing when
	// replay was asked for; C then continues right after the last of them.
	Replay  []Event
	dropped atomic.Uint64
	pending uint64 // drops not yet reported on a delivered event; under bus.mu
}

// Subscribe registers a reader. With replay, the recent events are captured
// atomically with the registration, so nothing is missed or seen twice.
func (b *Bus) Subscribe(replay bool) *Subscription {
	s := &Subscription{bus: b, c: make(chan Event, b.subBuf)}
	b.mu.Lock()
	defer b.mu.Unlock()
	if replay {
		s.Replay = b.recentLocked()
	}
	if b.closed {
		close(s.c)
		return s
	}
	b.subs[s] = struct{}{}
	return s
}

// C delivers events. It is closed when the subscription or the bus closes.
func (s *Subscription) C() <-chan Event { return s.c }

// Dropped counts events this subscriber missed because its buffer was full.
func (s *Subscription) Dropped() uint64 { return s.dropped.Load() }

// Close unregisters the subscriber.
func (s *Subscription) Close() {
	s.bus.mu.Lock()
	defer s.bus.mu.Unlock()
	if _, ok := s.bus.subs[s]; ok {
		delete(s.bus.subs, s)
		close(s.c)
	}
}

// Close ends every subscription; later Publish calls are ignored.
func (b *Bus) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.closed = true
	for s := range b.subs {
		delete(b.subs, s)
		close(s.c)
	}
}
