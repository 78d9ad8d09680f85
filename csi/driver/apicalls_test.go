package driver_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/csi/sim"
)

// TestCreatePublishAPIRequests holds CreateVolume + ControllerPublishVolume
// to its API budget (docs/csi-plugin.md, "API requests"): 40 volumes made
// and published at once to four VMs cost at most 5 requests each, one note
// write each, and the VMs are listed once, not per publish. (The bare
// calls are 3: create, attach, list the VM's disks.)
func TestCreatePublishAPIRequests(t *testing.T) {
	const n, vmCount = 40, 4
	e := newTestEnv(t, envOpts{attach: 30 * time.Second})
	ctx := context.Background()
	var refs []string
	for i := range vmCount {
		ref := fmt.Sprintf("ca11c000-0000-4000-8000-%012d", i)
		if _, err := e.sim.AddVM("cs-"+hostLoc, fmt.Sprintf("calls-%d", i), ref, false); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	// Each request takes a little while, as against a real API, so that
	// the calls overlap as they would.
	e.sim.SetFaults(sim.Faults{Latency: sim.Duration(2 * time.Millisecond)})
	before := e.sim.Calls()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("calls-%d", i), VolumeCapabilities: rwo})
			if err != nil {
				errs <- err
				return
			}
			_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
				VolumeId: v.Volume.VolumeId, NodeId: refs[i%vmCount], VolumeCapability: rwo[0]})
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	after := e.sim.Calls()
	diff := map[string]int{}
	total := 0
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			diff[k] = d
			total += d
		}
	}
	t.Logf("%d volumes: %d requests (%.2f per volume): %v", n, total, float64(total)/n, diff)
	if total > 5*n {
		t.Errorf("%d requests for %d volumes, %.2f each; the budget is 5", total, n, float64(total)/n)
	}
	if w := diff["createDiskNote"] + diff["updateDiskNote"]; w != n {
		t.Errorf("%d note writes for %d first publishes, want one each", w, n)
	}
	if cs := len(e.sim.Snapshot().Cloudspaces); diff["listCloudspaceVirtualMachines"] > cs || diff["listCloudspaces"] > 1 {
		t.Errorf("the VMs of %d cloudspaces were listed %d times (the cloudspaces %d); the node's VM is looked up once and kept",
			cs, diff["listCloudspaceVirtualMachines"], diff["listCloudspaces"])
	}
	if diff["getDiskNotes"] != n {
		t.Errorf("the notes were read %d times for %d publishes, want once each", diff["getDiskNotes"], n)
	}
}
