package agentnode

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A node plugin refused the agent's socket because its pod lacks the
// node's vco-agent gid is told that gid and where the pod gets it; one
// that has the group, or runs as root, is told nothing about groups.
func TestGroupHintNamesTheSocketsGroup(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "vco-agent")
	if err := os.Mkdir(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, 0, 4242); err != nil {
		t.Skipf("chown to gid 4242: %v", err)
	}
	sock := filepath.Join(dir, "agent.sock")
	h := groupHint(sock, 65532, 65532, []int{573, 65532})
	for _, want := range []string{dir + " belongs to gid 4242", "uid 65532", "[573 65532]", "VCO_AGENT_GID=4242", "docs/csi-addon.md"} {
		if !strings.Contains(h, want) {
			t.Errorf("hint %q does not say %q", h, want)
		}
	}
	for _, c := range []struct {
		uid, gid int
		groups   []int
	}{{65532, 65532, []int{4242}}, {65532, 4242, nil}, {0, 0, nil}} {
		if h := groupHint(sock, c.uid, c.gid, c.groups); h != "" {
			t.Errorf("uid %d gid %d groups %v: hint %q, want none", c.uid, c.gid, c.groups, h)
		}
	}
	if h := groupHint(filepath.Join(t.TempDir(), "absent", "agent.sock"), 65532, 65532, nil); h != "" {
		t.Errorf("no socket directory: hint %q, want none", h)
	}
}
