package deploy

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// testDriver is the part of the external storage suite's driver file
// (k8s.io/kubernetes test/e2e/storage/external, driverDefinition) that
// testdriver.yaml uses; strict decoding refuses any other field.
type testDriver struct {
	StorageClass  struct{ FromExistingClassName string }
	SnapshotClass struct{ FromExistingClassName string }
	DriverInfo    struct {
		Name                 string
		SupportedFsType      map[string]struct{}
		SupportedMountOption map[string]struct{}
		SupportedSizeRange   struct{ Min, Max string }
		MaxFileSize          int64
		TopologyKeys         []string
		NumAllowedTopologies int
		Capabilities         map[string]bool
		// Run parameters of the stress patterns (framework.StressTestOptions,
		// framework.VolumeSnapshotStressTestOptions).
		StressTestOptions               *struct{ NumPods, NumRestarts int }
		VolumeSnapshotStressTestOptions *struct{ NumPods, NumSnapshots int }
		// framework.PerformanceTestOptions: its metrics' AvgLatency is a
		// time.Duration, which the suite decodes from nanoseconds.
		PerformanceTestOptions *struct {
			ProvisioningOptions *struct {
				VolumeSize      string
				Count           int
				ExpectedMetrics *struct {
					AvgLatency int64
					Throughput float64
				}
			}
		}
	}
	Timeouts map[string]string
}

// suiteCapabilities are the capability names the suite of Kubernetes
// v1.34.2 knows (test/e2e/storage/framework/testdriver.go); it ignores
// any other, so a misspelt claim would pass unnoticed.
var suiteCapabilities = []string{"persistence", "block", "fsGroup", "volumeMountGroup", "exec", "snapshotDataSource",
	"groupSnapshot", "pvcDataSource", "multipods", "RWX", "controllerExpansion", "nodeExpansion", "offlineExpansion",
	"onlineExpansion", "volumeLimits", "singleNodeVolume", "topology", "capacity", "FSResizeFromSourceNotSupported",
	"readWriteOncePod", "multiplePVsSameID", "capReadOnlyMany"}

// suiteTimeouts are the fields of the framework's TimeoutContext.
var suiteTimeouts = []string{"Poll", "PodStart", "PodStartShort", "PodStartSlow", "PodDelete", "ClaimProvision",
	"DataSourceProvision", "ClaimProvisionShort", "ClaimBound", "PVReclaim", "PVBound", "PVCreate", "PVDelete",
	"PVDeleteSlow", "SnapshotCreate", "SnapshotDelete", "SnapshotControllerMetrics", "SystemPodsStartup",
	"NodeSchedulable", "SystemDaemonsetStartup", "NodeNotReady"}

func readTestDriver(t *testing.T) *testDriver {
	t.Helper()
	b, err := os.ReadFile("testdriver.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var d testDriver
	strict(t, b, &d)
	return &d
}

// TestTestDriverClaimsWhatThePluginDoes holds each capability of
// testdriver.yaml to the plugin's own answers and the add-on's objects: a
// claim the driver cannot keep fails the suite's run, and one it leaves
// out skips patterns the driver would pass.
func TestTestDriverClaimsWhatThePluginDoes(t *testing.T) {
	d := readTestDriver(t)
	controller, node := pluginCapabilities(t)
	a := decode(t, "registry.example/csi-driver:v1", "cloud.example.csi")
	cd := a.drivers[0].Spec
	caps := d.DriverInfo.Capabilities
	checkCapabilityNames(t, caps)
	must := map[string]bool{
		"controllerExpansion": controller[csi.ControllerServiceCapability_RPC_EXPAND_VOLUME],
		"nodeExpansion":       node[csi.NodeServiceCapability_RPC_EXPAND_VOLUME],
		"pvcDataSource":       controller[csi.ControllerServiceCapability_RPC_CLONE_VOLUME],
		"snapshotDataSource":  controller[csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT],
		"volumeMountGroup":    node[csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP],
		"fsGroup":             cd.FSGroupPolicy != nil && *cd.FSGroupPolicy == storagev1.FileFSGroupPolicy,
		"capacity":            controller[csi.ControllerServiceCapability_RPC_GET_CAPACITY] && cd.StorageCapacity != nil && *cd.StorageCapacity,
		// A whitesky.cloud disk is attached to one VM at a time.
		"RWX":             false,
		"capReadOnlyMany": false,
		// Every disk lives in a location; none is bound to one node.
		"singleNodeVolume": false,
		"topology":         true,
		"volumeLimits":     driver.DefaultMaxVolumesPerNode > 0,
	}
	for c, want := range must {
		if caps[c] != want {
			t.Errorf("capability %s: %v, but the plugin and the add-on say %v", c, caps[c], want)
		}
	}
	if !slices.Equal(d.DriverInfo.TopologyKeys, []string{driver.TopologyKey}) {
		t.Errorf("topology keys %v, want [%s]", d.DriverInfo.TopologyKeys, driver.TopologyKey)
	}
	if d.DriverInfo.Name != "${VCO_CSI_DRIVER_NAME}" {
		t.Errorf("driver name %q: the file is rendered like the add-on, with ${VCO_CSI_DRIVER_NAME}", d.DriverInfo.Name)
	}
	checkFilesystemsAndSizes(t, d)
	checkTimeouts(t, d)
	checkRunParameters(t, d)
}

// checkRunParameters: the stress and performance patterns get parameters
// they can run with (a pattern without them is skipped, and a zero count
// would pass having done nothing), and the performance volumes' size is
// one the driver provisions.
func checkRunParameters(t *testing.T, d *testDriver) {
	t.Helper()
	s, ss, p := d.DriverInfo.StressTestOptions, d.DriverInfo.VolumeSnapshotStressTestOptions, d.DriverInfo.PerformanceTestOptions
	if s == nil || s.NumPods < 1 || s.NumRestarts < 1 {
		t.Errorf("StressTestOptions %+v: volume-stress needs pods and restarts", s)
	}
	if ss == nil || ss.NumPods < 1 || ss.NumSnapshots < 1 {
		t.Errorf("VolumeSnapshotStressTestOptions %+v: snapshottable-stress needs pods and snapshots", ss)
	}
	if p == nil || p.ProvisioningOptions == nil || p.ProvisioningOptions.ExpectedMetrics == nil {
		t.Fatalf("PerformanceTestOptions %+v: the performance patterns need provisioning options with expected metrics", p)
	}
	po := p.ProvisioningOptions
	if po.Count < 1 || po.ExpectedMetrics.AvgLatency < int64(time.Second) || po.ExpectedMetrics.Throughput <= 0 {
		t.Errorf("performance provisioning options %+v, metrics %+v: a count, a latency of a second or more (nanoseconds) and a throughput are needed", po, *po.ExpectedMetrics)
	}
	size, err := resource.ParseQuantity(po.VolumeSize)
	min, max := resource.MustParse(d.DriverInfo.SupportedSizeRange.Min), resource.MustParse(d.DriverInfo.SupportedSizeRange.Max)
	if err != nil || size.Cmp(min) < 0 || size.Cmp(max) > 0 {
		t.Errorf("performance volume size %q (%v): outside the supported %s-%s", po.VolumeSize, err, min.String(), max.String())
	}
}

// pluginCapabilities are the controller's and the node service's
// capabilities as the plugin reports them.
func pluginCapabilities(t *testing.T) (map[csi.ControllerServiceCapability_RPC_Type]bool, map[csi.NodeServiceCapability_RPC_Type]bool) {
	t.Helper()
	ctx := context.Background()
	var zero driver.Driver
	cc, err := zero.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	controller := map[csi.ControllerServiceCapability_RPC_Type]bool{}
	for _, c := range cc.GetCapabilities() {
		controller[c.GetRpc().GetType()] = true
	}
	nc, err := zero.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	node := map[csi.NodeServiceCapability_RPC_Type]bool{}
	for _, c := range nc.GetCapabilities() {
		node[c.GetRpc().GetType()] = true
	}
	return controller, node
}

// checkCapabilityNames: every claim is one the suite knows, and every
// capability it knows is claimed or denied.
func checkCapabilityNames(t *testing.T, caps map[string]bool) {
	t.Helper()
	for c := range caps {
		if !slices.Contains(suiteCapabilities, c) {
			t.Errorf("capability %q is not one the suite knows", c)
		}
	}
	for _, c := range suiteCapabilities {
		if _, ok := caps[c]; !ok && c != "FSResizeFromSourceNotSupported" {
			t.Errorf("capability %q is neither claimed nor denied: say which", c)
		}
	}
}

// checkFilesystemsAndSizes: the agent's filesystems, whole GiB sizes.
func checkFilesystemsAndSizes(t *testing.T, d *testDriver) {
	t.Helper()
	var fs []string
	for f := range d.DriverInfo.SupportedFsType {
		fs = append(fs, f)
	}
	slices.Sort(fs)
	// The agent formats ext4 (the default, "") and xfs (agent/volume).
	if strings.Join(fs, ",") != ",ext4,xfs" {
		t.Errorf("filesystems %q, want the default, ext4 and xfs", fs)
	}
	min, err := resource.ParseQuantity(d.DriverInfo.SupportedSizeRange.Min)
	if err != nil || min.Value()%(1<<30) != 0 {
		t.Errorf("minimum size %q (%v): disks come in whole GiB", d.DriverInfo.SupportedSizeRange.Min, err)
	}
	if max, err := resource.ParseQuantity(d.DriverInfo.SupportedSizeRange.Max); err != nil || max.Cmp(min) < 0 {
		t.Errorf("maximum size %q (%v) below the minimum", d.DriverInfo.SupportedSizeRange.Max, err)
	}
}

// checkTimeouts: each is one the suite knows, each a duration (else the
// suite drops every custom timeout, silently).
func checkTimeouts(t *testing.T, d *testDriver) {
	t.Helper()
	for k, v := range d.Timeouts {
		if !slices.Contains(suiteTimeouts, k) {
			t.Errorf("timeout %q is not one the suite knows", k)
		}
		if _, err := time.ParseDuration(v); err != nil {
			t.Errorf("timeout %s: %v", k, err)
		}
	}
}

// The classes the file names are the add-on's.
func TestTestDriverClassesAreTheAddons(t *testing.T) {
	d := readTestDriver(t)
	a := decode(t, "registry.example/csi-driver:v1", "cloud.example.csi")
	var classes []string
	for _, c := range a.classes {
		classes = append(classes, c.Name)
	}
	if !slices.Contains(classes, d.StorageClass.FromExistingClassName) {
		t.Errorf("StorageClass %q is not one of csi.yaml's %v", d.StorageClass.FromExistingClassName, classes)
	}
	s := decodeSnapshots(t, "registry.example/csi-driver:v1", "cloud.example.csi")
	if got := s.snapshotClasses[0].Name; got != d.SnapshotClass.FromExistingClassName {
		t.Errorf("VolumeSnapshotClass %q, csi-snapshots.yaml's is %q", d.SnapshotClass.FromExistingClassName, got)
	}
}
