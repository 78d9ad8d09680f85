package server

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
)

func admitted() context.Context {
	return peer.NewContext(context.Background(), &peer.Peer{AuthInfo: peercred.AuthInfo{Allowed: true}})
}

// A read-only call that panics is answered INTERNAL naming its volume, and
// the server keeps serving; a call that changes the node lets its panic
// through, so that the process restarts and its start-up check takes back
// what the call left.
func TestAPanicOfAReadOnlyCallIsAnsweredOthersCrash(t *testing.T) {
	s := New(Options{Log: slog.New(slog.DiscardHandler)})
	boom := func(context.Context, any) (any, error) { panic("index out of range [-1]") }
	_, err := s.unary(admitted(), &api.GetVolumeStatsRequest{VolumeId: "pvc-7"},
		&grpc.UnaryServerInfo{FullMethod: api.Agent_GetVolumeStats_FullMethodName}, boom)
	if st, _ := status.FromError(err); st.Code() != codes.Internal || !strings.Contains(st.Message(), "pvc-7") || strings.Contains(st.Message(), "index out of range") {
		t.Fatalf("a panicking GetVolumeStats answered %v; want INTERNAL naming the volume, without the panic's text", err)
	}
	ok := func(context.Context, any) (any, error) { return &api.Status{}, nil }
	if _, err := s.unary(admitted(), &api.GetStatusRequest{}, &grpc.UnaryServerInfo{FullMethod: api.Agent_GetStatus_FullMethodName}, ok); err != nil {
		t.Fatalf("the next call after the answered panic: %v", err)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a panicking StageVolume was answered; it must take the process down")
		}
	}()
	_, _ = s.unary(admitted(), &api.StageVolumeRequest{VolumeId: "pvc-7"},
		&grpc.UnaryServerInfo{FullMethod: api.Agent_StageVolume_FullMethodName}, boom)
}
