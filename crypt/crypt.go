package crypt

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// OpenOptions are the activation choices of Open.
type OpenOptions struct {
	// ReadOnly maps the volume read-only.
	ReadOnly bool
	// AllowDiscards passes discards through; the volume's own
	// allow-discards flag turns it on too.
	AllowDiscards bool
	// KDF bounds the key derivations of the unlock (none beyond the
	// header bounds when zero).
	KDF luks2.UnlockLimits
}

// Open unlocks the LUKS2 volume on device with passphrase and maps it as
// /dev/mapper/<name>, which it returns. The volume key exists only for the
// duration of the call.
func Open(device, name string, passphrase []byte, o OpenOptions) (string, error) {
	return OpenContext(context.Background(), device, name, passphrase, o)
}

// OpenContext is Open whose unlock stops when ctx ends
// (luks2.Volume.UnlockContext).
func OpenContext(ctx context.Context, device, name string, passphrase []byte, o OpenOptions) (string, error) {
	v, err := luks2.Open(device, false)
	if err != nil {
		return "", err
	}
	defer v.Close()
	key, _, err := v.UnlockContext(ctx, passphrase, o.KDF)
	if err != nil {
		return "", err
	}
	defer clear(key)
	size, err := v.DataSize()
	if err != nil {
		return "", err
	}
	return dmcrypt.Create(dmcrypt.Mapping{
		Name:          name,
		UUID:          dmcrypt.MappingUUID(v.Header.UUID, name),
		Device:        device,
		Offset:        v.DataOffset(),
		Length:        size,
		Cipher:        v.Cipher(),
		Key:           key,
		IVTweak:       v.IVTweak(),
		SectorSize:    v.SectorSize(),
		AllowDiscards: o.AllowDiscards || slices.Contains(v.Flags(), "allow-discards"),
		ReadOnly:      o.ReadOnly,
	})
}

// CloseTimeout is how long Close waits for a busy mapping by default.
const CloseTimeout = 10 * time.Second

// Close removes the mapping name, retrying while it is busy for up to
// timeout; the error then names what holds it.
func Close(name string, timeout time.Duration) error {
	return dmcrypt.Remove(name, timeout)
}

// Resize grows the mapping name to the current size of its backing device,
// online; the filesystem on it is grown by the caller afterwards.
func Resize(name string) (uint64, error) {
	n, err := dmcrypt.GrowToDevice(name)
	if err != nil {
		return 0, fmt.Errorf("resize: %w", err)
	}
	return n, nil
}
