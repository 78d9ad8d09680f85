package pkgbuild

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// runScript runs one of the .deb's maintainer scripts with DPKG_ROOT set
// to root, as dpkg does for an installation into another root: every path
// the scripts touch is under root, and nothing on this machine changes.
func runScript(t *testing.T, root, script string, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("sh", append([]string{filepath.Join(repoRoot(t), "packaging", "deb", script)}, args...)...)
	cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "DPKG_ROOT=" + root}, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func writeFile(t *testing.T, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// Removing or purging the package while a volume is staged on the node
// would leave its mount and fence with no agent, and purge deleted the
// claim records the next agent needs. The removal is
// refused unless forced, and a purge keeps the claim records.
func TestDebRemovalKeepsStagedVolumes(t *testing.T) {
	root := t.TempDir()
	state := filepath.Join(root, "var/lib/vco-agent")
	claim := filepath.Join(state, "volumes", "dm9sLTE.json")
	writeFile(t, claim, `{"volume":"vol-1","phase":"staged","state":"held"}`)
	writeFile(t, filepath.Join(state, "scratch"), "x")
	writeFile(t, filepath.Join(root, "etc/vco-agent/config.yaml"), "# admin\n")

	out, err := runScript(t, root, "prerm", nil, "remove")
	if err == nil {
		t.Fatalf("prerm remove succeeded with a volume staged; output:\n%s", out)
	}
	for _, want := range []string{"refusing to remove", "1 volume(s) are staged", "kubectl drain", "docs/uninstall.md", "VCO_AGENT_FORCE_REMOVE=1"} {
		if !strings.Contains(out, want) {
			t.Errorf("prerm's refusal lacks %q:\n%s", want, out)
		}
	}
	// An upgrade restarts the agent in place and must not be refused.
	if out, err := runScript(t, root, "prerm", nil, "upgrade", "0.0.2-1"); err != nil {
		t.Errorf("prerm upgrade refused with a volume staged: %v\n%s", err, out)
	}
	out, err = runScript(t, root, "prerm", []string{"VCO_AGENT_FORCE_REMOVE=1"}, "remove")
	if err != nil || !strings.Contains(out, "as VCO_AGENT_FORCE_REMOVE=1 asks") {
		t.Fatalf("forced prerm remove: %v\n%s", err, out)
	}
	out, err = runScript(t, root, "postrm", nil, "purge")
	if err != nil {
		t.Fatalf("postrm purge: %v\n%s", err, out)
	}
	if _, err := os.Stat(claim); err != nil {
		t.Errorf("purge deleted the claim record of a staged volume: %v\n%s", err, out)
	}
	if !strings.Contains(out, "purge keeps") {
		t.Errorf("purge does not say it kept the claims:\n%s", out)
	}
	for _, gone := range []string{filepath.Join(state, "scratch"), filepath.Join(root, "etc/vco-agent")} {
		if _, err := os.Stat(gone); err == nil {
			t.Errorf("purge left %s", gone)
		}
	}

	// With no volume staged, removal goes ahead and purge leaves nothing.
	if err := os.Remove(claim); err != nil {
		t.Fatal(err)
	}
	if out, err := runScript(t, root, "prerm", nil, "remove"); err != nil {
		t.Fatalf("prerm remove refused with no volume staged: %v\n%s", err, out)
	}
	if out, err := runScript(t, root, "postrm", nil, "purge"); err != nil {
		t.Fatalf("postrm purge: %v\n%s", err, out)
	}
	if _, err := os.Stat(state); err == nil {
		t.Errorf("purge with no volume staged left %s", state)
	}
}
