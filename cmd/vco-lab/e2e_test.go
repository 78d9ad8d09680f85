package main

import (
	"strings"
	"testing"
)

// TestSkipSet: -skip takes the story's optional scenarios in any case and
// refuses one of its spine or an unknown one, naming those it takes.
func TestSkipSet(t *testing.T) {
	s, err := skipSet(" e4, E9 ,")
	if err != nil || len(s) != 2 || !s["E4"] || !s["E9"] {
		t.Fatalf("skipSet(e4, E9): %v, %v", s, err)
	}
	for _, bad := range []string{"E1", "E10", "K4"} {
		if _, err := skipSet(bad); err == nil || !strings.Contains(err.Error(), bad+" is not a scenario that can be left out") || !strings.Contains(err.Error(), "E5") {
			t.Errorf("skipSet(%s): %v, want a refusal naming it and the optional scenarios", bad, err)
		}
	}
}
