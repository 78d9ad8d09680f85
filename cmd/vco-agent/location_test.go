package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/location"
)

// TestPlaceholderLocationIsNotReady: an agent whose node.location is still
// the cloud-init template's placeholder says, in its journal and in
// `vco-agent status`, that the node is not ready and what to do; one
// without node.location says the location comes from the controller.
func TestPlaceholderLocationIsNotReady(t *testing.T) {
	for _, tc := range []struct {
		loc, status, journal string
	}{
		{location.Placeholder, "NOT READY", "level=ERROR msg=\"node.location \\\"" + location.Placeholder + "\\\" is a template placeholder"},
		{"", "(ok: node.location is not set: the node plugin takes this node's location from the controller", "node.location is not set"},
		{"ch-lug-1", "ch-lug-1 (ok: node.location is set", "node.location is set"},
	} {
		dir := t.TempDir()
		cfg := filepath.Join(dir, "config.yaml")
		body := "node:\n  name: cli-node\n"
		if tc.loc != "" {
			body += "  location: " + tc.loc + "\n"
		}
		os.WriteFile(cfg, []byte(body+"state_dir: "+filepath.Join(dir, "state")+"\n"), 0o644)
		sock := filepath.Join(dir, "agent.sock")
		_, _, agentErr := startAgentWith(t, sock, cfg)
		out, errs, code := run(t, "status", "--socket", sock)
		if code != 0 || !strings.Contains(out, "Location:") || !strings.Contains(out, tc.status) {
			t.Errorf("node.location %q: status exit %d, want %q on its Location line:\n%s%s", tc.loc, code, tc.status, out, errs)
		}
		if !agentErr.waitFor(tc.journal) {
			t.Errorf("node.location %q: the agent's log lacks %q:\n%s", tc.loc, tc.journal, agentErr.String())
		}
	}
}
