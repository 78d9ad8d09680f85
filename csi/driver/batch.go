package driver

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// Reads that many concurrent calls make of the same thing (a location's
// disks, a VM's disks) are shared: a caller joins the next request for its
// key, never one already sent, so what it reads is at least as fresh as a
// request of its own made when it asked. While one request for a key is
// out, everyone who asks waits for the next, which starts when the first
// answers; a burst of N callers costs two or three requests, not N
// (docs/csi-plugin.md, "API requests").

// shareTimeout bounds a shared request, which belongs to no caller's
// deadline: each caller still gives up at its own.
const shareTimeout = time.Minute

type shared[Q, R any] struct {
	mu      sync.Mutex
	next    map[string]*batch[Q, R] // per key, the batch not yet sent
	running map[string]bool         // per key, whether a batch is out
	fetch   func(ctx context.Context, key string, asks []Q) (R, error)
}

type batch[Q, R any] struct {
	asks []Q
	done chan struct{}
	res  R
	err  error
}

func newShared[Q, R any](fetch func(ctx context.Context, key string, asks []Q) (R, error)) *shared[Q, R] {
	return &shared[Q, R]{next: map[string]*batch[Q, R]{}, running: map[string]bool{}, fetch: fetch}
}

// get asks for key. When no request for key is out, the caller sends
// its own, under its own context, alone; otherwise it joins the next batch
// and waits for its answer.
func (s *shared[Q, R]) get(ctx context.Context, key string, ask Q) (R, error) {
	s.mu.Lock()
	if !s.running[key] {
		s.running[key] = true
		s.mu.Unlock()
		res, err := s.fetch(ctx, key, []Q{ask})
		s.handOn(key)
		return res, err
	}
	b := s.next[key]
	if b == nil {
		b = &batch[Q, R]{done: make(chan struct{})}
		s.next[key] = b
	}
	b.asks = append(b.asks, ask)
	s.mu.Unlock()
	select {
	case <-b.done:
		return b.res, b.err
	case <-ctx.Done():
		select {
		case <-b.done: // answered as the caller gave up: the answer stands
			return b.res, b.err
		default:
		}
		var zero R
		return zero, ctx.Err()
	}
}

// handOn sends the batch that gathered while a request for key was out,
// or notes that none is out any more. A batch is taken out of next before
// it is sent, so no one joins it after its asks are read.
func (s *shared[Q, R]) handOn(key string) {
	s.mu.Lock()
	b := s.next[key]
	delete(s.next, key)
	if b == nil {
		delete(s.running, key)
	}
	s.mu.Unlock()
	if b != nil {
		go s.run(key, b)
	}
}

// run sends a batch. It belongs to no one caller, so it has a context of
// its own; each caller still stops waiting at its own deadline.
func (s *shared[Q, R]) run(key string, b *batch[Q, R]) {
	ctx, cancel := context.WithTimeout(context.Background(), shareTimeout)
	b.res, b.err = s.fetch(ctx, key, b.asks)
	cancel()
	close(b.done)
	s.handOn(key)
}

// diskReads shares reads of disks by location: a lone caller's read of
// one disk is that disk's own GET, anything else one listing of the
// location. An ask is a disk id, or 0 for a lookup by name.
type diskReads struct {
	s *shared[int64, []cloud.Disk]
}

func newDiskReads(api Cloud) *diskReads {
	return &diskReads{s: newShared(func(ctx context.Context, loc string, ids []int64) ([]cloud.Disk, error) {
		if len(ids) == 1 && ids[0] != 0 {
			d, err := api.GetDisk(ctx, loc, ids[0])
			if err != nil {
				return nil, err
			}
			return []cloud.Disk{*d}, nil
		}
		return api.ListDisks(ctx, loc)
	})}
}

// byID reads one disk. A disk the location's listing does not show is not
// found, as its own GET would say.
func (r *diskReads) byID(ctx context.Context, loc string, id int64) (*cloud.Disk, error) {
	disks, err := r.s.get(ctx, loc, id)
	if err != nil {
		return nil, err
	}
	for i := range disks {
		if disks[i].ID == id {
			d := disks[i]
			return &d, nil
		}
	}
	return nil, &cloud.APIError{Op: "get", Target: fmt.Sprintf("disk %d in location %s", id, loc),
		Message: "the location's disks do not include it", Kind: cloud.ErrNotFound}
}

// byName finds the live disk of that name, or nil.
func (r *diskReads) byName(ctx context.Context, loc, name string) (*cloud.Disk, error) {
	disks, err := r.s.get(ctx, loc, 0)
	if err != nil {
		return nil, err
	}
	for i := range disks {
		if disks[i].Name == name {
			d := disks[i]
			return &d, nil
		}
	}
	return nil, nil
}

// vmDiskReads shares reads of a VM's disk list.
type vmDiskReads struct {
	s *shared[struct{}, []cloud.VMDisk]
}

func newVMDiskReads(api Cloud) *vmDiskReads {
	return &vmDiskReads{s: newShared(func(ctx context.Context, key string, _ []struct{}) ([]cloud.VMDisk, error) {
		id, cs, _ := strings.Cut(key, "/")
		vm, err := strconv.ParseInt(id, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("internal: VM key %q", key)
		}
		return api.ListVMDisks(ctx, cs, vm)
	})}
}

// list reads the VM's disks.
func (r *vmDiskReads) list(ctx context.Context, vm vmRef) ([]cloud.VMDisk, error) {
	return r.s.get(ctx, strconv.FormatInt(vm.ID, 10)+"/"+vm.Cloudspace, struct{}{})
}
