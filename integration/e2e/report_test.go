package e2e

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

func TestVerdicts(t *testing.T) {
	r := &Report{}
	for _, p := range Properties {
		if held, _ := r.Verdict(p); held {
			t.Errorf("%s held with no checks", p)
		}
	}
	for _, p := range Properties {
		r.Checks = append(r.Checks, Check{Property: p, Scenario: "E0", Held: true, Evidence: "shown"})
	}
	if !r.AllHeld() {
		t.Fatal("every property checked and held, but AllHeld is false")
	}
	r.Checks = append(r.Checks, Check{Property: P4, Scenario: "E4", Held: false, Evidence: "no DiskFenced"})
	if held, _ := r.Verdict(P4); held || r.AllHeld() {
		t.Error("a failed check did not make its property fail")
	}
	r.Checks = r.Checks[:len(r.Checks)-1]
	r.Err = errors.New("stopped")
	if r.AllHeld() {
		t.Error("a story that stopped early passed")
	}
}

func TestReportsShowEventsAndVerdicts(t *testing.T) {
	t0 := time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC)
	r := &Report{Started: t0, Finished: t0.Add(time.Minute), Kind: "scsi-block",
		Steps:  []Step{{Scenario: "E2", Node: "node-b", Name: "NodeStageVolume", Start: t0.Add(time.Second), Duration: time.Second, OK: true}},
		Checks: []Check{{Property: P2, Scenario: "E2", Held: true, Evidence: "refused <naming> node-a"}},
		Events: []simlab.Event{{Node: "node-b", Type: "EVENT_TYPE_DISK_REFUSED", Time: t0.Add(2 * time.Second), HolderKey: "7663"}},
	}
	var txt, html bytes.Buffer
	r.WriteText(&txt)
	if err := r.WriteHTML(&html); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"DiskRefused", "holder_key=7663", "P2 HELD", "P1 NOT SHOWN", "NOT every property"} {
		if !strings.Contains(txt.String(), want) {
			t.Errorf("text report lacks %q:\n%s", want, txt.String())
		}
	}
	for _, want := range []string{`<span class="name">node-b</span>`, "DiskRefused", "refused &lt;naming&gt; node-a"} {
		if !strings.Contains(html.String(), want) {
			t.Errorf("HTML report lacks %q", want)
		}
	}
}
