package driver_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"

	"github.com/whitesky-cloud/vco-storage/csi/sanityreport"
	"github.com/whitesky-cloud/vco-storage/csi/sanitytargets"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// TestSanity runs csi-test's sanity suite in-process against the plugin in
// "all" mode, the simulator in host mode (attachments to this machine are
// real loop devices) and vco-agent's API and volume manager, which mount
// those loop devices for real, all over real unix sockets. Every spec runs:
// the ones csi-sanity skips by itself are for capabilities the plugin does
// not advertise (README).
//
// With VCO_SANITY_ENCRYPTED=1 (make test-csi-sanity) every volume is
// encrypted instead: each stage reads the LUKS2 token through the agent and
// wraps or unwraps the passphrase with a FAKE transit engine; the agent
// formats and checks real LUKS2 headers, its dm-crypt mapping faked by a
// loop device at the data offset (no device-mapper on this host). Ginkgo
// runs one suite per process, hence the variable rather than a second test.
// With VCO_SANITY_BLOCK=1 as well (make test-csi-sanity), every volume is a
// raw block volume.
func TestSanity(t *testing.T) {
	access := "mount"
	if os.Getenv("VCO_SANITY_BLOCK") == "1" {
		access = "block"
	}
	if os.Getenv("VCO_SANITY_ENCRYPTED") == "1" {
		runSanity(t, access, map[string]string{"encryption": "true"})
		return
	}
	runSanity(t, access, nil)
}

func runSanity(t *testing.T, access string, params map[string]string) {
	hosttest.NeedRoot(t, "the host backend makes loop devices, which needs root")
	e := newTestEnv(t, envOpts{backend: &sim.HostBackend{Dir: filepath.Join(t.TempDir(), "disks")}, realAgent: true})
	cfg := sanity.NewTestConfig()
	cfg.Address = e.endpoint
	// The agent stages and publishes only at the kubelet's paths:
	// csi-sanity's staging path is one, and so are its raw block targets
	// (<TargetPath>/target: <pv>/<pod uid>); its filesystem targets are
	// moved to the kubelet's shape on the way (sanitytargets).
	cfg.StagingPath = kubeletpath.Staging(e.kubelet, "try.whitesky.cloud", "sanity")
	cfg.TargetPath = filepath.Join(e.kubelet, "sanity-targets")
	if access == "block" {
		cfg.StagingPath = kubeletpath.BlockStaging(e.kubelet, "sanity")
		cfg.TargetPath = filepath.Dir(kubeletpath.BlockTarget(e.kubelet, "sanity", "x"))
	} else {
		tg := sanitytargets.Targets{Kubelet: e.kubelet, Dir: cfg.TargetPath}
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithUnaryInterceptor(tg.Interceptor()))
		cfg.CheckPath = func(p string) (sanity.PathKind, error) {
			k, err := tg.Kind(p)
			return sanity.PathKind(k), err
		}
	}
	os.MkdirAll(filepath.Dir(cfg.TargetPath), 0o750)
	os.MkdirAll(filepath.Dir(cfg.StagingPath), 0o750)
	cfg.TestNodeVolumeAttachLimit = true
	cfg.IdempotentCount = 2
	cfg.TestVolumeParameters = params
	cfg.TestVolumeAccessType = access
	cfg.TestVolumeSize = 1 << 30
	cfg.TestVolumeExpandSize = 2 << 30

	sanity.GinkgoTest(&cfg)
	gomega.RegisterFailHandler(ginkgo.Fail)
	suite, reporter := ginkgo.GinkgoConfiguration()
	if f := os.Getenv("SANITY_FOCUS"); f != "" {
		suite.FocusStrings = append(suite.FocusStrings, f)
	}
	reporter.Succinct = os.Getenv("SANITY_VERBOSE") == ""
	reporter.Verbose = !reporter.Succinct
	reporter.JSONReport = filepath.Join(t.TempDir(), "sanity.json")
	ginkgo.RunSpecs(t, "vco-csi sanity", suite, reporter)
	if os.Getenv("SANITY_FOCUS") != "" {
		return
	}
	passed, problems, err := sanityreport.Check(reporter.JSONReport, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
	if passed == 0 {
		t.Fatal("the sanity report has no passed spec")
	}
}
