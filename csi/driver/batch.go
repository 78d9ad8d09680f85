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
// disks, a VM's disks) are shared: a caller joins the request for its key
// that is still gathering, never one already sent, so what it reads is at
// least as fresh as a request of its own made when it asked. A caller who
// finds no request for its key out and none gathering sends its own at
// once. Otherwise it joins the batch gathering for the key, or starts one,
// which is sent a short while after its first caller joined (the gathering
// window) whether or not the requests already out have answered, as long
// as fewer than maxOut are: no caller waits for an answer that is not its
// own while the API keeps up, and a burst costs about one round trip and a
// few requests, not N of either (docs/csi-plugin.md, "API requests").
//
// The window is an eighth of the time the key's last request took, within
// [minGather, maxGather]: a slower API is asked less often. At most maxOut
// requests for a key are out at once; a batch whose window has passed
// while that many are out still takes callers in, and leaves when one of
// them answers, so an API that stops answering is not asked more.
const (
	minGather = 8 * time.Millisecond
	maxGather = 25 * time.Millisecond
	// gatherShare is the window as a share of the last round trip.
	gatherShare = 8
	maxOut      = 8
)

// shareTimeout bounds a batch's request, which belongs to no caller's
// deadline: each caller still gives up at its own.
const shareTimeout = time.Minute

type shared[Q, R any] struct {
	mu    sync.Mutex
	next  map[string]*batch[Q, R]  // per key, the batch not yet sent
	out   map[string]int           // per key, requests sent and not answered
	took  map[string]time.Duration // per key, how long its last request took
	fetch func(ctx context.Context, key string, asks []Q) (R, error)
	// after runs f once d has passed (time.AfterFunc; tests fire it).
	after func(d time.Duration, f func())
}

type batch[Q, R any] struct {
	// ctx is the first caller's, without its deadline or cancellation:
	// the request carries that caller's values but outlives it if it
	// gives up.
	ctx  context.Context
	asks []Q
	// due: its window has passed; it leaves as soon as fewer than maxOut
	// requests for its key are out.
	due  bool
	done chan struct{}
	res  R
	err  error
}

func newShared[Q, R any](fetch func(ctx context.Context, key string, asks []Q) (R, error)) *shared[Q, R] {
	return &shared[Q, R]{next: map[string]*batch[Q, R]{}, out: map[string]int{}, took: map[string]time.Duration{}, fetch: fetch,
		after: func(d time.Duration, f func()) { time.AfterFunc(d, f) }}
}

// get asks for key. A caller who finds no request for key out and none
// gathering sends its own, under its own context, alone; otherwise it
// joins the batch not yet sent, or starts one, and waits for its answer.
func (s *shared[Q, R]) get(ctx context.Context, key string, ask Q) (R, error) {
	s.mu.Lock()
	if s.out[key] == 0 && s.next[key] == nil {
		s.out[key]++
		s.mu.Unlock()
		return s.request(ctx, key, []Q{ask})
	}
	b := s.next[key]
	if b == nil {
		b = &batch[Q, R]{ctx: context.WithoutCancel(ctx), done: make(chan struct{})}
		s.next[key] = b
		s.after(gatherWindow(s.took[key]), func() { s.windowPassed(key, b) })
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

// gatherWindow is how long a batch gathers after a request that took took.
func gatherWindow(took time.Duration) time.Duration {
	return min(max(took/gatherShare, minGather), maxGather)
}

// windowPassed marks b, the batch gathering for key, due and sends it if
// a request slot is free.
func (s *shared[Q, R]) windowPassed(key string, b *batch[Q, R]) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b.due = true
	s.sendDue(key)
}

// sendDue sends the batch of key if its window has passed and fewer than
// maxOut requests are out; s.mu is held. Taking it out of next first means
// no one joins it after its asks are read.
func (s *shared[Q, R]) sendDue(key string) {
	b := s.next[key]
	if b == nil || !b.due || s.out[key] >= maxOut {
		return
	}
	delete(s.next, key)
	s.out[key]++
	go func() {
		ctx, cancel := context.WithTimeout(b.ctx, shareTimeout)
		b.res, b.err = s.request(ctx, key, b.asks)
		cancel()
		close(b.done)
	}()
}

// request makes one request (counted in s.out by the caller), notes how
// long it took, and sends a batch that waited for it to answer.
func (s *shared[Q, R]) request(ctx context.Context, key string, asks []Q) (R, error) {
	start := time.Now()
	res, err := s.fetch(ctx, key, asks)
	took := time.Since(start)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.out[key]--
	if s.out[key] == 0 {
		delete(s.out, key)
	}
	s.took[key] = took
	s.sendDue(key)
	return res, err
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
