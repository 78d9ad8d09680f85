package k8s

import (
	"strings"
	"testing"
)

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
