package driver_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/internal/location"
)

// nodeInfo asks a node service whose agent says configured for this
// node's location, with the controller's map in dir ("" for none).
func nodeInfo(t *testing.T, configured, dir string) (*csi.NodeGetInfoResponse, error) {
	t.Helper()
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode,
		Agent: identityAgent{hostUUID, configured}, NodeLocationsDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	r, err := d.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, status.Error(driver.CodeForError(err), err.Error())
	}
	return r, nil
}

// TestNodeLocationFromTheControllersMap: a node learns its location from
// the map the controller writes, by its reference_id, with no per-node
// setting; node.location is an optional override that must agree, and a
// node whose location is unknown, a placeholder or in doubt fails
// NodeGetInfo with a sentence instead of taking a wrong label.
func TestNodeLocationFromTheControllersMap(t *testing.T) {
	// The controller's side: the map it writes from the simulator's VMs.
	e := newTestEnv(t, envOpts{})
	m, err := e.drv.NodeLocationMap(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if m[hostUUID] != hostLoc {
		t.Fatalf("the controller's map says %q for this host's VM, want %s (map %v)", m[hostUUID], hostLoc, m)
	}
	dir := filepath.Join(t.TempDir(), "node-locations")
	if err := driver.WriteNodeLocationDir(dir, m); err != nil {
		t.Fatal(err)
	}

	topo := func(r *csi.NodeGetInfoResponse) string {
		return r.GetAccessibleTopology().GetSegments()[driver.TopologyKey]
	}
	// No node.location: the map's.
	r, err := nodeInfo(t, "", dir)
	if err != nil || topo(r) != hostLoc {
		t.Fatalf("NodeGetInfo without node.location: %v, %v; want location %s from the map", topo(r), err, hostLoc)
	}
	// An agreeing override.
	if r, err := nodeInfo(t, hostLoc, dir); err != nil || topo(r) != hostLoc {
		t.Fatalf("NodeGetInfo with an agreeing node.location: %v, %v", topo(r), err)
	}
	// A disagreeing one.
	_, err = nodeInfo(t, "nl-ams-1", dir)
	wantCode(t, err, codes.FailedPrecondition, "nl-ams-1", hostLoc, hostUUID, "node.location")
	// The template's placeholder, map or not.
	for _, d := range []string{dir, ""} {
		_, err = nodeInfo(t, location.Placeholder, d)
		wantCode(t, err, codes.FailedPrecondition, location.Placeholder, "placeholder", "node.location")
	}
	// The node not (yet) in the map, and no override.
	if err := os.Remove(filepath.Join(dir, hostUUID)); err != nil {
		t.Fatal(err)
	}
	_, err = nodeInfo(t, "", dir)
	wantCode(t, err, codes.FailedPrecondition, "unknown", hostUUID, driver.NodeLocationsConfigMap)
	// Not in the map, with an override: the override.
	if r, err := nodeInfo(t, hostLoc, dir); err != nil || topo(r) != hostLoc {
		t.Fatalf("NodeGetInfo with node.location and no map entry: %v, %v", topo(r), err)
	}
	// Neither a map nor node.location.
	_, err = nodeInfo(t, "", "")
	wantCode(t, err, codes.FailedPrecondition, "unknown", "node.location")
}

// TestNodeLocationMapIsWrittenWhenItChanges: the controller's loop writes
// the map at once, not again while it is the same, and again when a VM
// joins.
func TestNodeLocationMapIsWrittenWhenItChanges(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	writes := make(chan map[string]string, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.drv.RunNodeLocations(ctx, slog.New(slog.DiscardHandler), 20*time.Millisecond, func(_ context.Context, m map[string]string) error {
			writes <- m
			return nil
		})
	}()
	defer func() { cancel(); <-done }()
	first := <-writes
	if first[hostUUID] != hostLoc {
		t.Fatalf("first map %v lacks this host's VM in %s", first, hostLoc)
	}
	select {
	case m := <-writes:
		t.Fatalf("the unchanged map was written again: %v", m)
	case <-time.After(150 * time.Millisecond):
	}
	const joined = "10ad0000-0000-4000-8000-000000000001"
	if _, err := e.sim.AddVM("cs-nl-ams-1", "joined", joined, false); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-writes:
		if m[joined] != "nl-ams-1" || m[joined+driver.MaxVolumesSuffix] != "24" {
			t.Fatalf("the map after a VM joined: %v", m)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the map was not written again after a VM joined")
	}
}
