package sanityreport

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/onsi/ginkgo/v2/types"
)

func TestCheckAcceptsOnlyUnadvertisedSkips(t *testing.T) {
	spec := func(text string, st types.SpecState, msg string) types.SpecReport {
		return types.SpecReport{LeafNodeType: types.NodeTypeIt, LeafNodeText: text, State: st, Failure: types.Failure{Message: msg}}
	}
	reports := []types.Report{{SpecReports: types.SpecReports{
		spec("stages", types.SpecStatePassed, ""),
		spec("publishes", types.SpecStatePassed, ""),
		spec("modify", types.SpecStateSkipped, "ControllerModifyVolume not supported"),
		spec("capacity", types.SpecStateSkipped, "GetCapacity not supported"),
		spec("pending upstream", types.SpecStatePending, ""),
		spec("expand", types.SpecStateSkipped, "skipped by a --ginkgo.skip"),
		spec("known defect", types.SpecStateSkipped, ""),
		spec("stats", types.SpecStateFailed, "NOT_FOUND expected"),
		{LeafNodeType: types.NodeTypeBeforeSuite, State: types.SpecStateFailed},
	}}}
	b, _ := json.Marshal(reports)
	f := filepath.Join(t.TempDir(), "r.json")
	os.WriteFile(f, b, 0o644)
	passed, problems, err := Check(f, map[string]string{"known defect": "a defect elsewhere"})
	if err != nil {
		t.Fatal(err)
	}
	// GetCapacity is advertised: its skip is a problem now.
	if passed != 2 || len(problems) != 3 || !strings.Contains(problems[0], `"capacity" skipped`) ||
		!strings.Contains(problems[1], `"expand" skipped`) || !strings.Contains(problems[2], "NOT_FOUND expected") {
		t.Fatalf("passed %d, problems %q", passed, problems)
	}
}
