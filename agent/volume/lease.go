package volume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// LeaseOptions configure the on-disk lease (package fence/lease) for
// disks without reservations.
type LeaseOptions struct {
	Key      fence.Key
	Node     string // SMBIOS UUID; grants must name it
	NodeName string // written into our slot so other nodes can name us
	Resolver fence.Resolver
	// Timing; the zero value is lease.DefaultTiming().
	Timing lease.Timing
	Log    *slog.Logger
}

// NewLease returns the LeaseFactory of the on-disk lease: a disk that is
// blank (the lease area is written by Prepare, before the first claim) or
// already carries a lease area is fenced by it, with the volume's data
// from lease.DataOffset; a disk with any other layout gets no fencer and
// is never formatted.
func NewLease(o LeaseOptions) LeaseFactory {
	if o.Timing == (lease.Timing{}) {
		o.Timing = lease.DefaultTiming()
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	return o.choose
}

// choose is the LeaseFactory of o: the disk's layout decides whether the
// lease fences it at all, then the engine is made over its descriptor.
func (o LeaseOptions) choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	ld, err := lease.OpenDevice(dev.Path)
	if err != nil {
		return Choice{}, err
	}
	cls, proof, err := o.classify(ctx, ld, dev.Path, volume != LookOnly)
	if err != nil {
		ld.Close()
		return Choice{}, err
	}
	if cls.Layout != lease.LayoutBlank && cls.Layout != lease.LayoutLease {
		ld.Close()
		return Choice{Method: fence.MethodNone, Reason: fmt.Sprintf("the disk holds %s, not a lease area, and is never formatted with one", cls.Signature)}, nil
	}
	f := &leaseFencer{dev: ld, key: o.Key, timing: o.Timing, log: o.Log.With("volume", volume)}
	f.Engine, err = lease.New(ld, lease.Config{Key: o.Key, Node: o.Node, NodeName: o.NodeName, Disk: volume, Serial: dev.Serial, Resolver: o.Resolver,
		Timing: o.Timing, OnLost: f.lost(onLost), Verify: f.verify(dev), Logger: f.log})
	if err != nil {
		ld.Close()
		return Choice{}, err
	}
	ch := Choice{Fencer: f, Method: fence.MethodLease, DataOffset: lease.DataOffset}
	switch {
	case volume == LookOnly && cls.Layout == lease.LayoutBlank:
		// Not proven: the stage that claims the disk proves it.
		ch.Reason = "no lease area yet: zeros where it would be; the disk is proven blank before the first stage writes one"
	case volume != LookOnly:
		ch.Prepare = func(ctx context.Context) (bool, error) {
			return lease.Format(ctx, ld, lease.FormatOptions{Key: o.Key, Timeout: o.Timing.IOTimeout, Logger: o.Log, Proof: proof})
		}
	}
	return ch, nil
}

// classify reads the disk's lease layout. Zeros in the first and last MiB
// are not yet blank: a disk the blank proof refuses is foreign, and the
// lease area is written only on one it passes. Prepare hands the proof to
// the format, which takes it only while it is recent and reads its zero
// regions again right before it writes (lease.FormatOptions.Proof). A
// look (prove false) reads the layout alone. A stage reads the first
// block: a lease header, or anything else there, decides at once; a disk
// whose first block is zeros is proven blank, as the proof reads all the
// layout would. A proof whose blkid could not answer (missing, an
// ambivalent probe) proves nothing, but data the layout read finds in the
// first or last MiB still makes the disk foreign, a refusal that needs no
// blkid (data only past the first MiB leaves the stage to retry).
func (o LeaseOptions) classify(ctx context.Context, ld *lease.Device, path string, prove bool) (lease.Classification, blank.Proof, error) {
	if !prove {
		cls, err := lease.ReadLayout(ctx, ld, o.Timing.IOTimeout)
		return cls, blank.Proof{}, err
	}
	cls, err := lease.ClassifyFirstBlock(ctx, ld, o.Timing.IOTimeout)
	if err != nil || cls.Layout != lease.LayoutBlank {
		return cls, blank.Proof{}, err
	}
	if testHookBeforeStageProof != nil {
		testHookBeforeStageProof(path)
	}
	proof, err := blank.Prove(ctx, path)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb):
		// Another node given the same blank disk (a platform that
		// attached it to two VMs) may have written its lease area since
		// the first block was read: a lease area, to be acquired or
		// refused by its holder, not foreign data.
		if again, aerr := lease.ClassifyFirstBlock(ctx, ld, o.Timing.IOTimeout); aerr == nil && again.Layout == lease.LayoutLease {
			return again, blank.Proof{}, nil
		}
		return lease.Classification{Layout: lease.LayoutForeign, Signature: nb.Found}, blank.Proof{}, nil
	case err != nil:
		// A lease area written meanwhile (as above) is one too.
		if cls, lerr := lease.ReadLayout(ctx, ld, o.Timing.IOTimeout); lerr == nil && cls.Layout != lease.LayoutBlank {
			return cls, blank.Proof{}, nil
		}
		return lease.Classification{}, blank.Proof{}, err
	}
	return lease.Classification{Layout: lease.LayoutBlank}, proof, nil
}

// testHookBeforeStageProof runs, in tests, between a stage's read of the
// first block and its blank proof.
var testHookBeforeStageProof func(path string)

// lost is the engine's OnLost: the manager's onLost, with the fencer's
// loss state kept for Close. A closed fencer's engine is no longer the
// claim's: its renewals fail on the closed descriptor, which is no loss,
// and nothing is acknowledged.
func (f *leaseFencer) lost(onLost func(*fence.LostError) bool) func(*fence.LostError) bool {
	return func(l *fence.LostError) bool {
		if f.closed.Load() || onLost == nil {
			return false
		}
		f.loss.Store(lossStopping)
		stopped := onLost(l)
		f.loss.Store(lossOutcome(stopped))
		return stopped
	}
}

// verify is the engine's Verify: the device is still the claim's disk.
func (f *leaseFencer) verify(dev *Device) func(context.Context) error {
	return func(ctx context.Context) error {
		if f.closed.Load() {
			return errFencerClosed
		}
		if dev.Verify == nil {
			return nil
		}
		return dev.Verify(ctx)
	}
}

// leaseFencer is the lease engine with what the manager needs besides
// fence.Fencer: its O_DIRECT descriptor closed with the claim, and the
// resumption of a claim recorded before an agent restart.
type leaseFencer struct {
	*lease.Engine
	dev    *lease.Device
	key    fence.Key
	timing lease.Timing
	log    *slog.Logger
	closed atomic.Bool
	// loss is what became of a lost claim's I/O, for the host watchdog.
	loss atomic.Int32
}

// errFencerClosed stops the engine from touching the disk once closed.
var errFencerClosed = errors.New("the lease fencer is closed")

// Close stops the renewals and closes the device without releasing: the
// claim stays recorded on the disk for the next agent process to resume
// (the agent closes its fencers when it stops). Its last renewal comes
// now (Handoff), so that the next process finds the record as young as it
// can be (docs/upgrade.md). The engine's Release then finds no renewer
// left to stop; with the fencer marked closed its verify step fails, so
// it writes nothing.
func (f *leaseFencer) Close() error {
	if err := f.Engine.Handoff(context.Background()); err != nil {
		f.log.Warn("the lease was not renewed once more before the agent stops; the next agent resumes it from its last renewal", "err", err)
	}
	f.closed.Store(true)
	_ = f.Engine.Release(context.Background())
	return f.dev.Close()
}

// Holder reads who owns the lease, for listings and the uevent watcher:
// nobody on a disk without a lease area yet (a blank one, which the watcher
// took for a disk it could not check, an error in the log at every new
// volume's hot-plug).
func (f *leaseFencer) Holder(ctx context.Context) (*lease.Slot, error) {
	st, _, err := lease.ReadStatus(ctx, f.dev, f.key, f.timing.IOTimeout)
	if errors.Is(err, lease.ErrNoLease) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return st.Owner, nil
}

// Resume takes back, after an agent restart, a claim this node recorded
// (lease.Engine.Resume has the rule).
func (f *leaseFencer) Resume(ctx context.Context) error { return f.Engine.Resume(ctx) }

// resumer is a fencer whose claim must be taken back explicitly after an
// agent restart before it can be checked (the lease renews from a timer
// of the process that holds it; reservations need nothing).
type resumer interface {
	Resume(ctx context.Context) error
}
