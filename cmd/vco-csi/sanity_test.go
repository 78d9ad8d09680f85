package main

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sanityreport"
	"github.com/whitesky-cloud/vco-storage/csi/sanitytargets"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// TestCSISanityBinary runs the csi-sanity binary of csi-test (the version
// go.mod pins) against the built binaries: vco-agent doing real mounts of
// the simulator's loop devices, the simulator (`vco-lab sim`), and
// `vco-csi --mode=all`; once with filesystem volumes and once with raw
// block volumes (--csi.testvolumeaccesstype block), against the same stack.
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
			targets, staging, endpoint, check := sanityPaths(t, s, access)
			// csi-sanity makes the target and staging directories, not their parents.
			for _, d := range []string{filepath.Dir(targets), filepath.Dir(staging)} {
				if err := os.MkdirAll(d, 0o750); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(bin, "--csi.endpoint", endpoint, "--csi.checkpathcmd", check,
				"--csi.mountdir", targets, "--csi.stagingdir", staging,
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

// sanityPaths are csi-sanity's target directory and staging path for
// volumes of access type access, the endpoint it is to call and the
// command it checks a target with. The agent stages and publishes only at
// the kubelet's paths: the staging path is one, and so are raw block
// targets (<targets>/target is volumeDevices/publish/<pv>/<pod uid>);
// filesystem targets are moved to the kubelet's shape by a proxy between
// csi-sanity and the plugin, which serves the returned endpoint, and
// checked where they were moved (sanitytargets).
func sanityPaths(t *testing.T, s *stack, access string) (targets, staging, endpoint, check string) {
	t.Helper()
	dir := t.TempDir()
	targets, endpoint = filepath.Join(s.kubelet, "sanity-"+access), "unix://"+s.csiSock
	staging = kubeletpath.Staging(s.kubelet, "cloud.whitesky.csi", "sanity-"+access)
	tg := sanitytargets.Targets{Kubelet: s.kubelet, Dir: targets}
	if access == "block" {
		targets = filepath.Dir(kubeletpath.BlockTarget(s.kubelet, "sanity-block", "x"))
		staging = kubeletpath.BlockStaging(s.kubelet, "sanity-block")
		tg = sanitytargets.Targets{} // moves nothing
	} else {
		ln, err := net.Listen("unix", filepath.Join(dir, "sanity-proxy.sock"))
		if err != nil {
			t.Fatal(err)
		}
		stop, err := tg.Proxy(ln, endpoint)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		endpoint = "unix://" + ln.Addr().String()
	}
	check = filepath.Join(dir, "check-path")
	if err := os.WriteFile(check, []byte(tg.CheckScript()), 0o700); err != nil {
		t.Fatal(err)
	}
	return targets, staging, endpoint, check
}
