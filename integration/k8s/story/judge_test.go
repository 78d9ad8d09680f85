package story

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
)

func TestExercisedFollowsTheScenariosRun(t *testing.T) {
	if got := Exercised(Brief); !slices.Equal(got, []e2e.Property{e2e.P1, e2e.P5}) {
		t.Errorf("Brief exercises %v, want P1 P5", got)
	}
	if got := Exercised(Scenarios); !slices.Equal(got, e2e.Properties) {
		t.Errorf("every scenario together exercises %v, want all five", got)
	}
}

func TestJudgeAsksForEveryPropertyOfTheScenariosThatRan(t *testing.T) {
	r := &e2e.Report{}
	r.Run("K1", "cluster", "a pod", func() (string, error) { return "", nil })
	if err := Judge(r); err == nil || !strings.Contains(err.Error(), "P5 was never checked") {
		t.Fatalf("K1 ran without its P5 check: Judge said %v", err)
	}
	r.Check(e2e.P5, "K1", true, "held")
	if err := Judge(r); err != nil {
		t.Fatalf("K1 with its P5 check: %v", err)
	}
	r.Run("K8", "node-b", "refusal", func() (string, error) { return "", nil })
	if err := Judge(r); err == nil || !strings.Contains(err.Error(), "P2") {
		t.Fatalf("K8 ran without a P2 check: Judge said %v", err)
	}
	r.Check(e2e.P2, "K8", false, "mounted")
	if err := Judge(r); err == nil || !strings.Contains(err.Error(), "did not hold") {
		t.Fatalf("a failed check: Judge said %v", err)
	}
	r.Err = errors.New("stopped")
	if err := Judge(r); err == nil || err.Error() != "stopped" {
		t.Fatalf("a story that stopped: Judge said %v", err)
	}
}

func TestRunRefusesAScenarioWithoutK4(t *testing.T) {
	for _, sc := range []string{"K5", "K6", "K8", "K9"} {
		if _, err := chosen([]string{sc, "K4"}); err == nil || !strings.Contains(err.Error(), "uses K4's claim") {
			t.Errorf("%s before K4: %v, want a refusal", sc, err)
		}
		if _, err := chosen([]string{"K4", sc}); err != nil {
			t.Errorf("K4 then %s: %v", sc, err)
		}
	}
	if scs, err := chosen([]string{"K3", "K1"}); err != nil || len(scs) != 2 || scs[0].ID != "K3" {
		t.Errorf("K3 and K1, which have claims of their own: %v, %v", scs, err)
	}
	if _, err := chosen([]string{"K15"}); err == nil || !strings.Contains(err.Error(), `no scenario "K15"`) {
		t.Errorf("an unknown scenario: %v", err)
	}
}

// TestDocsTableFollowsTheRegistry: docs/development.md's table of the
// Kubernetes scenarios lists All's ids in its order, each with its
// properties.
func TestDocsTableFollowsTheRegistry(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(srctree.Root(), "docs", "development.md"))
	if err != nil {
		t.Fatal(err)
	}
	var rows []e2e.Scenario
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, "|")
		if len(f) < 5 || !strings.HasPrefix(strings.TrimSpace(f[1]), "K") {
			continue
		}
		props := strings.TrimSpace(f[len(f)-2])
		if props == "" {
			props = "-"
		}
		rows = append(rows, e2e.Scenario{ID: strings.TrimSpace(f[1]), Name: props})
	}
	if len(rows) != len(All) {
		t.Fatalf("the docs' table has %d scenarios, the registry %d", len(rows), len(All))
	}
	for i, sc := range All {
		if rows[i].ID != sc.ID || rows[i].Name != e2e.PropsText(sc.Props) {
			t.Errorf("row %d of the docs' table: %s with %s; the registry: %s with %s", i+1, rows[i].ID, rows[i].Name, sc.ID, e2e.PropsText(sc.Props))
		}
	}
}

// TestK14RunsAlone: K14 deletes the add-on and delivers it again, so a
// list with it and another scenario is refused, K14 by itself is not,
// and the full list leaves it out.
func TestK14RunsAlone(t *testing.T) {
	if err := checkAlone([]string{"K1", "K14"}); err == nil {
		t.Error("K1 with K14 was accepted")
	}
	if err := checkAlone([]string{"K14"}); err != nil {
		t.Errorf("K14 alone: %v", err)
	}
	if err := checkAlone(Scenarios); err != nil {
		t.Errorf("the full list: %v", err)
	}
	if slices.Contains(Scenarios, "K14") || !slices.Contains(e2e.IDs(All), "K14") {
		t.Errorf("K14 in the default list %v, or not in the registry", Scenarios)
	}
}
