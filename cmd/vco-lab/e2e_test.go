package main

import (
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s/story"
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

// The cluster bench's rows: each measure fence off (the reference), then
// fenced with its ratio over the rounds' means, as cmd/vco-bench reads them.
func TestBenchK8sRows(t *testing.T) {
	var figs []story.BenchFigure
	for i, m := range story.BenchMeasures {
		base := time.Duration(i+1) * 10 * time.Second
		figs = append(figs, story.BenchFigure{Measure: m, Unfenced: true, Times: []time.Duration{base, base}},
			story.BenchFigure{Measure: m, Times: []time.Duration{base, 2 * base}})
	}
	rows := benchK8sRows(figs, "virtio-blk")
	if len(rows) != 2*len(story.BenchMeasures) {
		t.Fatalf("%d rows", len(rows))
	}
	ref, fenced := rows[2], rows[3]
	if !strings.HasSuffix(ref.name, "fence off (reference)") || ref.value != "20.00s" || ref.ratio != "1.00x" ||
		!strings.HasPrefix(fenced.name, "k8s "+story.BenchMeasures[1]+", virtio-blk, 2 round(s), fenced") || fenced.value != "30.00s" || fenced.ratio != "1.50x" {
		t.Fatalf("rows of the second measure: %+v %+v", ref, fenced)
	}
}
