package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// A socket directly in a plugin directory may be a hard link to a socket
// elsewhere on the same filesystem: on a node, /var/lib/kubelet's
// device-plugins/kubelet.sock (the device plugin registration) and
// pod-resources/kubelet.sock live on the filesystem the plugin
// directories do. plugin-dirs chowns the inode, not the name, so such a
// link gives the kubelet's socket, outside the plugin's two directories,
// to the plugin's user. A hard-linked file is left as it is and named;
// a hard-linked socket must be too.
func TestPluginDirsLeavesAHardLinkedSocketAsItIs(t *testing.T) {
	hosttest.NeedRoot(t, "chown needs root")
	base := t.TempDir()
	csi := filepath.Join(base, "csi")
	kubeletDir := filepath.Join(base, "device-plugins")
	for _, d := range []string{csi, kubeletDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	kubeletSock := filepath.Join(kubeletDir, "kubelet.sock")
	ln, err := net.Listen("unix", kubeletSock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	if err := os.Link(kubeletSock, filepath.Join(csi, "csi.sock")); err != nil {
		t.Fatal(err)
	}
	var out, errs bytes.Buffer
	rc := runPluginDirs([]string{"--owner=65532:573", csi}, &out, &errs)
	t.Logf("plugin-dirs: exit %d\n%s%s", rc, out.String(), errs.String())
	if u, g, _ := owner(t, kubeletSock); u != 0 || g != 0 {
		t.Errorf("the kubelet's socket %s, outside the plugin directory, now belongs to %d:%d: plugin-dirs chowned it through a hard link in %s", kubeletSock, u, g, csi)
	}
}
