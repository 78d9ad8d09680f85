package k8s

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
)

func TestExercisedFollowsTheScenariosRun(t *testing.T) {
	if got := Exercised(Brief); !slices.Equal(got, []e2e.Property{e2e.P1, e2e.P5}) {
		t.Errorf("Brief exercises %v, want P1 P5", got)
	}
	if got := Exercised(Scenarios); !slices.Equal(got, e2e.Properties) {
		t.Errorf("every scenario together exercises %v, want all five", got)
	}
	for _, sc := range Scenarios {
		if _, ok := exercises[sc]; !ok {
			t.Errorf("scenario %s has no entry in exercises", sc)
		}
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

func TestRunStoryRefusesAScenarioWithoutK4(t *testing.T) {
	for _, sc := range []string{"K5", "K6", "K8", "K9"} {
		if !needsK4(sc) {
			t.Errorf("%s uses K4's claim but needsK4 says no", sc)
		}
	}
	if needsK4("K3") {
		t.Error("K3 has claims of its own")
	}
}

func TestNodeUserDataTurnsOnTheLocationOverride(t *testing.T) {
	u, err := nodeUserData("lab-location-1")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(u, "\n      node:\n        location: \"lab-location-1\"\n") {
		t.Errorf("the seed does not set the location:\n%s", u)
	}
	if !strings.HasPrefix(u, "#cloud-config\n") || !strings.Contains(u, "systemctl enable vco-agent.socket vco-agent.service") {
		t.Errorf("not the package's seed:\n%s", u)
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
	if _, ok := exercises["K14"]; !ok {
		t.Error("K14 has no entry in exercises")
	}
}
