package lease

import (
	"strings"
	"testing"
)

// A schedule of the simulator (seed 1202225, mixed, with the extras) in
// which two hosts hold the lease at once. Host 1's engine (life 21)
// releases the lease, and its release write times out twice, still in
// flight ("release failed"); the node's next engine (life 22: the volume
// staged again on the same node, a new Engine on a new descriptor of the
// disk) reads its own key's slot 15 still held, claims it again at once
// (epoch 29) and holds it after its race check. The first engine's
// release write then lands, over the new claim: slot 15 reads released
// at epoch 28. Host 2, waiting for slot 15 to expire, sees it released,
// claims slot 6 at epoch 29 and holds it; host 1's engine finds its slot
// overwritten only at its next renewal, 1.5 s later: both hosts wrote in
// between (I1 of the lease). An engine settles a claim of its own still
// in flight (unconfirmed, erased), but a new engine of the same node knows
// nothing of the write its predecessor left in flight on the same disk.
func TestAdv24LeaseScheduleAReleaseWriteInFlightErasesTheNodesNextClaim(t *testing.T) {
	const seed = 1202225
	failures, trace, _ := runSchedule(t, seed, classOf(seed), extrasAll)
	if len(failures) > 0 {
		t.Fatalf("seed %d:\n  %s\ntrace (last 60 lines):\n%s", seed, strings.Join(failures, "\n  "), lastLines(trace, 60))
	}
}
