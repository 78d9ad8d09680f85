package story_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/k8s/story"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func upCluster(t *testing.T, o k8s.Options) *k8s.Cluster {
	t.Helper()
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	if os.Getenv("VCO_K8S") == "" {
		t.Skip("the Kubernetes tier builds Kubernetes and boots a cluster: run it with 'make test-k8s' (sets VCO_K8S=1)")
	}
	dir := t.TempDir()
	if d := os.Getenv("VCO_K8S_KEEP"); d != "" {
		dir = d // the lab directory outlives the test, for its logs
	}
	cfg, err := simlab.TestConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	o.Lab = cfg
	o.Log = testWriter{t}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	c, err := k8s.Up(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return c
}

// TestStory is the Kubernetes tier: a cluster of two workers, the add-on
// applied as seed 001 says, and the scenarios (story.Brief, or
// $VCO_K8S_SCENARIOS: "all" or a list such as K1,K4,K6), each safety
// property judged from what they saw. The report goes to $VCO_LAB_BIN
// (make's bin/).
func TestStory(t *testing.T) {
	// make test's brief story boots the workers with the package's own
	// enablement of the agent; the full story (all scenarios, as make
	// k8s-lab runs them) with its cloud-init seed.
	scenarios, cloudInit := story.Brief, false
	switch v := os.Getenv("VCO_K8S_SCENARIOS"); v {
	case "":
	case "all":
		scenarios, cloudInit = story.Scenarios, true
	default:
		scenarios = strings.Split(v, ",")
	}
	c := upCluster(t, k8s.Options{CloudInit: cloudInit})
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	r := story.Run(ctx, c, scenarios, testWriter{t})
	dir := os.Getenv("VCO_LAB_BIN")
	if dir == "" {
		dir = t.TempDir()
	}
	if err := story.WriteReport(r, dir); err != nil {
		t.Error(err)
	}
	var txt strings.Builder
	r.WriteText(&txt)
	t.Log(txt.String())
	if err := story.Judge(r); err != nil {
		t.Fatal(err)
	}
}
