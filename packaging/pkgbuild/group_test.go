package pkgbuild

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

// The group tools the maintainer scripts call, as FAKES over a group file
// of the test's own ($FAKE_GROUP): the real getent, addgroup and groupadd
// would read and change this machine's group database. They answer as the
// real ones do: getent by name or gid, exit 2 when absent; addgroup and
// groupadd refuse a gid already in use and otherwise take the highest free
// system gid. The systemd helpers the .deb's postinst also calls do
// nothing here.
var fakeTools = map[string]string{
	"getent": `[ "$1" = group ] || exit 1
while IFS=: read -r name pw gid members; do
	if [ "$name" = "$2" ] || [ "$gid" = "$2" ]; then echo "$name:$pw:$gid:$members"; exit 0; fi
done <"$FAKE_GROUP"
exit 2`,
	"addgroup": `gid= name=
while [ $# -gt 0 ]; do
	case $1 in --gid) gid=$2; shift ;; --system|--quiet) ;; *) name=$1 ;; esac
	shift
done
echo "addgroup $name ${gid:-dynamic}" >>"$FAKE_LOG"
add "$name" "$gid"`,
	"groupadd": `gid= name=
while [ $# -gt 0 ]; do
	case $1 in -g) gid=$2; shift ;; -r) ;; *) name=$1 ;; esac
	shift
done
echo "groupadd $name ${gid:-dynamic}" >>"$FAKE_LOG"
add "$name" "$gid"`,
	"deb-systemd-helper": "exit 0",
	"deb-systemd-invoke": "exit 0",
	"systemctl":          "exit 0",
}

// fakeAdd is the part addgroup and groupadd share.
const fakeAdd = `add() {
	if getent group "$1" >/dev/null; then echo "group $1 exists" >&2; exit 1; fi
	gid=$2
	if [ -n "$gid" ]; then
		if getent group "$gid" >/dev/null; then echo "The GID $gid is already in use." >&2; exit 1; fi
	else
		gid=999
		while getent group "$gid" >/dev/null; do gid=$((gid - 1)); done
	fi
	echo "$1:x:$gid:" >>"$FAKE_GROUP"
}
`

// groupScript runs a maintainer script with the fake tools and the given
// group file, and returns its output, the tools it called and the group
// file afterwards.
func groupScript(t *testing.T, script, groups string, args ...string) (out, calls, after string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range fakeTools {
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!/bin/sh\n"+fakeAdd+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cut, err := exec.LookPath("cut")
	if err != nil {
		t.Skip("no cut here")
	}
	if err := os.Symlink(cut, filepath.Join(bin, "cut")); err != nil {
		t.Fatal(err)
	}
	group, log := filepath.Join(dir, "group"), filepath.Join(dir, "calls")
	if err := os.WriteFile(group, []byte(groups), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/bin/sh", append([]string{filepath.Join(repoRoot(t), "packaging", script)}, args...)...)
	cmd.Env = []string{"PATH=" + bin, "FAKE_GROUP=" + group, "FAKE_LOG=" + log, "DPKG_ROOT=" + filepath.Join(dir, "root")}
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", script, args, err, b)
	}
	c, _ := os.ReadFile(log)
	g, _ := os.ReadFile(group)
	return string(b), string(c), string(g)
}

// The node plugin's pod names the vco-agent group by its gid
// (supplementalGroups), so every package creates it with the one gid the
// add-on defaults to, deploy.AgentGID; where a group of the node already
// has that gid, the group gets another and the script says which, and
// what the add-on then needs.
func TestPackagesCreateTheAgentGroupWithItsFixedGID(t *testing.T) {
	gid := fmt.Sprint(deploy.AgentGID)
	for _, s := range []struct{ script, arg, tool string }{{"deb/postinst", "configure", "addgroup"}, {"rpm/pre", "1", "groupadd"}} {
		t.Run(s.script, func(t *testing.T) {
			// A fresh node: the fixed gid.
			out, calls, after := groupScript(t, s.script, "root:x:0:\n", s.arg)
			if !strings.Contains(after, "vco-agent:x:"+gid+":") || strings.Contains(out, "VCO_AGENT_GID") {
				t.Errorf("fresh node: %s made\n%s(calls: %s), said %q; want vco-agent with gid %s, silently", s.script, after, calls, out, gid)
			}
			// The gid is taken: another one, and a warning naming it.
			out, _, after = groupScript(t, s.script, "root:x:0:\nlocal:x:"+gid+":\n", s.arg)
			if !strings.Contains(after, "vco-agent:x:999:") || !strings.Contains(out, "VCO_AGENT_GID=999") || !strings.Contains(out, "docs/csi-addon.md") {
				t.Errorf("gid %s taken: %s made\n%s, said %q; want vco-agent with another gid and a warning naming it", gid, s.script, after, out)
			}
			// An upgrade over a group of another gid: kept, and the warning.
			out, calls, _ = groupScript(t, s.script, "root:x:0:\nvco-agent:x:120:\n", s.arg)
			if calls != "" || !strings.Contains(out, "gid 120") || !strings.Contains(out, "VCO_AGENT_GID=120") {
				t.Errorf("group of gid 120: %s called %q, said %q; want the group kept and a warning", s.script, calls, out)
			}
			// An upgrade over the group as made: nothing to do or say.
			out, calls, _ = groupScript(t, s.script, "root:x:0:\nvco-agent:x:"+gid+":\n", s.arg)
			if calls != "" || strings.Contains(out, "vco-agent") {
				t.Errorf("group of gid %s: %s called %q, said %q; want nothing", gid, s.script, calls, out)
			}
		})
	}
}

// sysusers.d gives the group the same gid: read by the real
// systemd-sysusers on a root of the test's own.
func TestSysusersGivesTheAgentGroupItsFixedGID(t *testing.T) {
	sysusers, err := exec.LookPath("systemd-sysusers")
	if err != nil {
		t.Skip("no systemd-sysusers here")
	}
	conf, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging", "vco-agent.sysusers"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ groups, want string }{
		{"root:x:0:\n", fmt.Sprintf("vco-agent:x:%d:", deploy.AgentGID)},
		{fmt.Sprintf("root:x:0:\nlocal:x:%d:\n", deploy.AgentGID), "vco-agent:x:999:"},
	} {
		root := t.TempDir()
		writeFile(t, filepath.Join(root, "etc", "group"), c.groups)
		writeFile(t, filepath.Join(root, "etc", "passwd"), "root:x:0:0::/root:/bin/sh\n")
		writeFile(t, filepath.Join(root, "usr", "lib", "sysusers.d", "vco-agent.conf"), string(conf))
		if out, err := exec.Command(sysusers, "--root="+root).CombinedOutput(); err != nil {
			t.Fatalf("systemd-sysusers: %v\n%s", err, out)
		}
		if g, _ := os.ReadFile(filepath.Join(root, "etc", "group")); !strings.Contains(string(g), c.want+"\n") {
			t.Errorf("over\n%ssysusers.d made\n%swant %s", c.groups, g, c.want)
		}
	}
}
