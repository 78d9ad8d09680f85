package volume

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// releaseWatch wraps a fencer factory so that each fencer runs check
// before it releases: the test sees what the disk holds at that moment.
type releaseWatch struct {
	FencerFactory
	check func()
}

type watchedFencer struct {
	fence.Fencer
	check func()
}

func (w watchedFencer) Release(ctx context.Context) error {
	w.check()
	return w.Fencer.Release(ctx)
}

func (w watchedFencer) Close() error {
	if c, ok := w.Fencer.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

func (r releaseWatch) Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	ch, err := r.FencerFactory.Choose(ctx, dev, volume, onLost)
	if ch.Fencer != nil {
		ch.Fencer = watchedFencer{Fencer: ch.Fencer, check: r.check}
	}
	return ch, err
}

// A raw block volume on a lease disk is written through the data mapping,
// a buffered loop device over the disk: the pod's writes can sit as dirty
// pages of the disk after the pod closed the device. Unstage releases the
// lease only once they are on the disk (here: in its backing file).
func TestRawBlockLeaseUnstageFlushesBeforeTheRelease(t *testing.T) {
	needRoot(t)
	e := fencedLeaseEnv(t, nodeA, "node-a")
	img, _ := loop(t, 64)
	pattern := bytes.Repeat([]byte("written by the pod before unstage "), 1<<14)
	var atRelease []byte
	e.fencers = releaseWatch{FencerFactory: e.fencers, check: func() {
		f, err := os.Open(img)
		if err != nil {
			t.Error(err)
			return
		}
		defer f.Close()
		atRelease = make([]byte, len(pattern))
		if _, err := f.ReadAt(atRelease, lease.DataOffset); err != nil {
			t.Error(err)
		}
	}}
	e.start()
	ctx := context.Background()
	req := StageRequest{Volume: "vol-rb", Locator: Locator{BackingFile: img}, StagingPath: e.blockStaging("rb"), Block: true}
	res, err := e.m.Stage(ctx, req)
	if err != nil || res.Method != fence.MethodLease {
		t.Fatalf("stage: %+v %v", res, err)
	}
	f, err := os.OpenFile(res.Device, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(pattern); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := e.m.Unstage(ctx, "vol-rb", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if atRelease == nil {
		t.Fatal("the lease was not released through the fencer")
	}
	if !bytes.Equal(atRelease, pattern) {
		t.Fatal("the lease was released while the pod's writes were not on the disk yet")
	}
}

// A flush that fails keeps the claim: nothing is released, and the retry
// releases once the flush works.
func TestRawBlockUnstageDoesNotReleaseWhenTheFlushFails(t *testing.T) {
	needRoot(t)
	e := fencedLeaseEnv(t, nodeA, "node-a")
	img, _ := loop(t, 64)
	released := 0
	e.fencers = releaseWatch{FencerFactory: e.fencers, check: func() { released++ }}
	e.start()
	ctx := context.Background()
	req := StageRequest{Volume: "vol-rf", Locator: Locator{BackingFile: img}, StagingPath: e.blockStaging("rf"), Block: true}
	if _, err := e.m.Stage(ctx, req); err != nil {
		t.Fatal(err)
	}
	real := flushDevice
	t.Cleanup(func() { flushDevice = real })
	for _, failing := range []string{"/dev/loop", ""} {
		// The data mapping fails first, then (the mapping passing) the disk.
		calls := 0
		flushDevice = func(f *os.File) error {
			calls++
			if failing == "" && calls == 1 {
				return real(f)
			}
			return errors.New("injected: I/O error")
		}
		err := e.m.Unstage(ctx, "vol-rf", req.StagingPath)
		wantCode(t, err, codes.Unavailable, "nothing was released", "injected")
		if c, _ := e.m.Store().Get("vol-rf"); c == nil || c.Phase != PhaseStaged || released != 0 {
			t.Fatalf("after a failed flush: claim %+v, released %d times", c, released)
		}
	}
	flushDevice = real
	if err := e.m.Unstage(ctx, "vol-rf", req.StagingPath); err != nil {
		t.Fatal(err)
	}
	if c, _ := e.m.Store().Get("vol-rf"); c != nil || released != 1 {
		t.Fatalf("after the retry: claim %+v, released %d times", c, released)
	}
}
