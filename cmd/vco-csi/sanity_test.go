package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sanityreport"
)

// TestCSISanityBinary runs the csi-sanity binary of csi-test (the version
// go.mod pins) against the built binaries: vco-agent doing real mounts of
// the simulator's loop devices, `vco-csi sim`, and `vco-csi --mode=all`;
// once with filesystem volumes and once with raw block volumes
// (--csi.testvolumeaccesstype block), against the same stack.
// `make test-csi-sanity` sets VCO_CSI_SANITY and VCO_BIN.
func TestCSISanityBinary(t *testing.T) {
	bin := os.Getenv("VCO_CSI_SANITY")
	if bin == "" {
		t.Skip("runs in `make test-csi-sanity`, which sets VCO_CSI_SANITY to the csi-sanity binary")
	}
	s := startStack(t, false)
	for _, access := range []string{"mount", "block"} {
		t.Run(access, func(t *testing.T) {
			start := time.Now()
			report := filepath.Join(t.TempDir(), "sanity.json")
			// csi-sanity makes the target and staging directories, not their parents.
			pods, plugins := filepath.Join(s.kubelet, "pods", "sanity-"+access), filepath.Join(s.kubelet, "plugins", "sanity-"+access)
			for _, d := range []string{pods, plugins} {
				if err := os.MkdirAll(d, 0o750); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(bin, "--csi.endpoint", "unix://"+s.csiSock,
				"--csi.mountdir", filepath.Join(pods, "target"), "--csi.stagingdir", filepath.Join(plugins, "staging"),
				"--csi.testvolumesize", strconv.Itoa(1<<30), "--csi.testvolumeexpandsize", strconv.Itoa(2<<30),
				"--csi.testvolumeaccesstype", access,
				"--csi.testnodevolumeattachlimit", "--ginkgo.json-report", report)
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("csi-sanity (%s volumes): %v", access, err)
			}
			passed, problems, err := sanityreport.Check(report, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range problems {
				t.Error(p)
			}
			if passed == 0 {
				t.Fatal("csi-sanity's report has no passed spec")
			}
			t.Logf("csi-sanity, %s volumes: %d specs passed in %s", access, passed, time.Since(start).Round(time.Second))
		})
	}
}
