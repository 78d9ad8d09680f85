package lease

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// ReadLayout reads the first and last MiB of the device and classifies
// them. A disk smaller than twice the area is too small for a volume.
func ReadLayout(ctx context.Context, d *Device, timeout time.Duration) (Classification, error) {
	if err := d.bigEnough(); err != nil {
		return Classification{}, err
	}
	head, err := d.read(ctx, 0, AreaSize, timeout)
	if err != nil {
		return Classification{}, err
	}
	tailOff := d.size - AreaSize
	tailOff -= tailOff % BlockSize
	tail, err := d.read(ctx, tailOff, AreaSize, timeout)
	if err != nil {
		return Classification{}, err
	}
	return Classify(head, tail), nil
}

// ClassifyFirstBlock reads the device's first block and classifies it
// alone (Classify): LayoutLease for a lease header, LayoutForeign for a
// signature or any other byte that is not zero there, and LayoutBlank
// when it is zeros, which says nothing of the rest of the disk. It is
// what a stage reads before it proves such a disk blank (blank.Prove reads
// all that ReadLayout would, and more). A disk smaller than twice the
// area is too small for a volume, as for ReadLayout.
func ClassifyFirstBlock(ctx context.Context, d *Device, timeout time.Duration) (Classification, error) {
	if err := d.bigEnough(); err != nil {
		return Classification{}, err
	}
	b, err := d.read(ctx, 0, BlockSize, timeout)
	if err != nil {
		return Classification{}, err
	}
	return Classify(b, nil), nil
}

// bigEnough refuses a device too small for a lease volume.
func (d *Device) bigEnough() error {
	if d.size < 2*AreaSize {
		return fmt.Errorf("%s: %d bytes is too small for a lease volume (at least %d)", d.name, d.size, 2*AreaSize)
	}
	return nil
}

// FormatOptions are the inputs of Format.
type FormatOptions struct {
	// Key is the formatting node's fence key (recorded as the creator).
	Key fence.Key
	// Timeout bounds each I/O; zero means DefaultTiming's.
	Timeout time.Duration
	// Blkid is no longer a choice: the blank proof Format requires always
	// asks `blkid -p`. The field stays for the callers that still set it.
	Blkid  bool
	Logger *slog.Logger
	// Proof, if valid, is the caller's proof that the whole device was
	// blank, made moments before (the agent's stage proves a disk blank
	// to choose the lease for it). Format takes it when it is of this
	// device (its path, naming the same device as when it was proven)
	// and at most 5 s old (proofReuse): the proof's zero checks
	// are read again (blank.Recheck), its signature checks (blkid) are
	// not run again. Any other proof is ignored and the disk is proven
	// again.
	Proof blank.Proof
}

// proofReuse is how old a caller's blank proof may be for Format to take
// it (FormatOptions.Proof): the stage that made it is still running.
var proofReuse = 5 * time.Second

// ForeignError refuses to format a disk that holds anything but zeros.
type ForeignError struct {
	Device    string
	Signature string
}

func (e *ForeignError) Error() string {
	return fmt.Sprintf("%s holds data (%s) and has no reservation support: it is not formatted with a lease; "+
		"wipe it if the data is not needed, or stage it unfenced with the volume's explicit opt-in", e.Device, e.Signature)
}

// Format writes a lease area on a blank disk. It refuses every disk that
// is not blank (P5: nothing is written over data we did not create) and
// leaves an existing lease area alone (a retried stage formats nothing).
// It reports whether it wrote the header.
func Format(ctx context.Context, d *Device, o FormatOptions) (bool, error) {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTiming().IOTimeout
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if p, ok := o.reusable(d); ok && d.size >= 2*AreaSize {
		// The zero regions of a recent proof hold the layout's (the
		// first and the last MiB): zeros there now are a blank layout,
		// which is not read a second time.
		if proof, err := blank.Recheck(ctx, p); err == nil {
			if err := o.write(ctx, d, proof, log); err != nil {
				return false, err
			}
			return true, nil
		}
		// Something is there now: the path below tells a lease area
		// another node wrote meanwhile from data.
	}
	c, err := ReadLayout(ctx, d, o.Timeout)
	if err != nil {
		return false, err
	}
	switch c.Layout {
	case LayoutLease:
		return false, checkHeader(ctx, d, o.Timeout)
	case LayoutForeign:
		return false, &ForeignError{Device: d.name, Signature: c.Signature}
	}
	proof, err := o.proof(ctx, d)
	var nb *blank.NotBlankError
	switch {
	case errors.As(err, &nb):
		// Two nodes given the same blank disk (a platform fault, or
		// a retried attach) race its first stage: the other node's
		// header may land between the layout read and the proof. That
		// disk now carries a lease area, and the acquisition after this
		// sorts the claim out (and names the holder to the loser),
		// instead of a refusal that calls the other node's lease data
		// to be wiped.
		if c2, rerr := ReadLayout(ctx, d, o.Timeout); rerr == nil && c2.Layout == LayoutLease {
			log.Info("another node wrote a lease area on the disk while this node proved it blank; using that area", "device", d.name)
			return false, checkHeader(ctx, d, o.Timeout)
		}
		return false, &ForeignError{Device: d.name, Signature: nb.Found}
	case err != nil:
		return false, fmt.Errorf("%s: not formatted, its blankness could not be proven: %w", d.name, err)
	}
	if err := o.write(ctx, d, proof, log); err != nil {
		return false, err
	}
	return true, nil
}

// write writes a new lease header on d, which proof says is blank.
func (o FormatOptions) write(ctx context.Context, d *Device, proof blank.Proof, log *slog.Logger) error {
	h := Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset,
		Created: time.Now().Unix(), Creator: o.Key}
	if _, err := rand.Read(h.VolumeID[:]); err != nil {
		return err
	}
	if err := writeHeader(ctx, d, proof, h, o.Timeout); err != nil {
		return err
	}
	log.Info("lease area written", "device", d.name, "data_offset", DataOffset, "creator", o.Key.String())
	return nil
}

// reusable is the caller's proof when it is recent and of this whole
// device: the same path naming the same device as when it was proven.
func (o FormatOptions) reusable(d *Device) (blank.Proof, bool) {
	p := o.Proof
	return p, p.Valid() && p.Device() == d.name && p.File() == d.id && p.From() == 0 && p.Size() == d.size &&
		time.Since(p.Taken()) <= proofReuse
}

// proof is the blank proof the header write takes: the caller's, when it
// is reusable, else a new one. The layout check before it only tells a
// lease area from the rest; the header is written on nothing but a disk
// proven blank, by the proof every format of the agent passes (package
// internal/safety/blank).
func (o FormatOptions) proof(ctx context.Context, d *Device) (blank.Proof, error) {
	if p, ok := o.reusable(d); ok {
		// Its zero checks are read again now; only its signature
		// checks (blkid's process start) are taken as they were.
		return blank.Recheck(ctx, p)
	}
	if testHookBeforeProof != nil {
		testHookBeforeProof(d)
	}
	return blank.Prove(ctx, d.name)
}

// checkHeader proves the lease header at the start of d decodes.
func checkHeader(ctx context.Context, d *Device, timeout time.Duration) error {
	b, err := d.read(ctx, 0, BlockSize, timeout)
	if err != nil {
		return err
	}
	if _, err := DecodeHeader(b); err != nil {
		return fmt.Errorf("%s: %w", d.name, err)
	}
	return nil
}

// testHookBeforeProof, when set by a test, runs when Format has read a
// blank layout and is about to prove the disk blank.
var testHookBeforeProof func(d *Device)

// writeHeader writes a new lease header on d, which proof says is blank.
func writeHeader(ctx context.Context, d *Device, proof blank.Proof, h Header, timeout time.Duration) error {
	if !proof.Valid() || proof.Device() != d.name || proof.From() != 0 {
		return fmt.Errorf("%s: no proof that the disk is blank; the lease area is not written", d.name)
	}
	return d.write(ctx, 0, EncodeHeader(h), timeout)
}
