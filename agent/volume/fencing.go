package volume

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// fence.MethodLease names the on-disk lease in claims and listings.

// Choice is the fencing a factory picked for a disk.
type Choice struct {
	// Fencer is nil when the disk supports no method the agent has.
	Fencer fence.Fencer
	Method fence.Method
	// Reason says why there is no fencer, for the refusal's text.
	Reason string
	// DataOffset, when not 0, is where the volume's data begins: the
	// method keeps metadata before it (the lease area). The manager then
	// stages the volume on a mapping of the disk from that offset.
	DataOffset int64
	// Prepare, when set, runs before the first Acquire of a stage: it
	// writes the method's metadata on a blank disk (never over data) and
	// reports whether it wrote anything.
	Prepare func(ctx context.Context) (wrote bool, err error)
}

// FencerFactory chooses how a disk is fenced. Choose must not change
// anything on the disk. onLost is for fencers that notice a loss by
// themselves (the lease's renewal timer): they call it, from any
// goroutine, the moment the claim is lost, and the manager stops I/O.
// volume is LookOnly when the choice is made only to see who holds the
// disk.
type FencerFactory interface {
	Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error)
}

// LookOnly is the volume of a Choose made only to see who holds a disk
// (the uevent watcher's Classify, a listing): nothing is staged from that
// choice, so a factory leaves out what only a stage needs. The lease does
// not prove a blank disk blank then: the proof reads 6 MiB and runs blkid,
// and the watcher classifies under the lock a stage records its claim
// under, so a disk hot-plugged for a stage was proven twice, one proof
// waiting for the other (docs/benchmarks.md). A disk with a lease area
// is read as ever; one without has no holder to name either way.
const LookOnly = ""

// LeaseFactory makes the on-disk lease fencer (package fence/lease) for a
// disk without reservations: Fencer, Method (fence.MethodLease), DataOffset and
// Prepare (format the lease area on a blank disk) set; or no Fencer and a
// Reason when the disk cannot carry a lease (a foreign layout).
type LeaseFactory func(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error)

// Fencing is the agent's FencerFactory: SCSI-3 PR when the disk's target
// supports it, else the lease when one is plugged in, else nothing; of
// these, only the methods Use allows claim a disk for a stage.
type Fencing struct {
	Key      fence.Key
	Node     string
	Resolver fence.Resolver
	Lease    LeaseFactory
	Log      *slog.Logger
	// Use says whether this agent claims disks with a method
	// (volumes.fence_methods); nil uses every method. A look (LookOnly)
	// reads every method regardless: another node's claim is seen and
	// refused whichever methods this one uses.
	Use func(fence.Method) bool
}

// Choose implements FencerFactory.
func (f *Fencing) Choose(ctx context.Context, dev *Device, volume string, onLost func(*fence.LostError) bool) (Choice, error) {
	t := dev.SCSI
	if t == nil {
		// Not SCSI as far as sysfs knows; SG_IO on the node says so
		// precisely (a virtio-blk or loop device rejects it).
		t = scsi.NewSGIO(dev.File)
	}
	e, err := pr.New(dev.Path, t, pr.Config{Key: f.Key, Node: f.Node, Disk: volume, Resolver: f.Resolver,
		Logger: f.Log, Verify: dev.Verify})
	if err != nil {
		return Choice{}, err
	}
	sup, err := e.Probe(ctx)
	if err != nil {
		return Choice{}, fmt.Errorf("probing %s for persistent reservations: %w", dev.Path, err)
	}
	pr := "no persistent reservations (" + sup.Reason + ")"
	if sup.Method == fence.MethodPR {
		if f.uses(volume, fence.MethodPR) {
			return Choice{Fencer: e, Method: fence.MethodPR}, nil
		}
		pr = "persistent reservations, which this agent does not use (volumes.fence_methods)"
	}
	var reason string
	switch {
	case f.Lease == nil:
		reason = pr + ", and this agent has no on-disk lease"
	case !f.uses(volume, fence.MethodLease):
		if err := refuseLeaseArea(ctx, dev); err != nil {
			return Choice{}, err
		}
		reason = pr + ", and this agent does not use the on-disk lease (volumes.fence_methods)"
	default:
		ch, err := f.Lease(ctx, dev, volume, onLost)
		if err != nil {
			return Choice{}, fmt.Errorf("%s, and the lease could not be set up: %w", pr, err)
		}
		if ch.Fencer != nil {
			return ch, nil
		}
		reason = pr + ", and no lease: " + ch.Reason
	}
	return Choice{Method: fence.MethodNone, Reason: reason}, nil
}

// uses reports whether a choice for volume may claim with method m.
func (f *Fencing) uses(volume string, m fence.Method) bool {
	return volume == LookOnly || f.Use == nil || f.Use(m)
}

// refuseLeaseArea refuses, for an agent that does not claim disks with
// the lease, a disk that carries a lease area: a node that uses the lease
// may hold it, and only the lease can tell (P2). Its data is never staged
// unfenced.
func refuseLeaseArea(ctx context.Context, dev *Device) error {
	ld, err := lease.OpenDeviceReadOnly(dev.Path)
	if err != nil {
		return err
	}
	defer ld.Close()
	cls, err := lease.ReadLayout(ctx, ld, lease.DefaultTiming().IOTimeout)
	if err != nil {
		return fmt.Errorf("reading whether %s carries a lease area: %w", dev.Path, err)
	}
	if cls.Layout == lease.LayoutLease {
		return agenterr.New(agenterr.FailedPrecondition,
			"disk %s carries a lease area: a node that fences with the on-disk lease may hold it, and this agent does not use the lease (volumes.fence_methods), so it neither reads who holds it nor stages it; add disk-lease to volumes.fence_methods, or clear the lease on the node that held it (vco-agent lease clear)", dev.Path)
	}
	return nil
}
