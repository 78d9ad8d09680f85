// Package agenterr holds the kinds of failure the agent reports to its
// callers, and the one table that turns them into gRPC status codes. Code
// anywhere in the agent says what went wrong (a disk held elsewhere is
// FailedPrecondition, a caller not allowed is PermissionDenied); only this
// package knows how that looks on the wire.
package agenterr

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Kind classifies an error for the caller.
type Kind int

const (
	// Internal is anything not classified: a bug or an unexpected host state.
	Internal Kind = iota
	// InvalidArgument: the request itself is wrong; retrying cannot help.
	InvalidArgument
	// NotFound: the volume, device or object named does not exist.
	NotFound
	// FailedPrecondition: the system is not in a state to do this, e.g. a
	// disk held by another node. The message names what to fix.
	FailedPrecondition
	// PermissionDenied: the caller may not use the API.
	PermissionDenied
	// Unavailable: a dependency is temporarily missing; retrying may help.
	Unavailable
	// Aborted: a concurrent operation on the same object won.
	Aborted
	// AlreadyExists: the object exists with different, incompatible
	// parameters (a volume staged with another filesystem or path).
	AlreadyExists
)

// codes is the single mapping from kinds to gRPC codes.
var codeOf = map[Kind]codes.Code{
	Internal:           codes.Internal,
	InvalidArgument:    codes.InvalidArgument,
	NotFound:           codes.NotFound,
	FailedPrecondition: codes.FailedPrecondition,
	PermissionDenied:   codes.PermissionDenied,
	Unavailable:        codes.Unavailable,
	Aborted:            codes.Aborted,
	AlreadyExists:      codes.AlreadyExists,
}

// Error is an error with a kind.
type Error struct {
	Kind Kind
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// New makes an error of kind k with a formatted message (%w works).
func New(k Kind, format string, args ...any) error {
	return &Error{Kind: k, Err: fmt.Errorf(format, args...)}
}

// KindOf is the kind of the outermost classified error in err's chain,
// Internal when there is none.
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return Internal
}

// Code is the gRPC code for err.
func Code(err error) codes.Code {
	switch {
	case err == nil:
		return codes.OK
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return codeOf[KindOf(err)]
}

// Status turns err into the gRPC status error a handler returns.
func Status(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(Code(err), err.Error())
}
