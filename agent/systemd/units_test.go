// Package systemd holds the agent's systemd units, which the packages
// install; its test checks that they agree with what the daemon expects.
package systemd

import (
	"bufio"
	"os"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/daemon"
)

// keys reads a unit file's Key=value lines (sections are not needed here).
func keys(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") || strings.HasPrefix(l, "[") {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			t.Fatalf("%s: malformed line %q", path, l)
		}
		out[k] = v
	}
	return out
}

func TestSocketUnitMatchesDaemon(t *testing.T) {
	k := keys(t, "vco-agent.socket")
	if k["FileDescriptorName"] != daemon.ActivationName {
		t.Errorf("FileDescriptorName=%s, the daemon takes %q", k["FileDescriptorName"], daemon.ActivationName)
	}
	if k["ListenStream"] != client.DefaultSocket {
		t.Errorf("ListenStream=%s, the CLI defaults to %s", k["ListenStream"], client.DefaultSocket)
	}
	if k["SocketMode"] != "0660" || k["DirectoryMode"] != "0750" {
		t.Errorf("socket modes %s/%s, want 0660 in 0750", k["SocketMode"], k["DirectoryMode"])
	}
}

func TestServiceUnit(t *testing.T) {
	k := keys(t, "vco-agent.service")
	if k["Type"] != "notify" || k["WatchdogSec"] == "" || !strings.HasSuffix(k["ExecStart"], "vco-agent serve") {
		t.Errorf("service %v", k)
	}
	for _, banned := range []string{"ProtectSystem", "PrivateTmp", "PrivateDevices", "ProtectHome", "PrivateMounts", "MountFlags", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem"} {
		if _, ok := k[banned]; ok {
			t.Errorf("%s= would cut mount propagation between the agent and the host", banned)
		}
	}
}
