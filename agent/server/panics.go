package server

import (
	"fmt"
	"runtime/debug"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
)

// A handler that panics (docs/architecture.md, "Crashing on purpose"):
// one that only reads (the identity, status, listings, a volume's stats
// or token) answers INTERNAL naming the method and the volume, and the
// daemon keeps serving: nothing of it can be left half-done. One that
// changes the node (stage, unstage, publish, unpublish, expand) lets the
// panic take the process down: what it did so far (a fence, a mapping, a
// mount) is only known to its records, which the next process's start-up
// check takes back, and the host watchdog is not fed meanwhile for a
// lease it had not yet taken back.

// readOnlyMethods are the calls whose panic is answered.
var readOnlyMethods = map[string]bool{
	api.Agent_GetIdentity_FullMethodName:      true,
	api.Agent_GetStatus_FullMethodName:        true,
	api.Agent_ListRecentEvents_FullMethodName: true,
	api.Agent_GetVolumeStats_FullMethodName:   true,
	api.Agent_ListDisks_FullMethodName:        true,
	api.Agent_GetVolumeToken_FullMethodName:   true,
	api.Agent_WatchEvents_FullMethodName:      true,
}

// volumeOf names the volume a request is about, "" for none.
func volumeOf(req any) string {
	if r, ok := req.(interface{ GetVolumeId() string }); ok {
		return r.GetVolumeId()
	}
	return ""
}

// answerPanic turns a panic of a read-only call into its error; any other
// call's panic goes on up (see above).
func (s *Server) answerPanic(method string, req any, err *error) {
	if !readOnlyMethods[method] {
		return
	}
	p := recover()
	if p == nil {
		return
	}
	vol := volumeOf(req)
	s.o.Log.Error("a read-only API call panicked; answered INTERNAL, the agent keeps serving", "method", method, "volume", vol,
		"panic", fmt.Sprint(p), "stack", string(debug.Stack()))
	what := method
	if vol != "" {
		what += " for volume " + vol
	}
	*err = agenterr.Status(agenterr.New(agenterr.Internal, "%s failed on an internal error (a bug: the agent's log has its stack); nothing was changed, the agent keeps serving: retry, and report it", what))
}
