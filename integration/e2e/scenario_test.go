package e2e

import (
	"slices"
	"strings"
	"testing"
)

// TestStoryRegistry: the lab story's scenarios are E1-E9, each once, E1-E3
// its spine, and together they give evidence for every property.
func TestStoryRegistry(t *testing.T) {
	ids := IDs(Story)
	want := []string{"E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9"}
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	if !slices.Equal(sorted, want) {
		t.Fatalf("the story's scenarios are %v, want each of %v once", ids, want)
	}
	for _, sc := range Story {
		if sc.Name == "" {
			t.Errorf("%s has no name", sc.ID)
		}
	}
	if got := Exercised(Story, ids); !slices.Equal(got, Properties) {
		t.Errorf("the whole story exercises %v, want %v", got, Properties)
	}
	if got := Exercised(Story, []string{"E1"}); !slices.Equal(got, []Property{P1}) {
		t.Errorf("E1 alone exercises %v, want P1", got)
	}
	for _, id := range []string{"E1", "E2", "E3"} {
		if slices.Contains(Optional, id) {
			t.Errorf("%s, of the story's spine, is listed as optional", id)
		}
	}
	if _, err := Lookup(Story, "E10"); err == nil || !strings.Contains(err.Error(), "E1, E2, E3, E5") {
		t.Errorf("Lookup of E10: %v, want a refusal listing the ids in order", err)
	}
	if PropsText(nil) != "-" || PropsText([]Property{P1, P5}) != "P1, P5" {
		t.Errorf("PropsText: %q %q", PropsText(nil), PropsText([]Property{P1, P5}))
	}
}
