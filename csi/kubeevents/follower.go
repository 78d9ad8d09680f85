package kubeevents

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/events"
)

// Agent is the part of vco-agent's API the Follower uses; api.AgentClient
// has it.
type Agent interface {
	GetStatus(ctx context.Context, in *api.GetStatusRequest, opts ...grpc.CallOption) (*api.Status, error)
	WatchEvents(ctx context.Context, in *api.WatchEventsRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[api.Event], error)
}

// Recorder takes the reports; *Poster is one.
type Recorder interface{ Record(Report) }

// Follower follows the agent's event stream and hands the events an
// operator must see in Kubernetes to a Recorder, each exactly once while
// this process runs: the stream is opened again whenever it ends (the
// agent restarts on upgrade) with the agent's recent events replayed, and
// those this process has already handed on are skipped by their sequence
// number within the agent process, which GetStatus's start time names.
type Follower struct {
	Agent Agent
	To    Recorder
	Log   *slog.Logger
	// Missed, when set, is told how many agent events were gone from
	// the agent's ring (or from this reader's buffer there) before they
	// could be read.
	Missed func(n uint64)
	// Retry is the first wait before following again after the stream
	// failed, doubled up to MaxRetry (defaults 1 s and 30 s).
	Retry, MaxRetry time.Duration

	started time.Time // the agent process followed
	seq     uint64    // the last of its events read
}

// ToReport converts an agent event into what is posted, and says whether it
// is posted at all: refusals, fence losses and takeovers as Warnings, a
// claim the agent re-established after the storage target forgot it as
// Normal; the routine claims and releases of every stage and unstage are
// not (they would bury the rest).
func ToReport(started time.Time, e *api.Event) (Report, bool) {
	r := Report{AgentStarted: started, Seq: e.GetSequence(), Reason: events.Type(e.GetType()).String(),
		Volume: e.GetVolume(), Device: e.GetDevice(), HolderKey: e.GetHolderKey(), HolderNode: e.GetHolderNode(),
		Serial: e.GetSerial(), Message: e.GetMessage()}
	if e.GetTime() != nil {
		r.Time = e.GetTime().AsTime()
	}
	switch e.GetType() {
	case api.EventType_EVENT_TYPE_DISK_REFUSED, api.EventType_EVENT_TYPE_DISK_FENCED, api.EventType_EVENT_TYPE_TAKEOVER_GRANTED:
		r.Type = corev1.EventTypeWarning
	case api.EventType_EVENT_TYPE_DISK_CLAIMED:
		if why := e.GetReason(); why != "reservation-reestablished" && why != "lease-retaken" {
			return r, false
		}
		r.Type = corev1.EventTypeNormal
	default:
		return r, false
	}
	if r.Message == "" {
		r.Message = r.Reason
	}
	return r, true
}

// errRestarted: the agent restarted while the stream was being opened.
var errRestarted = errors.New("vco-agent restarted while its event stream was opened")

// Run follows the agent until ctx ends. It never returns early: an agent
// that is down is waited for.
func (f *Follower) Run(ctx context.Context) {
	if f.Log == nil {
		f.Log = slog.New(slog.DiscardHandler)
	}
	if f.Missed == nil {
		f.Missed = func(uint64) {}
	}
	if f.Retry <= 0 {
		f.Retry = time.Second
	}
	if f.MaxRetry < f.Retry {
		f.MaxRetry = max(30*time.Second, f.Retry)
	}
	wait, logged := f.Retry, false
	for {
		opened, err := f.follow(ctx)
		if ctx.Err() != nil {
			return
		}
		if opened || errors.Is(err, errRestarted) {
			wait, logged = f.Retry, false
		}
		if !logged && !errors.Is(err, errRestarted) {
			// Once per outage: an agent that is down for long would
			// otherwise fill the log.
			logged = true
			f.Log.Info("vco-agent's event stream ended; following it again when the agent answers", "err", err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, f.MaxRetry)
	}
}

// follow reads one stream until it ends; opened says whether the stream
// was opened (the agent answered).
func (f *Follower) follow(ctx context.Context) (opened bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	before, err := f.Agent.GetStatus(ctx, &api.GetStatusRequest{})
	if err != nil {
		return false, err
	}
	stream, err := f.Agent.WatchEvents(ctx, &api.WatchEventsRequest{ReplayRecent: true})
	if err != nil {
		return false, err
	}
	// The stream belongs to the process that answered on both sides of
	// its opening: processes serving the socket follow one another.
	after, err := f.Agent.GetStatus(ctx, &api.GetStatusRequest{})
	if err != nil {
		return false, err
	}
	started := before.GetStartedAt().AsTime()
	if !after.GetStartedAt().AsTime().Equal(started) {
		return false, errRestarted
	}
	opened = true
	if !started.Equal(f.started) {
		f.Log.Info("following vco-agent's events", "agent_started", started, "agent_version", before.GetAgentVersion())
		f.started, f.seq = started, 0
	}
	for {
		e, err := stream.Recv()
		if err != nil {
			return opened, err
		}
		if e.GetSequence() <= f.seq {
			continue // read before this stream: the replay repeats it
		}
		if f.seq > 0 && e.GetSequence() > f.seq+1 {
			missed := e.GetSequence() - f.seq - 1
			f.Log.Warn("vco-agent events were missed (the agent's ring moved on, or this reader fell behind); the journal has them",
				"missed", missed, "agent_started", started, "after_sequence", f.seq)
			f.Missed(missed)
		}
		f.seq = e.GetSequence()
		if r, ok := ToReport(started, e); ok {
			f.To.Record(r)
		}
	}
}
