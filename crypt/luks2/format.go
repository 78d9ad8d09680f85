package luks2

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
)

// Layout of a volume this package formats; the same numbers cryptsetup
// uses by default, so the two produce the same geometry.
const (
	formatHdrSize      = 16 << 10
	formatKeyslotsSize = 16<<20 - 2*formatHdrSize
	formatDataOffset   = 16 << 20
)

// FormatOptions describes a new volume.
type FormatOptions struct {
	// Passphrase goes into keyslot 0.
	Passphrase []byte
	// KDF is the cost of keyslot 0 (zero fields take DefaultKDF's).
	KDF KDFParams
	// SectorSize is the encryption sector size, 512 or 4096 (default 4096,
	// which the data area size must then be a multiple of).
	SectorSize int
	// KeySize is the aes-xts volume key size in bytes, 32 or 64 (default 64).
	KeySize int
	// DigestIterations is the pbkdf2 count of the volume key digest.
	DigestIterations int
	// UUID, Label and Subsystem go into the binary header; a random UUID is
	// made when empty.
	UUID, Label, Subsystem string
	// AllowDiscards stores the allow-discards persistent flag.
	AllowDiscards bool
	// VolumeKey, when set, is used instead of a random key (tests and
	// recovery from a backed-up key only).
	VolumeKey []byte
	// TransitToken, when set, is stored as token 0 (bound to keyslot 0) in
	// the very first header, so no crash can leave a volume whose wrapped
	// passphrase was never recorded.
	TransitToken *TransitToken
	// Force formats over an existing signature. Only for tests and for an
	// operator who has checked the device by hand: it destroys data.
	Force bool
}

// ErrSignature is returned when the device already holds data.
var ErrSignature = errors.New("device is not blank")

func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// Format writes a new LUKS2 header with one keyslot to the device or image
// at path and returns it opened for writing. The write order makes a crash
// at any point leave either no valid header or the complete new one: the
// whole metadata and keyslot area is zeroed first (destroying any old
// header), then the key material is written, then the secondary header,
// and the primary header last, with a sync after each step.
func Format(path string, o FormatOptions) (*Volume, error) {
	flag := os.O_RDWR
	if st, err := os.Stat(path); err == nil && st.Mode()&os.ModeDevice != 0 {
		// An exclusive open of a block device fails while it is mounted or
		// mapped, which keeps a busy device from being formatted.
		flag |= os.O_EXCL
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("format: open %s: %w", path, err)
	}
	v, err := format(f, path, o)
	if err != nil {
		f.Close()
		return nil, err
	}
	return v, nil
}

func format(f device, path string, o FormatOptions) (*Volume, error) {
	if err := o.complete(path); err != nil {
		return nil, err
	}
	if err := checkFormatTarget(f, path, o); err != nil {
		return nil, err
	}
	key := o.VolumeKey
	if key == nil {
		key = make([]byte, o.KeySize)
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		defer clear(key)
	}
	uuid := o.UUID
	if uuid == "" {
		var err error
		if uuid, err = newUUID(); err != nil {
			return nil, err
		}
	}
	raw, ks, material, err := formatMetadata(path, key, o)
	if err != nil {
		return nil, err
	}
	return writeFormat(f, path, uuid, raw, ks.Area.Offset, material, o)
}

// complete sets the defaults of o and checks the passphrase, sector size
// and key size.
func (o *FormatOptions) complete(path string) error {
	if len(o.Passphrase) == 0 {
		return fmt.Errorf("format %s: empty passphrase", path)
	}
	if o.SectorSize == 0 {
		o.SectorSize = 4096
	}
	if o.SectorSize != 512 && o.SectorSize != 4096 {
		return fmt.Errorf("format %s: sector size %d, only 512 or 4096", path, o.SectorSize)
	}
	if o.KeySize == 0 {
		o.KeySize = 64
		if o.VolumeKey != nil {
			o.KeySize = len(o.VolumeKey)
		}
	}
	if o.KeySize != 32 && o.KeySize != 64 {
		return fmt.Errorf("format %s: key size %d bytes, only 32 or 64", path, o.KeySize)
	}
	if o.VolumeKey != nil && len(o.VolumeKey) != o.KeySize {
		return fmt.Errorf("format %s: volume key of %d bytes for key size %d", path, len(o.VolumeKey), o.KeySize)
	}
	return nil
}

// checkFormatTarget checks that the device at path fits the layout with
// o's sector size and, unless o.Force, holds no data.
func checkFormatTarget(f device, path string, o FormatOptions) error {
	size, err := deviceSize(f)
	if err != nil {
		return fmt.Errorf("format %s: size: %w", path, err)
	}
	if size < formatDataOffset+uint64(o.SectorSize) {
		return fmt.Errorf("format %s: device of %d bytes is too small for a %d-byte LUKS2 header", path, size, formatDataOffset)
	}
	if (size-formatDataOffset)%uint64(o.SectorSize) != 0 {
		return fmt.Errorf("format %s: data area of %d bytes is not a multiple of the %d-byte sector size; use sector size 512", path, size-formatDataOffset, o.SectorSize)
	}
	if !o.Force {
		sig, err := DetectSignature(f, size)
		if err != nil {
			return fmt.Errorf("format %s: %w", path, err)
		}
		if sig != "" {
			return fmt.Errorf("format %s: %w: found %s; refusing to format over existing data (P5)", path, ErrSignature, sig)
		}
	}
	return nil
}

// formatMetadata seals keyslot 0 of the volume key and returns the new
// volume's metadata as JSON, checked as a read would check it, with the
// keyslot and its key material.
func formatMetadata(path string, key []byte, o FormatOptions) ([]byte, *Keyslot, []byte, error) {
	dg, err := newDigest(key, o.DigestIterations)
	if err != nil {
		return nil, nil, nil, err
	}
	ks, material, err := sealSlot(key, o.Passphrase, o.KDF, 2*formatHdrSize)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("format %s: seal keyslot 0: %w", path, err)
	}
	dg.Keyslots = []string{"0"}
	meta := &Metadata{
		Keyslots: map[string]*Keyslot{"0": ks},
		Tokens:   map[string]json.RawMessage{},
		Segments: map[string]*Segment{"0": {
			Type: "crypt", Offset: formatDataOffset, Size: "dynamic",
			Encryption: cipherXTS, SectorSize: o.SectorSize,
		}},
		Digests: map[string]*Digest{"0": dg},
		Config:  Config{JSONSize: formatHdrSize - binHeaderSize, KeyslotsSize: formatKeyslotsSize},
	}
	if o.AllowDiscards {
		meta.Config.Flags = []string{"allow-discards"}
	}
	if o.TransitToken != nil {
		t := *o.TransitToken
		t.Keyslots = []int{0}
		raw, err := t.marshal()
		if err != nil {
			return nil, nil, nil, fmt.Errorf("format %s: %w", path, err)
		}
		meta.Tokens["0"] = raw
	}
	raw, err := json.Marshal(meta)
	if err != nil {
		return nil, nil, nil, err
	}
	if _, err := parseMetadata(raw, formatHdrSize); err != nil {
		return nil, nil, nil, fmt.Errorf("format %s: %w", path, err)
	}
	return raw, ks, material, nil
}

// writeFormat writes the new volume to the device in Format's order, the
// key material at offset, and reads the header back.
func writeFormat(f device, path, uuid string, raw []byte, offset U64, material []byte, o FormatOptions) (*Volume, error) {
	if err := wipeRange(f, 0, formatDataOffset); err != nil {
		return nil, fmt.Errorf("format %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return nil, fmt.Errorf("format %s: sync: %w", path, err)
	}
	if _, err := f.WriteAt(material, int64(offset)); err != nil {
		return nil, fmt.Errorf("format %s: write keyslot: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return nil, fmt.Errorf("format %s: sync: %w", path, err)
	}
	var none [lenSalt]byte
	if err := writeBoth(f, formatHdrSize, 1, uuid, o.Label, o.Subsystem, raw, none, none); err != nil {
		return nil, fmt.Errorf("format %s: write headers: %w", path, err)
	}
	h, err := readHeader(f, path)
	if err != nil {
		return nil, fmt.Errorf("format %s: reading back the new header: %w", path, err)
	}
	if len(h.Damaged) != 0 {
		return nil, fmt.Errorf("format %s: new header reads back damaged: %v", path, h.Damaged)
	}
	return &Volume{path: path, f: f, writable: true, Header: h}, nil
}
