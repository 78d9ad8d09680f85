package luks2

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Binary header layout (spec §2.1). All integers are big-endian.
const (
	binHeaderSize = 4096

	offMagic     = 0
	offVersion   = 6
	offHdrSize   = 8
	offSeqid     = 16
	offLabel     = 24
	offCsumAlg   = 72
	offSalt      = 104
	offUUID      = 168
	offSubsystem = 208
	offHdrOffset = 256
	offPadding   = 264
	offCsum      = 448
	offEnd       = 512

	lenLabel   = 48
	lenCsumAlg = 32
	lenSalt    = 64
	lenUUID    = 40
	lenCsum    = 64
)

var (
	magicPrimary   = []byte("LUKS\xba\xbe")
	magicSecondary = []byte("SKUL\xba\xbe")
)

// validHdrSizes are the header sizes (binary header + JSON area) the
// specification allows; the secondary header lives at exactly that offset.
var validHdrSizes = []uint64{
	16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10,
	512 << 10, 1 << 20, 2 << 20, 4 << 20,
}

func validHdrSize(n uint64) bool {
	for _, v := range validHdrSizes {
		if v == n {
			return true
		}
	}
	return false
}

// headerCopy is one of the two on-disk copies after parsing and checksum
// verification.
type headerCopy struct {
	primary   bool
	hdrSize   uint64
	seqid     uint64
	label     string
	uuid      string
	subsystem string
	salt      [lenSalt]byte
	json      []byte // the JSON text without the trailing zeros
}

// cString returns the NUL-terminated string in b, or an error when b has no
// terminating zero or non-zero bytes after it.
func cString(b []byte, field string) (string, error) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return "", fmt.Errorf("%s is not NUL-terminated", field)
	}
	for _, c := range b[i:] {
		if c != 0 {
			return "", fmt.Errorf("%s has bytes after its terminating NUL", field)
		}
	}
	return string(b[:i]), nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// readCopy reads and verifies the header copy at offset off. It returns an
// error describing what is wrong with it, never a partly trusted copy.
func readCopy(r io.ReaderAt, off uint64) (*headerCopy, error) {
	bin := make([]byte, binHeaderSize)
	if _, err := r.ReadAt(bin, int64(off)); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			// The device ends before this copy could start.
			return nil, errNoMagic
		}
		return nil, fmt.Errorf("read binary header at %d: %w", off, err)
	}
	hc, err := parseBinaryHeader(bin, off)
	if err != nil {
		return nil, err
	}
	full := make([]byte, hc.hdrSize)
	copy(full, bin)
	if _, err := r.ReadAt(full[binHeaderSize:], int64(off)+binHeaderSize); err != nil {
		return nil, fmt.Errorf("read JSON area at %d: %w", off+binHeaderSize, err)
	}
	stored := append([]byte(nil), full[offCsum:offCsum+lenCsum]...)
	clear(full[offCsum : offCsum+lenCsum])
	sum := sha256.Sum256(full)
	if !bytes.Equal(stored[:sha256.Size], sum[:]) || !allZero(stored[sha256.Size:]) {
		return nil, errChecksum
	}
	if err := hc.readFields(bin); err != nil {
		return nil, err
	}
	if hc.json, err = jsonArea(full[binHeaderSize:]); err != nil {
		return nil, err
	}
	return hc, nil
}

// parseBinaryHeader checks what the binary header bin of the copy at off
// says of the copy before its checksum can be checked: magic, version,
// header size, offset and checksum algorithm.
func parseBinaryHeader(bin []byte, off uint64) (*headerCopy, error) {
	primary := off == 0
	want := magicSecondary
	if primary {
		want = magicPrimary
	}
	if !bytes.Equal(bin[offMagic:offMagic+6], want) {
		return nil, errNoMagic
	}
	if v := binary.BigEndian.Uint16(bin[offVersion:]); v != 2 {
		return nil, fmt.Errorf("header version %d, only LUKS2 is supported", v)
	}
	hc := &headerCopy{primary: primary}
	hc.hdrSize = binary.BigEndian.Uint64(bin[offHdrSize:])
	if !validHdrSize(hc.hdrSize) {
		return nil, fmt.Errorf("invalid header size %d", hc.hdrSize)
	}
	if !primary && hc.hdrSize != off {
		return nil, fmt.Errorf("secondary header at %d claims header size %d", off, hc.hdrSize)
	}
	if got := binary.BigEndian.Uint64(bin[offHdrOffset:]); got != off {
		return nil, fmt.Errorf("header at %d records offset %d (misplaced header)", off, got)
	}
	alg, err := cString(bin[offCsumAlg:offCsumAlg+lenCsumAlg], "checksum algorithm")
	if err != nil {
		return nil, err
	}
	if alg != "sha256" {
		return nil, fmt.Errorf("header checksum algorithm %q is not supported (only sha256)", alg)
	}
	return hc, nil
}

// readFields reads the checksummed binary header's padding, seqid,
// strings and salt into hc.
func (hc *headerCopy) readFields(bin []byte) error {
	if !allZero(bin[offPadding:offCsum]) || !allZero(bin[offEnd:]) {
		return errors.New("binary header padding is not zeroed")
	}
	hc.seqid = binary.BigEndian.Uint64(bin[offSeqid:])
	var err error
	if hc.label, err = cString(bin[offLabel:offLabel+lenLabel], "label"); err != nil {
		return err
	}
	if hc.uuid, err = cString(bin[offUUID:offUUID+lenUUID], "uuid"); err != nil {
		return err
	}
	if hc.subsystem, err = cString(bin[offSubsystem:offSubsystem+lenLabel], "subsystem"); err != nil {
		return err
	}
	copy(hc.salt[:], bin[offSalt:offSalt+lenSalt])
	return nil
}

// jsonArea is the JSON of a checksummed JSON area: valid JSON, then NULs
// to the area's end.
func jsonArea(area []byte) ([]byte, error) {
	end := bytes.IndexByte(area, 0)
	if end < 0 {
		return nil, errors.New("JSON area is not NUL-terminated")
	}
	if !allZero(area[end:]) {
		return nil, errors.New("JSON area has data after the terminating NUL")
	}
	if !json.Valid(area[:end]) {
		return nil, errors.New("JSON area does not hold valid JSON")
	}
	return area[:end], nil
}

var (
	errNoMagic  = errors.New("no LUKS2 magic")
	errChecksum = errors.New("header checksum mismatch")
)

// encodeCopy builds the on-disk bytes of one header copy (binary header and
// JSON area) with its checksum.
func encodeCopy(hc *headerCopy) ([]byte, error) {
	if uint64(len(hc.json)) >= hc.hdrSize-binHeaderSize {
		return nil, fmt.Errorf("metadata of %d bytes does not fit the %d-byte JSON area", len(hc.json), hc.hdrSize-binHeaderSize)
	}
	if len(hc.label) >= lenLabel || len(hc.subsystem) >= lenLabel || len(hc.uuid) >= lenUUID {
		return nil, errors.New("label, subsystem or uuid too long")
	}
	buf := make([]byte, hc.hdrSize)
	off := uint64(0)
	if hc.primary {
		copy(buf[offMagic:], magicPrimary)
	} else {
		copy(buf[offMagic:], magicSecondary)
		off = hc.hdrSize
	}
	binary.BigEndian.PutUint16(buf[offVersion:], 2)
	binary.BigEndian.PutUint64(buf[offHdrSize:], hc.hdrSize)
	binary.BigEndian.PutUint64(buf[offSeqid:], hc.seqid)
	copy(buf[offLabel:], hc.label)
	copy(buf[offCsumAlg:], "sha256")
	copy(buf[offSalt:], hc.salt[:])
	copy(buf[offUUID:], hc.uuid)
	copy(buf[offSubsystem:], hc.subsystem)
	binary.BigEndian.PutUint64(buf[offHdrOffset:], off)
	copy(buf[binHeaderSize:], hc.json)
	sum := sha256.Sum256(buf)
	copy(buf[offCsum:], sum[:])
	return buf, nil
}

func newSalt() ([lenSalt]byte, error) {
	var s [lenSalt]byte
	_, err := rand.Read(s[:])
	return s, err
}
