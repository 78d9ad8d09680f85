package driver

import (
	"context"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// vmRef is a VM with where it lives.
type vmRef struct {
	cloud.VM
	Cloudspace string
	Location   string
}

// vmIndex finds VMs by reference_id (a node id) and by VM id. Listing every
// cloudspace's VMs is several calls, so the answer is cached and refreshed
// when a lookup misses: a node that just joined is found on the first
// publish to it. What a hit returns does not change while the VM lives (its
// id, cloudspace and location), so hits are served for ttl; a VM call that
// answers not found drops the index (forget), for a VM deleted and made
// again under the same reference_id.
type vmIndex struct {
	api Cloud
	ttl time.Duration

	mu      sync.Mutex
	fetched time.Time
	byRef   map[string]vmRef
	byID    map[int64]vmRef
}

func newVMIndex(api Cloud) *vmIndex { return &vmIndex{api: api, ttl: 10 * time.Minute} }

// forget makes the next lookup list the VMs again.
func (x *vmIndex) forget() {
	x.mu.Lock()
	x.byRef, x.byID = nil, nil
	x.mu.Unlock()
}

func (x *vmIndex) refresh(ctx context.Context) error {
	css, err := x.api.ListCloudspaces(ctx)
	if err != nil {
		return err
	}
	byRef, byID := map[string]vmRef{}, map[int64]vmRef{}
	for _, cs := range css {
		vms, err := x.api.ListVMs(ctx, cs.ID)
		if err != nil {
			return err
		}
		for _, vm := range vms {
			r := vmRef{VM: vm, Cloudspace: cs.ID, Location: cs.Location}
			byID[vm.ID] = r
			if vm.ReferenceID != "" {
				byRef[canonicalUUID(vm.ReferenceID)] = r
			}
		}
	}
	x.byRef, x.byID, x.fetched = byRef, byID, time.Now()
	return nil
}

func (x *vmIndex) lookup(ctx context.Context, get func() (vmRef, bool)) (vmRef, bool, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.byRef != nil && time.Since(x.fetched) < x.ttl {
		if r, ok := get(); ok {
			return r, true, nil
		}
	}
	if err := x.refresh(ctx); err != nil {
		return vmRef{}, false, err
	}
	r, ok := get()
	return r, ok, nil
}

// byNode finds the VM whose reference_id is the node id.
func (x *vmIndex) byNode(ctx context.Context, nodeID string) (vmRef, bool, error) {
	key := canonicalUUID(nodeID)
	return x.lookup(ctx, func() (vmRef, bool) { r, ok := x.byRef[key]; return r, ok })
}

// knownIn says whether the VM of nodeID is kept, in location loc,
// without asking the API.
func (x *vmIndex) knownIn(nodeID, loc string) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.byRef == nil || time.Since(x.fetched) >= x.ttl {
		return false
	}
	r, ok := x.byRef[canonicalUUID(nodeID)]
	return ok && r.Location == loc
}

// byVMID finds a VM by id.
func (x *vmIndex) byVMID(ctx context.Context, id int64) (vmRef, bool, error) {
	return x.lookup(ctx, func() (vmRef, bool) { r, ok := x.byID[id]; return r, ok })
}

// all lists the VMs afresh: every VM with a reference_id, by it.
func (x *vmIndex) all(ctx context.Context) (map[string]vmRef, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if err := x.refresh(ctx); err != nil {
		return nil, err
	}
	return x.byRef, nil // replaced, never changed, by the next refresh
}
