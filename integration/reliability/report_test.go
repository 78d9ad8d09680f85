package reliability

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

// tally collects the figures docs/reliability.md reports.
type tally struct {
	mu    sync.Mutex
	n     map[string]int
	notes map[string]string
}

var figures = &tally{n: map[string]int{}, notes: map[string]string{}}

func (t *tally) add(k string, n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.n[k] += n
}

func (t *tally) note(k, v string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.notes[k] = v
}

// writeReport writes the figures of this run as Markdown to p.
func writeReport(p string) error {
	figures.mu.Lock()
	defer figures.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "# Reliability figures\n\n")
	fmt.Fprintf(&b, "Written by `make soak` (integration/reliability, %s). Every figure is counted by the tests\n", time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(&b, "as they run; a run that loses data or leaks a mount fails and writes nothing.\n\n")
	fmt.Fprintf(&b, "| figure | count |\n|---|---|\n")
	keys := make([]string, 0, len(figures.n))
	for k := range figures.n {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "| %s | %d |\n", k, figures.n[k])
	}
	if len(figures.notes) > 0 {
		fmt.Fprintf(&b, "\n")
		nk := make([]string, 0, len(figures.notes))
		for k := range figures.notes {
			nk = append(nk, k)
		}
		sort.Strings(nk)
		for _, k := range nk {
			fmt.Fprintf(&b, "## %s\n\n%s\n\n", k, strings.TrimSpace(figures.notes[k]))
		}
	}
	if extra := os.Getenv("VCO_RELIABILITY_EXTRA"); extra != "" {
		if x, err := os.ReadFile(extra); err == nil {
			b.Write(x)
		}
	}
	return os.WriteFile(p, []byte(b.String()), 0o644)
}
