package crypt

import (
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// OpenOptions are the activation choices of Unlock.
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

// CloseTimeout is how long Close waits for a busy mapping by default.
const CloseTimeout = 10 * time.Second

// Close removes the mapping name, retrying while it is busy for up to
// timeout; the error then names what holds it. It serves mappings luks.go
// set up as well as crypt/dmcrypt's (both name theirs
// CRYPT-LUKS2-<uuid>-<name>). luks.Lock is not used: it is the same
// device-mapper remove call, made once, without the retry while busy, the
// holder names, or the device node removal when no udev runs.
func Close(name string, timeout time.Duration) error {
	return dmcrypt.Remove(name, timeout)
}

// Resize grows the mapping name to the current size of its backing device,
// online; the filesystem on it is grown by the caller afterwards. The
// mapping may be luks.go's: the live table is read back from the kernel,
// whoever loaded it.
func Resize(name string) (uint64, error) {
	n, err := dmcrypt.GrowToDevice(name)
	if err != nil {
		return 0, fmt.Errorf("resize: %w", err)
	}
	return n, nil
}
