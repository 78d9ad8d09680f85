package agenterr

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestStatusCodes(t *testing.T) {
	held := New(FailedPrecondition, "disk %s is held by node %s", "d1", "node-b")
	cases := []struct {
		err  error
		want codes.Code
	}{
		{held, codes.FailedPrecondition},
		{fmt.Errorf("staging volume v1: %w", held), codes.FailedPrecondition},
		{New(PermissionDenied, "uid 5 refused"), codes.PermissionDenied},
		{New(NotFound, "no device"), codes.NotFound},
		{New(AlreadyExists, "staged as xfs"), codes.AlreadyExists},
		{New(Aborted, "busy"), codes.Aborted},
		{errors.New("surprise"), codes.Internal},
		{fmt.Errorf("waiting: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{context.Canceled, codes.Canceled},
		{status.Error(codes.Unavailable, "x"), codes.Unavailable},
	}
	for _, c := range cases {
		st, _ := status.FromError(Status(c.err))
		if st.Code() != c.want {
			t.Errorf("%v: code %v, want %v", c.err, st.Code(), c.want)
		}
		if st.Message() != c.err.Error() && status.Code(c.err) == codes.Unknown {
			t.Errorf("message %q lost, want %q", st.Message(), c.err.Error())
		}
	}
	if Status(nil) != nil {
		t.Error("nil error became a status")
	}
	for k := Internal; k <= AlreadyExists; k++ {
		if _, ok := codeOf[k]; !ok {
			t.Errorf("kind %d has no code", k)
		}
	}
}
