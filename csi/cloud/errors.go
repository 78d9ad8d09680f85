package cloud

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error the client returns for an HTTP answer wraps
// exactly one of these, so callers branch with errors.Is and never look at
// status codes. The gRPC code for each is chosen by the driver, not here.
var (
	ErrNotFound      = errors.New("not found")
	ErrAlreadyExists = errors.New("already exists")
	ErrConflict      = errors.New("conflict")
	ErrForbidden     = errors.New("forbidden")
	ErrUnauthorized  = errors.New("unauthorized")
	ErrRateLimited   = errors.New("rate limited")
	ErrInvalid       = errors.New("invalid request")
	ErrUnavailable   = errors.New("API unavailable")
)

// APIError is a failed call: which operation, on what, and what the API said.
// Its text never carries the credential.
type APIError struct {
	Op      string // e.g. "create disk"
	Target  string // e.g. "disk 12 in location ch-lug-1"
	Status  int    // HTTP status, 0 for transport errors
	Message string // the API's own message, if any
	Hint    string // what the operator can do
	Kind    error  // one of the sentinel errors
}

func (e *APIError) Error() string {
	s := e.Op
	if e.Target != "" {
		s += " " + e.Target
	}
	if e.Status != 0 {
		s += fmt.Sprintf(": HTTP %d", e.Status)
	}
	if e.Kind != nil {
		s += " (" + e.Kind.Error() + ")"
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Hint != "" {
		s += "; " + e.Hint
	}
	return s
}

func (e *APIError) Unwrap() error { return e.Kind }

// kindForStatus maps an HTTP status to a sentinel. nil means success.
func kindForStatus(code int) error {
	switch {
	case code < 400:
		return nil
	case code == 400 || code == 422:
		return ErrInvalid
	case code == 401:
		return ErrUnauthorized
	case code == 403:
		return ErrForbidden
	case code == 404:
		return ErrNotFound
	case code == 409:
		return ErrConflict
	case code == 429:
		return ErrRateLimited
	case code >= 500:
		return ErrUnavailable
	default:
		return ErrInvalid
	}
}

// retryable reports whether a status is worth another attempt: only server
// errors and rate limiting, never client errors whose answer cannot change.
func retryable(code int) bool { return code == 429 || code >= 500 }
