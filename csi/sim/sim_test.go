package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

func start(t *testing.T, opts sim.Options) (*sim.Server, *httptest.Server, *cloud.Client) {
	t.Helper()
	opts.Customer = "acme"
	s, err := sim.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	tok := filepath.Join(t.TempDir(), "tok")
	os.WriteFile(tok, []byte("h.p.s"), 0o600)
	c, err := cloud.New(cloud.Config{BaseURL: srv.URL + "/api/1", Customer: "acme", TokenFile: tok, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	return s, srv, c
}

func TestAdminFaultsEndpoint(t *testing.T) {
	s, srv, c := start(t, sim.Options{Seed: sim.DefaultSeed()})
	body := `{"latency":"1ms","error_rate":0,"forbid_create":true,"allow_multi_attach":true}`
	req, _ := http.NewRequest(http.MethodPut, srv.URL+"/admin/faults", strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("PUT /admin/faults: %v %v", resp, err)
	}
	if f := s.Faults(); !f.ForbidCreate || !f.AllowMultiAttach {
		t.Fatalf("faults = %+v", f)
	}
	if _, err := c.CreateDisk(context.Background(), "ch-lug-1", cloud.DiskSpec{Name: "x", SizeGiB: 1}); !errors.Is(err, cloud.ErrForbidden) {
		t.Fatalf("create under forbid_create: %v", err)
	}
}

func TestMultiAttachFault(t *testing.T) {
	s, _, c := start(t, sim.Options{Seed: sim.DefaultSeed()})
	ctx := context.Background()
	id, err := c.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: "shared", SizeGiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	vms, _ := c.ListVMs(ctx, "cs-ch-lug-1")
	if err := c.AttachDisk(ctx, "cs-ch-lug-1", vms[0].ID, id); err != nil {
		t.Fatal(err)
	}
	if err := c.AttachDisk(ctx, "cs-ch-lug-1", vms[1].ID, id); !errors.Is(err, cloud.ErrConflict) {
		t.Fatalf("second attach without the fault: %v", err)
	}
	s.SetFaults(sim.Faults{AllowMultiAttach: true})
	if err := c.AttachDisk(ctx, "cs-ch-lug-1", vms[1].ID, id); err != nil {
		t.Fatalf("second attach with the fault: %v", err)
	}
	for _, vm := range vms[:2] {
		if d, _ := c.ListVMDisks(ctx, "cs-ch-lug-1", vm.ID); len(d) != 1 || d[0].ID != id {
			t.Fatalf("VM %d disks = %+v", vm.ID, d)
		}
	}
}

func TestAddVMThroughAdmin(t *testing.T) {
	_, srv, c := start(t, sim.Options{Seed: sim.DefaultSeed()})
	b, _ := json.Marshal(map[string]any{"cloudspace_id": "cs-nl-ams-1", "name": "node-a", "reference_id": "8B2F0C1E-0000-4000-8000-0000000000AA"})
	resp, err := http.Post(srv.URL+"/admin/vms", "application/json", bytes.NewReader(b))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("POST /admin/vms: %v %v", resp, err)
	}
	vms, _ := c.ListVMs(context.Background(), "cs-nl-ams-1")
	var found bool
	for _, v := range vms {
		// The platform reports reference_id in lower case.
		found = found || (v.Name == "node-a" && v.ReferenceID == "8b2f0c1e-0000-4000-8000-0000000000aa")
	}
	if !found {
		t.Fatalf("vms = %+v", vms)
	}
}

// TestHostBackendLoopDevice attaches a disk to the VM standing for this
// machine and checks that a real loop device backs it, grows with it and
// goes away on detach.
func TestHostBackendLoopDevice(t *testing.T) {
	hosttest.NeedRoot(t, "loop devices need root")
	dir := t.TempDir()
	seed := sim.DefaultSeed()
	seed.HostVM.ReferenceID = "11111111-2222-4333-8444-555555555555"
	hb := &sim.HostBackend{Dir: dir}
	s, _, c := start(t, sim.Options{Seed: seed, Backend: hb})
	ctx := context.Background()
	id, err := c.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: "loop", SizeGiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	// Asked 1 GiB, the create call is given 2 GB (its documented unit).
	st, err := os.Stat(hb.DiskFile(id))
	if err != nil || st.Size() != 2_000_000_000 {
		t.Fatalf("disk file: %v %v", st, err)
	}
	var host cloud.VM
	vms, _ := c.ListVMs(ctx, "cs-ch-lug-1")
	for _, v := range vms {
		if v.ReferenceID == seed.HostVM.ReferenceID {
			host = v
		}
	}
	if err := c.AttachDisk(ctx, "cs-ch-lug-1", host.ID, id); err != nil {
		t.Fatal(err)
	}
	dev := s.Device(id)
	if !strings.HasPrefix(dev, "/dev/loop") {
		t.Fatalf("device = %q", dev)
	}
	t.Cleanup(func() { _ = hb.Detach(&sim.VMState{Local: true}, id, dev) })
	name := filepath.Base(dev)
	back, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file")
	if err != nil || strings.TrimSpace(string(back)) != hb.DiskFile(id) {
		t.Fatalf("backing file of %s = %q, %v", dev, back, err)
	}
	if err := c.ResizeDisk(ctx, "ch-lug-1", id, 3); err != nil {
		t.Fatal(err)
	}
	sz, _ := os.ReadFile("/sys/block/" + name + "/size")
	if strings.TrimSpace(string(sz)) != "6291456" {
		t.Fatalf("%s has %s sectors after resize to 3 GiB", dev, sz)
	}
	if err := c.DetachDisk(ctx, "cs-ch-lug-1", host.ID, id); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file"); err == nil && strings.TrimSpace(string(b)) == hb.DiskFile(id) {
		t.Fatalf("%s still backed by the disk after detach", dev)
	}
	// Snapshot and clone copy the data, sparsely.
	f, _ := os.OpenFile(hb.DiskFile(id), os.O_WRONLY, 0)
	f.WriteAt([]byte("payload"), 4096)
	f.Close()
	snap, err := c.CreateSnapshot(ctx, "ch-lug-1", id, "s")
	if err != nil {
		t.Fatal(err)
	}
	clone, err := c.CloneSnapshot(ctx, "ch-lug-1", id, snap, "c", "")
	if err != nil {
		t.Fatal(err)
	}
	g, _ := os.Open(hb.DiskFile(clone))
	buf := make([]byte, 7)
	g.ReadAt(buf, 4096)
	g.Close()
	if string(buf) != "payload" {
		t.Fatalf("clone holds %q", buf)
	}
}

// TestConcurrentChangesAreAllSaved: changes made side by side share
// writes of the state file, and every change that was answered is in it:
// a simulator started again from the file has them all, and the VM added
// beside them.
func TestConcurrentChangesAreAllSaved(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state.json")
	s, _, c := start(t, sim.Options{Seed: sim.DefaultSeed(), StateFile: state})
	ctx := context.Background()
	const n = 40
	ids := make(chan int64, n)
	errs := make(chan error, n+1)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, err := c.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: fmt.Sprintf("d%d", i), SizeGiB: 1})
			if err != nil {
				errs <- err
				return
			}
			ids <- id
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := s.AddVM("cs-ch-lug-1", "late", "be0c0000-0000-4000-8000-000000000099", false); err != nil {
			errs <- err
		}
	}()
	wg.Wait()
	close(ids)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	again, err := sim.New(sim.Options{Customer: "acme", StateFile: state})
	if err != nil {
		t.Fatal(err)
	}
	st := again.Snapshot()
	for id := range ids {
		if st.Disks[id] == nil {
			t.Errorf("disk %d was answered but is not in the saved state", id)
		}
	}
	if len(st.Disks) != n {
		t.Errorf("the saved state has %d disks, want %d", len(st.Disks), n)
	}
	found := false
	for _, vm := range st.VMs {
		found = found || vm.Name == "late"
	}
	if !found {
		t.Error("the VM added beside the disks is not in the saved state")
	}
}
