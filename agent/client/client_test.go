package client

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestAskAgain(t *testing.T) {
	busy := status.Error(codes.Aborted, "volume v: claim check is in progress on this node")
	t.Run("answered after a busy moment", func(t *testing.T) {
		calls := 0
		err := AskAgain(context.Background(), func(context.Context) error {
			if calls++; calls < 3 {
				return busy
			}
			return nil
		})
		if err != nil || calls != 3 {
			t.Fatalf("err %v after %d calls, want nil after 3", err, calls)
		}
	})
	t.Run("another answer is final", func(t *testing.T) {
		calls := 0
		err := AskAgain(context.Background(), func(context.Context) error {
			calls++
			return status.Error(codes.FailedPrecondition, "held by another node")
		})
		if status.Code(err) != codes.FailedPrecondition || calls != 1 {
			t.Fatalf("err %v after %d calls, want FailedPrecondition after 1", err, calls)
		}
	})
	t.Run("busy until the caller gives up", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		calls := 0
		err := AskAgain(ctx, func(context.Context) error { calls++; return busy })
		if status.Code(err) != codes.Aborted || ctx.Err() == nil || calls < 2 {
			t.Fatalf("err %v after %d calls (ctx %v), want the last ABORTED once the context ended", err, calls, ctx.Err())
		}
	})
}
