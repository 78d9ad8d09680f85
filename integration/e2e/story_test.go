package e2e_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// TestRWOStory runs the whole story on two guests with scsi-block disks:
// first use on node-a, E1 (second publish refused naming node-a's VM), E2
// (platform multi-attach: node-b refuses, nothing of it reaches the
// backing file), E3 (graceful move, data intact), E5 (a volume in another location
// stays there), E8 (a volume from a snapshot holds the data), E4 (node-b stopped,
// force detach, takeover by node-a with a grant, node-b fenced on resume,
// none of its late writes land). Every step must succeed and every
// property be shown to hold.
func TestRWOStory(t *testing.T) {
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	cfg, err := simlab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	env, err := simlab.Start(ctx, simlab.Options{Lab: cfg, Log: testWriter{t}})
	if err != nil {
		t.Fatal(err)
	}
	rep := e2e.Run(ctx, e2e.Options{Env: env, Progress: testWriter{t}})
	if err := env.Close(); err != nil {
		t.Errorf("teardown: %v", err)
	}
	var txt bytes.Buffer
	rep.WriteText(&txt)
	t.Log(txt.String())
	var html bytes.Buffer
	if err := rep.WriteHTML(&html); err != nil {
		t.Fatalf("HTML report: %v", err)
	}
	_ = os.WriteFile(filepath.Join(t.TempDir(), "lab-report.html"), html.Bytes(), 0o644)

	if rep.Err != nil {
		t.Fatalf("the story stopped early: %v", rep.Err)
	}
	for _, s := range rep.Steps {
		if !s.OK {
			t.Errorf("step %s %s on %s failed: %s", s.Scenario, s.Name, s.Node, s.Detail)
		}
	}
	for _, p := range e2e.Properties {
		held, checks := rep.Verdict(p)
		if len(checks) == 0 {
			t.Errorf("%s was not exercised", p)
		} else if !held {
			t.Errorf("%s did not hold: %+v", p, checks)
		}
	}
	// The events the verdicts rest on are in the report, per node.
	want := map[string][]string{
		"node-a": {"DiskClaimed", "DiskReleased", "TakeoverGranted"},
		"node-b": {"DiskRefused", "DiskClaimed", "DiskFenced"},
	}
	for node, names := range want {
		for _, n := range names {
			found := false
			for _, ev := range rep.Events {
				if ev.Node == node && ev.Name() == n {
					found = true
				}
			}
			if !found {
				t.Errorf("%s emitted no %s", node, n)
			}
		}
	}
	// One timeline lane per node in the HTML report.
	for _, node := range []string{"node-a", "node-b"} {
		if !strings.Contains(html.String(), `<span class="name">`+node+`</span>`) {
			t.Errorf("HTML report has no lane for %s", node)
		}
	}
}
