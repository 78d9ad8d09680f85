package pkgbuild

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/whitesky-cloud/vco-storage/"

// TestShippedBinariesLinkNoTestCode: the binaries the packages and the
// image ship link none of the lab (integration/...) and not the
// simulator (csi/sim, which `vco-lab sim` serves); the agent links nothing
// of the CSI plugin's; the node plugin's path to the agent (csi/agentnode)
// does not reach the simulator either.
func TestShippedBinariesLinkNoTestCode(t *testing.T) {
	for _, tc := range []struct {
		pkg    string
		banned []string
	}{
		{"cmd/vco-agent", []string{"integration/", "csi/"}},
		{"cmd/vco-csi", []string{"integration/", "csi/sim"}},
		{"csi/agentnode", []string{"integration/", "csi/sim"}},
	} {
		out, err := exec.Command("go", "list", "-deps", "../../"+tc.pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", tc.pkg, err)
		}
		deps := strings.Fields(string(out))
		if len(deps) < 10 {
			t.Fatalf("go list -deps %s listed %d packages", tc.pkg, len(deps))
		}
		for _, d := range deps {
			for _, b := range tc.banned {
				if strings.HasPrefix(d, module+b) {
					t.Errorf("%s links %s", tc.pkg, d)
				}
			}
		}
	}
}
