package luks2

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
)

// Header is the validated metadata of a volume and where it came from.
type Header struct {
	UUID      string
	Label     string
	Subsystem string
	Seqid     uint64
	HdrSize   uint64
	// Source is "primary" or "secondary": the copy this header was read from.
	Source string
	// Damaged lists what is wrong with the other copy (empty when both copies
	// are intact and agree). Nothing is rewritten until the caller asks.
	Damaged []string
	Meta    *Metadata

	primarySalt, secondarySalt [lenSalt]byte
	// raw is the JSON text of the copy in use, as read and validated.
	raw []byte
}

// device is what a volume is read from and written to: an *os.File for a
// block device or an image, or a wrapper in tests that simulates crashes.
type device interface {
	io.ReaderAt
	io.WriterAt
	io.Seeker
	io.Closer
	Sync() error
}

// Volume is an open LUKS2 device or image file.
type Volume struct {
	path     string
	f        device
	writable bool
	Header   *Header
}

// ErrNotLUKS2 is returned when neither header copy carries a LUKS2 magic.
var ErrNotLUKS2 = errors.New("not a LUKS2 volume")

// Open reads both header copies of the device or image at path, picks the
// valid one with the higher seqid and validates it strictly. writable opens
// the device for keyslot, token and repair operations.
func Open(path string, writable bool) (*Volume, error) {
	flag := os.O_RDONLY
	if writable {
		flag = os.O_RDWR
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("open LUKS2 volume: %w", err)
	}
	v := &Volume{path: path, f: f, writable: writable}
	if v.Header, err = readHeader(f, path); err != nil {
		f.Close()
		return nil, err
	}
	return v, nil
}

// Close releases the device.
func (v *Volume) Close() error { return v.f.Close() }

// Path is the device or image the volume was opened from.
func (v *Volume) Path() string { return v.path }

func deviceSize(f io.Seeker) (uint64, error) {
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, err
	}
	return uint64(n), nil
}

// readHeader implements the recovery rule of the specification: both
// copies are read, each must pass its checksum, the one with the higher
// seqid wins. The winner is then validated; a winner that fails validation
// is refused, never replaced by the other copy, because a header that
// checksums correctly but asks for something unsupported was written on
// purpose.
func readHeader(r io.ReaderAt, path string) (*Header, error) {
	prim, perr := readCopy(r, 0)
	sec, serr := readSecondary(r, prim)
	if prim == nil && sec == nil {
		if errors.Is(perr, errNoMagic) && errors.Is(serr, errNoMagic) {
			return nil, fmt.Errorf("%s: %w", path, ErrNotLUKS2)
		}
		return nil, fmt.Errorf("%s: no usable LUKS2 header: primary: %v; secondary: %v", path, perr, serr)
	}
	h := &Header{}
	chosen, err := chooseCopy(h, path, prim, sec, perr, serr)
	if err != nil {
		return nil, err
	}
	h.UUID, h.Label, h.Subsystem = chosen.uuid, chosen.label, chosen.subsystem
	h.Seqid, h.HdrSize = chosen.seqid, chosen.hdrSize
	h.Source = "primary"
	if !chosen.primary {
		h.Source = "secondary"
	}
	if prim != nil {
		h.primarySalt = prim.salt
	}
	if sec != nil {
		h.secondarySalt = sec.salt
	}
	meta, err := parseMetadata(chosen.json, chosen.hdrSize)
	if err != nil {
		return nil, fmt.Errorf("%s (%s header, seqid %d): %w", path, h.Source, h.Seqid, err)
	}
	h.Meta = meta
	h.raw = chosen.json
	return h, nil
}

// readSecondary reads the secondary header copy: after the primary prim,
// or without one at each offset a header size allows, the first that
// reads.
func readSecondary(r io.ReaderAt, prim *headerCopy) (*headerCopy, error) {
	if prim != nil {
		return readCopy(r, prim.hdrSize)
	}
	serr := errNoMagic
	for _, off := range validHdrSizes {
		s, err := readCopy(r, off)
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errNoMagic) {
			serr = err
		}
	}
	return nil, serr
}

// chooseCopy chooses the copy to trust of the two read (either may be
// nil, with its error), recording in h what is wrong with the other.
func chooseCopy(h *Header, path string, prim, sec *headerCopy, perr, serr error) (*headerCopy, error) {
	chosen := prim
	switch {
	case prim == nil:
		chosen = sec
		h.Damaged = append(h.Damaged, "primary header: "+perr.Error())
	case sec == nil:
		h.Damaged = append(h.Damaged, "secondary header: "+serr.Error())
	case sec.seqid > prim.seqid:
		chosen = sec
		h.Damaged = append(h.Damaged, fmt.Sprintf("primary header is stale (seqid %d, secondary %d)", prim.seqid, sec.seqid))
	case prim.seqid > sec.seqid:
		h.Damaged = append(h.Damaged, fmt.Sprintf("secondary header is stale (seqid %d, primary %d)", sec.seqid, prim.seqid))
	case prim.hdrSize != sec.hdrSize || prim.uuid != sec.uuid || !bytes.Equal(prim.json, sec.json):
		return nil, fmt.Errorf("%s: primary and secondary LUKS2 headers carry the same seqid %d but different metadata; refusing to guess which is genuine (inspect with 'vco-agent luks dump')", path, prim.seqid)
	}
	if prim != nil && sec != nil && prim.hdrSize != sec.hdrSize {
		return nil, fmt.Errorf("%s: primary and secondary headers disagree on the header size", path)
	}
	return chosen, nil
}

// SectorSize is the encryption sector size of the data segment.
func (v *Volume) SectorSize() int { return v.Header.Meta.segment().SectorSize }

// DataOffset is where the encrypted data starts, in bytes.
func (v *Volume) DataOffset() uint64 { return uint64(v.Header.Meta.segment().Offset) }

// Cipher is the dm-crypt cipher specification of the data segment.
func (v *Volume) Cipher() string { return v.Header.Meta.segment().Encryption }

// IVTweak is the IV offset of the data segment.
func (v *Volume) IVTweak() uint64 { return uint64(v.Header.Meta.segment().IVTweak) }

// Flags are the persistent activation flags (for example allow-discards).
func (v *Volume) Flags() []string { return v.Header.Meta.Config.Flags }

// DataSize is the size of the encrypted data area in bytes, for a dynamic
// segment the device size now (rounded down to whole sectors) minus the
// offset.
func (v *Volume) DataSize() (uint64, error) {
	seg := v.Header.Meta.segment()
	if seg.Size != "dynamic" {
		return strconv.ParseUint(seg.Size, 10, 64)
	}
	n, err := deviceSize(v.f)
	if err != nil {
		return 0, err
	}
	if n <= uint64(seg.Offset) {
		return 0, fmt.Errorf("%s: device of %d bytes ends before the data offset %d", v.path, n, seg.Offset)
	}
	n -= uint64(seg.Offset)
	return n - n%uint64(seg.SectorSize), nil
}

// Slots lists the keyslots that take part in unlocking, in the order they
// are tried.
func (v *Volume) Slots() []int { return v.Header.Meta.sortedSlots() }

// Unlock tries the keyslots in priority order and returns the volume key
// and the keyslot that opened it. The caller must clear the key. Only the
// header bounds limit what it spends; UnlockContext takes limits.
func (v *Volume) Unlock(passphrase []byte) ([]byte, int, error) {
	return v.UnlockContext(context.Background(), passphrase, UnlockLimits{})
}

// UnlockSlot opens one keyslot, whatever its priority.
func (v *Volume) UnlockSlot(slot int, passphrase []byte) ([]byte, error) {
	key, err := v.openSlot(strconv.Itoa(slot), passphrase)
	if errors.Is(err, ErrWrongPassphrase) {
		return nil, fmt.Errorf("%s: keyslot %d: %w", v.path, slot, err)
	}
	return key, err
}

// writeHeaders stores meta as the next generation of both header copies:
// the secondary first, then the primary, each synced, so that a crash in
// between leaves one complete copy of the new metadata with the higher
// seqid, which readHeader then prefers.
func (v *Volume) writeHeaders(meta *Metadata) error {
	if !v.writable {
		return fmt.Errorf("%s: volume opened read-only", v.path)
	}
	h := v.Header
	raw, err := json.Marshal(meta)
	if err != nil {
		return err
	}
	// Validate what is about to be written with the same rules as a read.
	if _, err := parseMetadata(raw, h.HdrSize); err != nil {
		return fmt.Errorf("%s: refusing to write metadata: %w", v.path, err)
	}
	if err := writeBoth(v.f, h.HdrSize, h.Seqid+1, h.UUID, h.Label, h.Subsystem, raw, h.primarySalt, h.secondarySalt); err != nil {
		return fmt.Errorf("%s: write LUKS2 headers: %w", v.path, err)
	}
	h.Seqid++
	h.Meta = meta
	h.raw = raw
	h.Damaged = nil
	h.Source = "primary"
	return nil
}

func writeBoth(f device, hdrSize, seqid uint64, uuid, label, subsystem string, raw []byte, psalt, ssalt [lenSalt]byte) error {
	var zero [lenSalt]byte
	var err error
	// A copy that was unreadable gets a fresh salt, as the specification
	// asks for repairs.
	if psalt == zero {
		if psalt, err = newSalt(); err != nil {
			return err
		}
	}
	if ssalt == zero {
		if ssalt, err = newSalt(); err != nil {
			return err
		}
	}
	for _, primary := range []bool{false, true} {
		hc := &headerCopy{primary: primary, hdrSize: hdrSize, seqid: seqid, uuid: uuid, label: label, subsystem: subsystem, json: raw, salt: ssalt}
		off := int64(hdrSize)
		if primary {
			hc.salt, off = psalt, 0
		}
		buf, err := encodeCopy(hc)
		if err != nil {
			return err
		}
		if _, err := f.WriteAt(buf, off); err != nil {
			return err
		}
		if err := f.Sync(); err != nil {
			return err
		}
	}
	return nil
}

// Repair rewrites both header copies from the one in use, with a new
// seqid. It is the only way a damaged copy gets fixed.
func (v *Volume) Repair() error {
	if len(v.Header.Damaged) == 0 {
		return nil
	}
	if v.Header.Source == "secondary" {
		v.Header.primarySalt = [lenSalt]byte{}
	} else {
		v.Header.secondarySalt = [lenSalt]byte{}
	}
	return v.writeHeaders(v.Header.Meta)
}

// cloneMeta deep-copies the metadata so that a failed write leaves the
// in-memory header as it is on disk.
func cloneMeta(m *Metadata) *Metadata {
	raw, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	var c Metadata
	if err := json.Unmarshal(raw, &c); err != nil {
		panic(err)
	}
	return &c
}

// freeArea finds the lowest 4 KiB-aligned place for a keyslot area of size
// bytes in the keyslots area.
func (v *Volume) freeArea(size uint64) (uint64, error) {
	m := v.Header.Meta
	start := 2 * v.Header.HdrSize
	end := start + uint64(m.Config.KeyslotsSize)
	for off := start; off+size <= end; off += 4096 {
		free := true
		for _, k := range m.Keyslots {
			a, b := uint64(k.Area.Offset), uint64(k.Area.Offset+k.Area.Size)
			if off < b && a < off+size {
				free = false
				off = (b+4095)/4096*4096 - 4096
				break
			}
		}
		if free {
			return off, nil
		}
	}
	return 0, fmt.Errorf("%s: keyslots area is full", v.path)
}

// AddKeyslot adds a keyslot for newPassphrase, proving access with
// passphrase (an existing slot's). It writes the key material into free
// space first and the headers after, so a crash leaves the volume with its
// old slots intact. It returns the new slot's number.
func (v *Volume) AddKeyslot(passphrase, newPassphrase []byte, p KDFParams) (int, error) {
	key, _, err := v.Unlock(passphrase)
	if err != nil {
		return -1, err
	}
	defer clear(key)
	return v.AddKeyslotWithKey(key, newPassphrase, p)
}

// AddKeyslotWithKey is AddKeyslot for a caller that already holds the
// volume key (right after Format or Unlock).
func (v *Volume) AddKeyslotWithKey(key, newPassphrase []byte, p KDFParams) (int, error) {
	m := v.Header.Meta
	if ok, err := m.digest().verify(key); err != nil || !ok {
		return -1, fmt.Errorf("%s: the given volume key does not match the volume's digest", v.path)
	}
	slot := -1
	for i := 0; i < maxKeyslots; i++ {
		if _, used := m.Keyslots[strconv.Itoa(i)]; !used {
			slot = i
			break
		}
	}
	if slot < 0 {
		return -1, fmt.Errorf("%s: %w (all %d in use)", v.path, errNoSlot, maxKeyslots)
	}
	off, err := v.freeArea(areaSize(len(key)))
	if err != nil {
		return -1, err
	}
	ks, material, err := sealSlot(key, newPassphrase, p, off)
	if err != nil {
		return -1, fmt.Errorf("%s: seal keyslot %d: %w", v.path, slot, err)
	}
	if !v.writable {
		return -1, fmt.Errorf("%s: volume opened read-only", v.path)
	}
	if err := wipeRange(v.f, off, uint64(ks.Area.Size)); err != nil {
		return -1, fmt.Errorf("%s: %w", v.path, err)
	}
	if _, err := v.f.WriteAt(material, int64(off)); err != nil {
		return -1, fmt.Errorf("%s: write keyslot %d: %w", v.path, slot, err)
	}
	if err := v.f.Sync(); err != nil {
		return -1, err
	}
	nm := cloneMeta(m)
	id := strconv.Itoa(slot)
	nm.Keyslots[id] = ks
	nm.digest().Keyslots = appendSorted(nm.digest().Keyslots, id)
	if err := v.writeHeaders(nm); err != nil {
		return -1, err
	}
	return slot, nil
}

func appendSorted(ids []string, id string) []string {
	out := append([]string{}, ids...)
	out = append(out, id)
	for i := len(out) - 1; i > 0; i-- {
		a, _ := strconv.Atoi(out[i-1])
		b, _ := strconv.Atoi(out[i])
		if a <= b {
			break
		}
		out[i-1], out[i] = out[i], out[i-1]
	}
	return out
}

// RemoveKeyslot removes keyslot slot. keepPassphrase must open a different
// keyslot, so the volume always keeps one that works; tokens bound only to
// the removed slot are removed with it. The headers are written first, then
// the slot's key material is wiped.
func (v *Volume) RemoveKeyslot(slot int, keepPassphrase []byte) error {
	m := v.Header.Meta
	id := strconv.Itoa(slot)
	k, ok := m.Keyslots[id]
	if !ok {
		return fmt.Errorf("%s: keyslot %d does not exist", v.path, slot)
	}
	if len(m.Keyslots) == 1 {
		return fmt.Errorf("%s: keyslot %d is the last one; add another keyslot before removing it", v.path, slot)
	}
	opened := -1
	for _, n := range v.Slots() {
		if n == slot {
			continue
		}
		key, err := v.openSlot(strconv.Itoa(n), keepPassphrase)
		if err == nil {
			clear(key)
			opened = n
			break
		}
		if !errors.Is(err, ErrWrongPassphrase) {
			return err
		}
	}
	if opened < 0 {
		return fmt.Errorf("%s: the passphrase to keep opens no keyslot other than %d; refusing to remove it", v.path, slot)
	}
	nm := cloneMeta(m)
	delete(nm.Keyslots, id)
	d := nm.digest()
	var rest []string
	for _, s := range d.Keyslots {
		if s != id {
			rest = append(rest, s)
		}
	}
	d.Keyslots = rest
	for tid, raw := range nm.Tokens {
		var t map[string]json.RawMessage
		if err := json.Unmarshal(raw, &t); err != nil {
			return err
		}
		var slots []string
		_ = json.Unmarshal(t["keyslots"], &slots)
		var keep []string
		for _, s := range slots {
			if s != id {
				keep = append(keep, s)
			}
		}
		if len(keep) == len(slots) {
			continue
		}
		if len(keep) == 0 {
			delete(nm.Tokens, tid)
			continue
		}
		t["keyslots"], _ = json.Marshal(keep)
		nm.Tokens[tid], _ = json.Marshal(t)
	}
	if err := v.writeHeaders(nm); err != nil {
		return err
	}
	if err := wipeRange(v.f, uint64(k.Area.Offset), uint64(k.Area.Size)); err != nil {
		return fmt.Errorf("%s: keyslot %d removed from the headers but its area was not wiped: %w", v.path, slot, err)
	}
	return v.f.Sync()
}

// wipeRange overwrites [off, off+n) with zeros.
func wipeRange(f io.WriterAt, off, n uint64) error {
	const chunk = 1 << 20
	buf := make([]byte, min(n, chunk))
	for n > 0 {
		l := min(n, uint64(len(buf)))
		if _, err := f.WriteAt(buf[:l], int64(off)); err != nil {
			return fmt.Errorf("wipe at %d: %w", off, err)
		}
		off += l
		n -= l
	}
	return nil
}
