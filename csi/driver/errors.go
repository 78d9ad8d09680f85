package driver

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// Kinds of failure the driver itself decides. Service methods return these
// (wrapped with a message) or errors from the cloud and the agent; the one
// place that turns any of them into a gRPC code is CodeForError.
var (
	ErrInvalid       = errors.New("invalid argument")
	ErrNotFound      = errors.New("not found")
	ErrAlreadyExists = errors.New("already exists")
	ErrPrecondition  = errors.New("failed precondition")
	ErrBusy          = errors.New("operation in progress")
	ErrOutOfRange    = errors.New("out of range")
	ErrUnsupported   = errors.New("not supported")
	ErrBadToken      = errors.New("invalid starting token")
	ErrAgent         = errors.New("node agent unavailable")
	ErrNoCapacity    = errors.New("resource exhausted")
)

// failf wraps a kind with a message that says what happened to what.
func failf(kind error, format string, a ...any) error {
	return &failure{kind: kind, msg: fmt.Sprintf(format, a...)}
}

type failure struct {
	kind error
	msg  string
}

func (f *failure) Error() string { return f.msg }
func (f *failure) Unwrap() error { return f.kind }

// CodeForError is the single mapping from an error to its gRPC code.
func CodeForError(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	// An agent answer already carries the code the agent chose.
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		return se.GRPCStatus().Code()
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	case errors.Is(err, ErrInvalid), errors.Is(err, cloud.ErrInvalid):
		return codes.InvalidArgument
	case errors.Is(err, ErrNotFound), errors.Is(err, cloud.ErrNotFound):
		return codes.NotFound
	case errors.Is(err, ErrAlreadyExists), errors.Is(err, cloud.ErrAlreadyExists):
		return codes.AlreadyExists
	case errors.Is(err, ErrPrecondition), errors.Is(err, cloud.ErrConflict):
		return codes.FailedPrecondition
	case errors.Is(err, ErrBusy):
		return codes.Aborted
	case errors.Is(err, ErrBadToken):
		return codes.Aborted
	case errors.Is(err, ErrOutOfRange):
		return codes.OutOfRange
	case errors.Is(err, ErrUnsupported):
		return codes.Unimplemented
	case errors.Is(err, ErrNoCapacity):
		return codes.ResourceExhausted
	case errors.Is(err, cloud.ErrForbidden):
		return codes.PermissionDenied
	case errors.Is(err, cloud.ErrUnauthorized):
		return codes.Unauthenticated
	case errors.Is(err, cloud.ErrRateLimited), errors.Is(err, cloud.ErrUnavailable), errors.Is(err, ErrAgent):
		return codes.Unavailable
	}
	return codes.Internal
}

// toStatus converts what a service method returned into a gRPC status.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		// Keep the agent's code and add our context to its words.
		return status.Error(se.GRPCStatus().Code(), err.Error())
	}
	return status.Error(CodeForError(err), err.Error())
}

// StatusInterceptor applies CodeForError to every unary call's error, so
// no service method builds a status itself.
func StatusInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	return resp, toStatus(err)
}
