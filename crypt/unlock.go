package crypt

import (
	"context"
	"errors"
	"fmt"
	"slices"

	luksgo "github.com/anatol/luks.go"
	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// The readers Unlock may use (Opened.Reader).
const (
	// ReaderLuksGo: github.com/anatol/luks.go unsealed the keyslot and
	// set the mapping up (Device.UnsealVolume, Volume.SetupMapper).
	ReaderLuksGo = "luks.go"
	// ReaderOwn: crypt/luks2 unlocked and crypt/dmcrypt set the mapping
	// up, for what luks.go cannot do (chooseReader).
	ReaderOwn = "crypt/luks2"
)

// Opened says what Unlock mapped and how.
type Opened struct {
	// Path is the mapping's device node, /dev/mapper/<name>.
	Path string
	// Reader is ReaderLuksGo or ReaderOwn; Why says why ReaderOwn was
	// used.
	Reader, Why string
	// Source is the header copy the volume was opened from ("primary" or
	// "secondary"), HeaderDamage what is wrong with the other copy
	// (luks2.Header.Damaged). Nothing is repaired: 'vco-agent luks
	// repair' rewrites both copies.
	Source       string
	HeaderDamage []string
}

// chooseReader picks who unseals and maps a volume whose header crypt/luks2
// has validated. luks.go does it unless it cannot: it reads only the
// primary header, so a volume whose primary copy is damaged or older than
// the secondary is opened by crypt/luks2 from the secondary; and its
// SetupMapper loads every table writable, so a read-only mapping is made
// by crypt/dmcrypt.
func chooseReader(v *luks2.Volume, o OpenOptions) (reader, why string) {
	switch {
	case v.Header.Source != "primary":
		return ReaderOwn, "the primary LUKS2 header is damaged or stale and luks.go reads only the primary; opened from the secondary copy"
	case o.ReadOnly:
		return ReaderOwn, "luks.go cannot map a volume read-only"
	}
	return ReaderLuksGo, ""
}

// Unlock validates the LUKS2 volume on device with crypt/luks2 (both
// header copies, the layout rules, the key derivation bounds), unseals a
// keyslot with passphrase and maps the volume as /dev/mapper/<name>:
// through luks.go where it can, else with crypt/luks2 and crypt/dmcrypt
// (chooseReader). The unseal stops when ctx ends and keeps to o.KDF
// either way.
func Unlock(ctx context.Context, device, name string, passphrase []byte, o OpenOptions) (Opened, error) {
	v, err := luks2.Open(device, false)
	if err != nil {
		return Opened{}, err
	}
	defer v.Close()
	op := Opened{Source: v.Header.Source, HeaderDamage: v.Header.Damaged}
	op.Reader, op.Why = chooseReader(v, o)
	if op.Reader == ReaderOwn {
		op.Path, err = openOwn(ctx, v, device, name, passphrase, o)
		return op, err
	}
	vol, err := unsealLuksGo(ctx, v, device, passphrase, o)
	if err != nil {
		return Opened{}, err
	}
	op.Path, err = setupLuksGo(vol, name)
	return op, err
}

// openOwn is the unlock and mapping of crypt/luks2 and crypt/dmcrypt.
func openOwn(ctx context.Context, v *luks2.Volume, device, name string, passphrase []byte, o OpenOptions) (string, error) {
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
		AllowDiscards: allowDiscards(v, o),
		ReadOnly:      o.ReadOnly,
	})
}

func allowDiscards(v *luks2.Volume, o OpenOptions) bool {
	return o.AllowDiscards || slices.Contains(v.Flags(), "allow-discards")
}

// unsealLuksGo opens the keyslot with luks.go, trying the keyslots v's
// validated header lists, in its order and within o.KDF (luks2.Unseal),
// and returns luks.go's Volume with its public fields set to the mapping
// this agent makes: the device v was validated on (luks.go reads v's
// Snapshot, so that it parses the very header crypt/luks2 validated, not
// a second reading of the device that could have been rewritten in
// between), the data size rounded down to whole encryption sectors
// (luks.go does not round a dynamic segment), and no flag but
// allow-discards (luks.go would pass on every persistent flag of the
// header, and refuse ones it does not know). What luks.go read must agree
// with v.
func unsealLuksGo(ctx context.Context, v *luks2.Volume, device string, passphrase []byte, o OpenOptions) (vol *luksgo.Volume, err error) {
	snap, err := v.Snapshot()
	if err != nil {
		return nil, err
	}
	// A keyslot abandoned when ctx ends may still be reading the
	// snapshot; its reads then fail and its result is dropped.
	defer snap.Close()
	d, err := luksGoOpen(luks2.SnapshotPath(snap))
	if err != nil {
		return nil, fmt.Errorf("%s: luks.go cannot read the LUKS2 header this agent validated: %w", device, err)
	}
	defer d.Close()
	if d.Version() != 2 || d.UUID() != v.Header.UUID {
		return nil, fmt.Errorf("%s: luks.go reads LUKS%d volume %s where this agent validated LUKS2 volume %s; the two readers disagree", device, d.Version(), d.UUID(), v.Header.UUID)
	}
	vol, _, err = luks2.Unseal(ctx, v, passphrase, o.KDF, func(slot int, pass []byte) (*luksgo.Volume, error) {
		return luksGoUnseal(d, slot, pass)
	}, nil)
	if err != nil {
		return nil, err
	}
	size, err := v.DataSize()
	if err != nil {
		return nil, err
	}
	sector := uint64(v.SectorSize())
	if vol.UUID != v.Header.UUID || vol.LuksType != "LUKS2" || vol.StorageOffset != v.DataOffset() ||
		vol.StorageEncryption != v.Cipher() || vol.StorageIvTweak != v.IVTweak() || vol.StorageSectorSize != sector ||
		vol.StorageSize < size || vol.StorageSize-size >= sector {
		return nil, fmt.Errorf("%s: luks.go reads the data segment as %s at byte %d, %d bytes, sector %d, iv tweak %d where this agent validated %s at byte %d, %d bytes, sector %d, iv tweak %d; the two readers disagree",
			device, vol.StorageEncryption, vol.StorageOffset, vol.StorageSize, vol.StorageSectorSize, vol.StorageIvTweak,
			v.Cipher(), v.DataOffset(), size, sector, v.IVTweak())
	}
	vol.BackingDevice = device
	vol.StorageSize = size
	vol.Flags = nil
	if allowDiscards(v, o) {
		vol.Flags = []string{luksgo.FlagAllowDiscards}
	}
	return vol, nil
}

// luksGoOpen is luksgo.Open that turns a panic into an error: luks.go
// trusts what it reads further than crypt/luks2 does.
func luksGoOpen(device string) (d luksgo.Device, err error) {
	defer func() {
		if r := recover(); r != nil {
			d, err = nil, fmt.Errorf("luks.go failed on the header: %v", r)
		}
	}()
	return luksgo.Open(device)
}

// luksGoUnseal is UnsealVolume with luks.go's wrong-passphrase error
// turned into luks2.ErrWrongPassphrase and a panic into an error (it runs
// on a goroutine of its own when the unlock can be abandoned, where a
// panic would end the process).
func luksGoUnseal(d luksgo.Device, slot int, pass []byte) (vol *luksgo.Volume, err error) {
	defer func() {
		if r := recover(); r != nil {
			vol, err = nil, fmt.Errorf("luks.go failed on keyslot %d: %v", slot, r)
		}
	}()
	vol, err = d.UnsealVolume(slot, pass)
	if errors.Is(err, luksgo.ErrPassphraseDoesNotMatch) {
		return nil, luks2.ErrWrongPassphrase
	}
	return vol, err
}

// setupLuksGo has luks.go load the dm-crypt table and resume the mapping,
// then makes the device node when no udev does. The table is loaded
// without the kernel's secure-data flag (docs/security.md says what that
// leaves behind and why the agent accepts it).
func setupLuksGo(vol *luksgo.Volume, name string) (string, error) {
	if err := dmcrypt.Available(); err != nil {
		return "", fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	if exists, err := dmcrypt.Exists(name); err != nil {
		return "", err
	} else if exists {
		return "", dmcrypt.ExistsError(name)
	}
	if err := vol.SetupMapper(name); err != nil {
		if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
			// Made by someone else since the check above: not ours
			// to remove.
			return "", dmcrypt.ExistsError(name)
		}
		// SetupMapper removes the device when the table load fails,
		// not when the resume does.
		_ = dmcrypt.Remove(name, dmcrypt.CleanupTimeout)
		return "", fmt.Errorf("dm-crypt %s on %s (set up by luks.go): %w", name, vol.BackingDevice, err)
	}
	if err := dmcrypt.EnsureNode(name); err != nil {
		_ = dmcrypt.Remove(name, dmcrypt.CleanupTimeout)
		return "", err
	}
	return dmcrypt.Path(name), nil
}
