// Package server implements the agent's gRPC service (agent/api) on top of
// the daemon's parts: the node identity read at start, the event bus, and
// the peer-credential gate every call passes first. Later capabilities add
// their methods here, each a thin translation to the package that does the
// work; every error leaves through agenterr.Status.
package server

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/fencecaps"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
)

// NodeIdentity is what the agent learnt about the machine at start.
type NodeIdentity struct {
	SystemUUID, Manufacturer, ProductName, Serial, SMBIOSVersion, Source string
	NodeName, Location                                                   string
	// Fencing reports the fencing methods as the host is now; disks come
	// and go, so it is asked on every GetIdentity.
	Fencing func() []fencecaps.Capability
}

// Runtime reports the daemon's own state for GetStatus.
type Runtime struct {
	DBusConnected   bool
	DBusDetail      string
	SocketActivated bool
	SocketPath      string
	// Watchdog reports the host watchdog; nil when the agent runs none.
	Watchdog func() watchdog.Status
}

// Options configure a Server.
type Options struct {
	Version  string
	Identity NodeIdentity
	Bus      *events.Bus
	Started  time.Time
	Runtime  Runtime
	Log      *slog.Logger
	Policy   peercred.Policy
	// Volumes does the volume methods; nil makes them answer Unavailable.
	Volumes *volume.Manager
}

// Server is the Agent service.
type Server struct {
	api.UnimplementedAgentServer
	o Options
}

// New builds the service.
func New(o Options) *Server {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Started.IsZero() {
		o.Started = time.Now()
	}
	return &Server{o: o}
}

// NewGRPC returns a grpc.Server with the peer-credential gate and the
// service registered.
func (s *Server) NewGRPC(extra ...grpc.ServerOption) *grpc.Server {
	opts := append([]grpc.ServerOption{
		grpc.Creds(peercred.Transport{Policy: s.o.Policy}),
		grpc.UnaryInterceptor(s.unary),
		grpc.StreamInterceptor(s.stream),
	}, extra...)
	g := grpc.NewServer(opts...)
	api.RegisterAgentServer(g, s)
	return g
}

func (s *Server) admit(ctx context.Context, method string) error {
	ai, ok := peercred.FromContext(ctx)
	if !ok {
		s.o.Log.Warn("API call refused: caller credentials unknown", "method", method)
		return agenterr.New(agenterr.PermissionDenied, "the agent could not read the caller's credentials")
	}
	if !ai.Allowed {
		s.o.Log.Warn("API call refused", "method", method, "pid", ai.Creds.PID, "uid", ai.Creds.UID,
			"gid", ai.Creds.GID, "reason", ai.Refusal)
		return agenterr.New(agenterr.PermissionDenied, "permission denied: %s; the agent API is for root and the configured socket group", ai.Refusal)
	}
	return nil
}

func (s *Server) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
	if err := s.admit(ctx, info.FullMethod); err != nil {
		return nil, agenterr.Status(err)
	}
	defer s.answerPanic(info.FullMethod, req, &err)
	resp, err = h(ctx, req)
	return resp, agenterr.Status(err)
}

func (s *Server) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) (err error) {
	if err := s.admit(ss.Context(), info.FullMethod); err != nil {
		return agenterr.Status(err)
	}
	defer s.answerPanic(info.FullMethod, nil, &err)
	return agenterr.Status(h(srv, ss))
}

// GetIdentity implements api.AgentServer.
func (s *Server) GetIdentity(context.Context, *api.GetIdentityRequest) (*api.Identity, error) {
	id := s.o.Identity
	out := &api.Identity{
		SystemUuid: id.SystemUUID, Manufacturer: id.Manufacturer, ProductName: id.ProductName,
		Serial: id.Serial, SmbiosVersion: id.SMBIOSVersion, IdentitySource: id.Source,
		NodeName: id.NodeName, Location: id.Location, AgentVersion: s.o.Version,
	}
	var caps []fencecaps.Capability
	if id.Fencing != nil {
		caps = id.Fencing()
	}
	for _, c := range caps {
		out.Fencing = append(out.Fencing, &api.FencingCapability{
			Method: api.FencingOf(c.Method), Available: c.Available, Detail: c.Detail,
		})
	}
	return out, nil
}

// GetStatus implements api.AgentServer.
func (s *Server) GetStatus(context.Context, *api.GetStatusRequest) (*api.Status, error) {
	st := s.o.Bus.Stats()
	r := s.o.Runtime
	return &api.Status{
		AgentVersion: s.o.Version, StartedAt: timestamppb.New(s.o.Started),
		Uptime:   durationpb.New(time.Since(s.o.Started).Truncate(time.Millisecond)),
		NodeName: s.o.Identity.NodeName, EventsPublished: st.Published,
		EventsRecent: uint32(st.Recent), EventsRingCapacity: uint32(st.RingCapacity),
		Subscribers: uint32(st.Subscribers), EventsDropped: st.Dropped,
		DbusConnected: r.DBusConnected, DbusDetail: r.DBusDetail,
		SocketActivated: r.SocketActivated, SocketPath: r.SocketPath,
		HostWatchdog: watchdogProto(r.Watchdog),
	}, nil
}

func watchdogProto(f func() watchdog.Status) *api.HostWatchdog {
	if f == nil {
		return nil
	}
	w := f()
	p := &api.HostWatchdog{Unsafe: w.Unsafe, Armed: w.Armed, Device: w.Device, Identity: w.Identity, Nowayout: w.Nowayout,
		Leases: uint32(w.Leases), Withheld: w.Withheld, Error: w.Error}
	if w.Timeout > 0 {
		p.Timeout = durationpb.New(w.Timeout)
	}
	if !w.LastFeed.IsZero() {
		p.LastFeed = timestamppb.New(w.LastFeed)
	}
	return p
}

// WatchEvents implements api.AgentServer. The stream ends when the caller
// goes away or the agent stops.
func (s *Server) WatchEvents(req *api.WatchEventsRequest, stream grpc.ServerStreamingServer[api.Event]) error {
	sub := s.o.Bus.Subscribe(req.GetReplayRecent())
	defer sub.Close()
	for _, e := range sub.Replay {
		pe := EventToProto(e)
		pe.Replayed = true
		if err := stream.Send(pe); err != nil {
			return err
		}
	}
	ctx := stream.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-sub.C():
			if !ok {
				return nil
			}
			if err := stream.Send(EventToProto(e)); err != nil {
				return err
			}
		}
	}
}

// ListRecentEvents implements api.AgentServer.
func (s *Server) ListRecentEvents(context.Context, *api.ListRecentEventsRequest) (*api.ListRecentEventsResponse, error) {
	recent := s.o.Bus.Recent()
	out := &api.ListRecentEventsResponse{Events: make([]*api.Event, 0, len(recent))}
	for _, e := range recent {
		out.Events = append(out.Events, EventToProto(e))
	}
	return out, nil
}

// EventToProto converts a bus event to its API form.
func EventToProto(e events.Event) *api.Event {
	return &api.Event{
		Type: api.EventType(e.Type), Sequence: e.Seq, Time: timestamppb.New(e.Time),
		Volume: e.Volume, Device: e.Device, Serial: e.Serial, HolderKey: e.HolderKeyString(),
		HolderNode: e.HolderNode, Reason: e.Reason, Message: e.Message, MissedBefore: e.MissedBefore,
	}
}
