package driver_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// TestCreateVolumeDiskTypeSpellings provisions through the simulator's API
// with the class parameters CAPVCO's classes carry (diskType: PHYSICAL),
// the older alias type, and both, and reads back the disk type the API
// was asked for.
func TestCreateVolumeDiskTypeSpellings(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	for i, c := range []struct {
		params map[string]string
		want   string
	}{
		{map[string]string{"diskType": "PHYSICAL"}, cloud.DiskTypePhysical},
		{map[string]string{"diskType": "physical"}, cloud.DiskTypePhysical},
		{map[string]string{"diskType": "STANDARD"}, cloud.DiskTypeData},
		{map[string]string{"diskType": "Standard", "iops": "500"}, cloud.DiskTypeData},
		{map[string]string{"type": "physical"}, cloud.DiskTypePhysical},
		{map[string]string{"type": "PHYSICAL"}, cloud.DiskTypePhysical},
		{map[string]string{"type": "standard"}, cloud.DiskTypeData},
		{map[string]string{"diskType": "PHYSICAL", "type": "physical"}, cloud.DiskTypePhysical},
		{map[string]string{"diskType": "STANDARD", "type": "standard"}, cloud.DiskTypeData},
		{map[string]string{}, cloud.DiskTypeData},
	} {
		resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("pvc-type-%d", i),
			VolumeCapabilities: rwo, Parameters: c.params})
		if err != nil {
			t.Fatalf("parameters %v: %v", c.params, err)
		}
		loc, id := splitID(t, resp.GetVolume().VolumeId)
		disk, err := e.api.GetDisk(ctx, loc, id)
		if err != nil {
			t.Fatal(err)
		}
		if disk.Type != c.want {
			t.Errorf("parameters %v made a %s disk, want %s", c.params, disk.Type, c.want)
		}
	}

	for _, c := range []struct {
		params map[string]string
		words  []string
	}{
		{map[string]string{"diskType": "PHYSICAL", "type": "standard"}, []string{`diskType="PHYSICAL"`, `type="standard"`, "disagree"}},
		{map[string]string{"diskType": "standard", "type": "physical"}, []string{`diskType="standard"`, `type="physical"`, "disagree"}},
		{map[string]string{"diskType": "FAST"}, []string{"diskType", "FAST", "STANDARD or PHYSICAL"}},
		{map[string]string{"type": "fast"}, []string{"type", "fast", "STANDARD or PHYSICAL"}},
		{map[string]string{"disktype": "PHYSICAL"}, []string{"unknown parameter", "disktype", "diskType"}},
	} {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-bad-type", VolumeCapabilities: rwo, Parameters: c.params})
		wantCode(t, err, codes.InvalidArgument, c.words...)
		if err := driver.ValidateParameters(c.params); err == nil {
			t.Errorf("ValidateParameters(%v) accepted what CreateVolume refuses", c.params)
		}
	}
}

// TestIOPSMinimum: a class's iops below the API's documented minimum of
// 100 is refused before the API is asked; 100 and above reach the disk.
func TestIOPSMinimum(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	for _, v := range []string{"0", "1", "99", "-100", "1e3"} {
		before := e.sim.Calls()["createDisk"]
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-iops-" + v, VolumeCapabilities: rwo,
			Parameters: map[string]string{"iops": v}})
		wantCode(t, err, codes.InvalidArgument, "iops", v, "100")
		if e.sim.Calls()["createDisk"] != before {
			t.Errorf("iops=%s reached the API", v)
		}
	}
	for _, n := range []int64{100, 2500} {
		resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("pvc-iops-%d", n), VolumeCapabilities: rwo,
			Parameters: map[string]string{"iops": fmt.Sprint(n)}})
		if err != nil {
			t.Fatalf("iops=%d: %v", n, err)
		}
		loc, id := splitID(t, resp.GetVolume().VolumeId)
		disk, err := e.api.GetDisk(ctx, loc, id)
		if err != nil || disk.IOTune == nil || int64(disk.IOTune.IOPS) != n {
			t.Errorf("iops=%d made a disk with %+v, %v", n, disk, err)
		}
	}
}
