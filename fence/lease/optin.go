package lease

import (
	"context"
	"errors"
	"log/slog"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Unfenced is the Fencer of a volume whose disk has neither reservations
// nor a lease area (it holds foreign data) and whose owner opted in, per
// volume, to using it without fencing. Nothing protects such a disk from a
// second writer; every claim says so in the log, so the opt-in is never
// silent.
type Unfenced struct {
	Device string
	// Volume is the volume that opted in.
	Volume string
	// Found is what is on the disk (ForeignError.Signature).
	Found  string
	Logger *slog.Logger
}

var _ fence.Fencer = (*Unfenced)(nil)

// NewUnfenced returns the Fencer for an opted-in foreign disk; it refuses
// without a volume name, since the opt-in belongs to one volume.
func NewUnfenced(device, volume, found string, log *slog.Logger) (*Unfenced, error) {
	if volume == "" {
		return nil, errors.New("lease: staging a disk without fencing needs the opt-in of a named volume")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Unfenced{Device: device, Volume: volume, Found: found, Logger: log}, nil
}

// Probe implements fence.Fencer.
func (u *Unfenced) Probe(context.Context) (fence.Support, error) {
	return fence.Support{Method: fence.MethodNone, Reason: "no reservations and no lease area (" + u.Found + "); used unfenced by the volume's opt-in"}, nil
}

// Acquire implements fence.Fencer: it claims nothing and logs that.
func (u *Unfenced) Acquire(context.Context, *fence.Grant) (fence.Acquired, error) {
	u.Logger.Warn("volume staged WITHOUT fencing by its explicit opt-in: nothing stops another node from writing this disk",
		"device", u.Device, "volume", u.Volume, "found", u.Found)
	return fence.Acquired{Method: fence.MethodNone}, nil
}

// Release implements fence.Fencer.
func (u *Unfenced) Release(context.Context) error {
	u.Logger.Info("unfenced volume released", "device", u.Device, "volume", u.Volume)
	return nil
}

// Check implements fence.Fencer: there is no claim that could be lost.
func (u *Unfenced) Check(context.Context) error { return nil }
