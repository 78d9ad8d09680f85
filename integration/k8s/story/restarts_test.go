package story

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

func rec(i int, node string) string { return fmt.Sprintf("%010d %20s\n", i, node) }

func TestRecordsFindAGapARepeatAndATornRecord(t *testing.T) {
	whole := rec(1, "w1") + rec(2, "w1") + rec(3, "w2")
	if rs, bad := records(whole); len(rs) != 3 || bad != "" || rs[2].node != "w2" {
		t.Fatalf("records 1..3: %v %q", rs, bad)
	}
	for name, out := range map[string]string{
		"gap":    rec(1, "w1") + rec(3, "w1"),
		"repeat": rec(1, "w1") + rec(2, "w1") + rec(2, "w1"),
		"torn":   rec(1, "w1") + "0000000002\n",
		"empty":  "",
		"zeros":  rec(1, "w1") + "\x00\x00\x00\n",
	} {
		if _, bad := records(out); bad == "" {
			t.Errorf("%s: records %q judged whole", name, out)
		}
	}
}

func TestHandoverIsTheNewNodesFirstRecord(t *testing.T) {
	rs, _ := records(rec(1, "w1") + rec(2, "w1") + rec(3, "w2") + rec(4, "w2"))
	if got := handover(rs, "w2"); got != 3 {
		t.Errorf("handover to w2 at %d, want 3", got)
	}
	if got := handover(rs, "w3"); got != 0 {
		t.Errorf("handover to w3 (no record) at %d, want 0", got)
	}
	back, _ := records(rec(1, "w1") + rec(2, "w2") + rec(3, "w1"))
	if got := handover(back, "w2"); got != -1 {
		t.Errorf("a record of w1 after w2's first: handover %d, want -1", got)
	}
}

func TestLateRecordsFindsTheOldNodesRecordsOnTheDisk(t *testing.T) {
	img := filepath.Join(t.TempDir(), "disk")
	// Records in a file's block, then, 3 MiB on (past a read chunk), one
	// of w1's that landed after w2 began at 3, and one across a chunk's end.
	data := make([]byte, 5<<20)
	copy(data[4096:], rec(1, "w1")+rec(2, "w1")+rec(3, "w2"))
	copy(data[3<<20:], rec(7, "w1"))
	copy(data[1<<20-10:], rec(9, "w1"))
	if err := os.WriteFile(img, data, 0o600); err != nil {
		t.Fatal(err)
	}
	late, err := lateRecords(img, "w1", 3)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(late, "0000000007 w1") || !slices.Contains(late, "0000000009 w1") || slices.Contains(late, "0000000002 w1") {
		t.Errorf("late records %v, want 7 and 9 of w1 and not 2", late)
	}
	if late, _ := lateRecords(img, "w2", 4); len(late) != 0 {
		t.Errorf("w2 has no record from 4: %v", late)
	}
}

func TestGrantInReadsTheNodesAttachmentMetadata(t *testing.T) {
	lines := `w1 {"other":"x"}
w2 {"` + driver.PubFenceGrant + `":"g-1"}`
	if g := grantIn(lines, "w2"); g != "g-1" {
		t.Errorf("grant of w2 %q", g)
	}
	if g := grantIn(lines, "w1"); g != "" {
		t.Errorf("grant of w1 %q, want none", g)
	}
}

func TestMetricErrorsCountsOnlyErrors(t *testing.T) {
	m := parseMetrics(`# HELP vco_csi_operations_total CSI calls served, by method and gRPC code.
# TYPE vco_csi_operations_total counter
vco_csi_operations_total{code="OK",method="NodeStageVolume"} 4
vco_csi_operations_total{code="Internal",method="NodePublishVolume"} 0
vco_agent_volume_operations_total{op="stage",result="ok"} 4
vco_agent_claim_checks_total{result="ok"} 30
vco_agent_fences_total 0
vco_csi_agent_metrics_errors_total 0
`)
	if m[`vco_csi_operations_total{code="OK",method="NodeStageVolume"}`] != 4 {
		t.Fatalf("parsed %v", m)
	}
	m[`vco_csi_operations_total{code="Canceled",method="Probe"}`] = 1
	if got := metricErrors(m, nil); got != "" {
		t.Fatalf("no error counted, judged %q", got)
	}
	for _, series := range []string{
		`vco_csi_operations_total{code="Internal",method="NodePublishVolume"}`,
		`vco_agent_volume_operations_total{op="stage",result="FailedPrecondition"}`,
		`vco_agent_claim_checks_total{result="lost"}`,
		"vco_agent_fences_total", "vco_agent_refusals_total", "vco_csi_agent_metrics_errors_total",
	} {
		m2 := map[string]float64{series: 1}
		if got := metricErrors(m2, nil); !strings.Contains(got, series) {
			t.Errorf("%s 1 not counted as an error: %q", series, got)
		}
		if got := metricErrors(map[string]float64{series: 3}, map[string]float64{series: 3}); got != "" {
			t.Errorf("%s counted before the base judged an error: %q", series, got)
		}
		if got := metricErrors(map[string]float64{series: 1}, map[string]float64{series: 3}); !strings.Contains(got, series+" 1") {
			t.Errorf("%s reset (a restart) and counting 1 since: %q", series, got)
		}
	}
}
