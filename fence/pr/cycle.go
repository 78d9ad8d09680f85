package pr

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// CycleStats are latencies of repeated acquire/release cycles.
type CycleStats struct {
	Cycles  int             `json:"cycles"`
	Acquire []time.Duration `json:"acquire_ns"`
	Release []time.Duration `json:"release_ns"`
}

// Median returns the median of ds (0 for none).
func Median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// Cycle acquires and releases the disk n times and records how long each
// call took, for comparing the engine with a reference tool (sg_persist
// running the same register/reserve/release/unregister sequence) on a real
// target. It stops at the first error. The disk must be free.
func Cycle(ctx context.Context, e *Engine, n int) (CycleStats, error) {
	st := CycleStats{}
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if _, err := e.Acquire(ctx, nil); err != nil {
			return st, fmt.Errorf("cycle %d: %w", i+1, err)
		}
		t1 := time.Now()
		if err := e.Release(ctx); err != nil {
			return st, fmt.Errorf("cycle %d: %w", i+1, err)
		}
		st.Acquire = append(st.Acquire, t1.Sub(t0))
		st.Release = append(st.Release, time.Since(t1))
		st.Cycles++
	}
	return st, nil
}
