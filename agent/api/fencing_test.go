package api

import (
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Each fencing method crosses the API and comes back as itself.
func TestFencingMethodsCrossTheAPIAsThemselves(t *testing.T) {
	for _, m := range []fence.Method{fence.MethodPR, fence.MethodLease, fence.MethodNone} {
		x := FencingOf(m)
		if x == FencingMethod_FENCING_METHOD_UNSPECIFIED || x.Method() != m {
			t.Errorf("%s: API %s, back %q", m, x, x.Method())
		}
	}
	if x := FencingOf("smoke-signals"); x != FencingMethod_FENCING_METHOD_UNSPECIFIED || x.Method() != "" {
		t.Errorf("an unknown method: API %s, back %q", x, x.Method())
	}
}
