package lab

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/unixsock"
)

// QMP is a client for QEMU's machine protocol on a unix socket. QMP is
// newline-delimited JSON with a greeting, a capabilities handshake, and
// asynchronous events between replies; the few commands the lab needs do
// not justify a dependency, and hot-unplug needs the DEVICE_DELETED event,
// which this client keeps for WaitEvent.
type QMP struct {
	conn net.Conn

	wmu    sync.Mutex
	mu     sync.Mutex
	nextID int
	wait   map[string]chan qmpReply
	events []QMPEvent
	evCond chan struct{} // closed and replaced when an event arrives
	err    error
}

// QMPEvent is one asynchronous event.
type QMPEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
	// At is when QEMU says it happened.
	At time.Time `json:"-"`
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

// DialQMP connects to a QEMU QMP socket and completes the handshake.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	conn, err := unixsock.DialRetry(ctx, path, 50*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("connecting to QMP socket %s: %w", path, err)
	}
	q := &QMP{conn: conn, wait: map[string]chan qmpReply{}, evCond: make(chan struct{})}
	r := bufio.NewReaderSize(conn, 1<<16)
	// The greeting comes first, before any reply.
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := r.ReadBytes('\n'); err != nil {
		conn.Close()
		return nil, fmt.Errorf("reading QMP greeting from %s: %w", path, err)
	}
	_ = conn.SetReadDeadline(time.Time{})
	go q.read(r)
	if _, err := q.Execute(ctx, "qmp_capabilities", nil); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

func (q *QMP) read(r *bufio.Reader) {
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			q.mu.Lock()
			q.err = fmt.Errorf("QMP connection closed: %w", err)
			for id, ch := range q.wait {
				close(ch)
				delete(q.wait, id)
			}
			close(q.evCond)
			q.evCond = make(chan struct{})
			q.mu.Unlock()
			return
		}
		var msg struct {
			ID    string `json:"id"`
			Event string `json:"event"`
			qmpReply
			Data      json.RawMessage `json:"data"`
			Timestamp struct {
				Seconds      int64 `json:"seconds"`
				Microseconds int64 `json:"microseconds"`
			} `json:"timestamp"`
		}
		if json.Unmarshal(line, &msg) != nil {
			continue
		}
		q.mu.Lock()
		if msg.Event != "" {
			at := time.Unix(msg.Timestamp.Seconds, msg.Timestamp.Microseconds*1000)
			q.events = append(q.events, QMPEvent{Event: msg.Event, Data: msg.Data, At: at})
			close(q.evCond)
			q.evCond = make(chan struct{})
		} else if ch := q.wait[msg.ID]; ch != nil {
			delete(q.wait, msg.ID)
			ch <- msg.qmpReply
		}
		q.mu.Unlock()
	}
}

// Execute runs a command and returns its "return" value, or an error that
// carries QEMU's error class and description.
func (q *QMP) Execute(ctx context.Context, cmd string, args any) (json.RawMessage, error) {
	ch := make(chan qmpReply, 1)
	q.mu.Lock()
	if q.err != nil {
		q.mu.Unlock()
		return nil, q.err
	}
	q.nextID++
	id := fmt.Sprintf("vco-%d", q.nextID)
	q.wait[id] = ch
	q.mu.Unlock()

	req := map[string]any{"execute": cmd, "id": id}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	q.wmu.Lock()
	_, err = q.conn.Write(append(b, '\n'))
	q.wmu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("QMP %s: %w", cmd, err)
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("QMP %s: connection closed before the reply", cmd)
		}
		if rep.Error != nil {
			return nil, fmt.Errorf("QMP %s: %s: %s", cmd, rep.Error.Class, rep.Error.Desc)
		}
		return rep.Return, nil
	case <-ctx.Done():
		q.mu.Lock()
		delete(q.wait, id)
		q.mu.Unlock()
		return nil, fmt.Errorf("QMP %s: %w", cmd, ctx.Err())
	}
}

// WaitEvent waits for an event named name for which match (if not nil)
// returns true, looking at events already received too, and consumes it.
func (q *QMP) WaitEvent(ctx context.Context, name string, match func(json.RawMessage) bool) (*QMPEvent, error) {
	for {
		q.mu.Lock()
		for i, ev := range q.events {
			if ev.Event == name && (match == nil || match(ev.Data)) {
				q.events = append(q.events[:i:i], q.events[i+1:]...)
				q.mu.Unlock()
				return &ev, nil
			}
		}
		if q.err != nil {
			err := q.err
			q.mu.Unlock()
			return nil, fmt.Errorf("waiting for QMP event %s: %w", name, err)
		}
		cond := q.evCond
		q.mu.Unlock()
		select {
		case <-cond:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for QMP event %s: %w", name, ctx.Err())
		}
	}
}

// DropEvents forgets the events named name received so far.
func (q *QMP) DropEvents(name string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	kept := q.events[:0]
	for _, ev := range q.events {
		if ev.Event != name {
			kept = append(kept, ev)
		}
	}
	q.events = kept
}

// Close drops the connection.
func (q *QMP) Close() error { return q.conn.Close() }
