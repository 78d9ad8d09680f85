package k8s_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
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

func TestClusterUp(t *testing.T) {
	c := upCluster(t, k8s.Options{})
	ctx := context.Background()
	out, err := c.Kubectl(ctx, "get", "nodes", "-o", "wide")
	if err != nil {
		t.Fatal(err)
	}
	t.Log(out)
}
