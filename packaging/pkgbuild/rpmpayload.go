package pkgbuild

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/cavaliergopher/cpio"
	"github.com/ulikunitz/xz"
)

// nfpm (through rpmpack) names the RPM payload's cpio members by absolute
// paths, /usr/bin/vco-agent, where rpmbuild writes ./usr/bin/vco-agent.
// rpm installs either, since it places files by the header, but the
// common `rpm2cpio x.rpm | cpio -idv` then writes over the inspecting
// machine's root (rpmlint unpacks packages exactly so). relativePayload
// rewrites a built RPM so that every member is named ./...: the payload
// is recompressed, and the three values that depend on it are replaced in
// place (their sizes do not change): the payload's SHA-256 in the main
// header, and the main header's SHA-256 and the header+payload size in
// the signature header. Any other digest or signature in the package would
// go stale, so the rewrite refuses a package that carries one.

// RPM header tags the rewrite reads or replaces (rpm's rpmtag.h).
const (
	rpmSigSHA1             = 269
	rpmSigSHA256           = 273
	rpmSigSize             = 1000
	rpmSigPGP              = 1002
	rpmSigMD5              = 1004
	rpmSigGPG              = 1005
	rpmSigLongSize         = 270
	rpmSigRSA              = 268
	rpmSigDSA              = 267
	rpmTagPayloadCompress  = 1125
	rpmTagPayloadDigest    = 5092
	rpmTagPayloadDigestAlt = 5097
)

var rpmHeaderMagic = []byte{0x8e, 0xad, 0xe8, 0x01}

// rpmHeader is one header structure of an RPM file: its index entries
// and its data store, located in the file's bytes.
type rpmHeader struct {
	start, end int // the header in the file, magic to the end of its store
	store      int // where its store starts
	entries    map[int32]rpmEntry
}

type rpmEntry struct {
	typ    uint32
	offset int
	count  uint32
}

func parseRPMHeader(b []byte, at int) (*rpmHeader, error) {
	if len(b) < at+16 || !bytes.Equal(b[at:at+4], rpmHeaderMagic) {
		return nil, fmt.Errorf("no RPM header at byte %d", at)
	}
	n := int(binary.BigEndian.Uint32(b[at+8:]))
	size := int(binary.BigEndian.Uint32(b[at+12:]))
	h := &rpmHeader{start: at, store: at + 16 + 16*n, entries: map[int32]rpmEntry{}}
	h.end = h.store + size
	if n > 1<<16 || h.end > len(b) {
		return nil, fmt.Errorf("RPM header at byte %d is truncated", at)
	}
	for i := 0; i < n; i++ {
		e := b[at+16+16*i:]
		tag := int32(binary.BigEndian.Uint32(e))
		h.entries[tag] = rpmEntry{typ: binary.BigEndian.Uint32(e[4:]), offset: int(int32(binary.BigEndian.Uint32(e[8:]))), count: binary.BigEndian.Uint32(e[12:])}
	}
	return h, nil
}

// str returns the first string of a STRING (6) or STRING_ARRAY (8) entry
// and where it lies in the file.
func (h *rpmHeader) str(b []byte, tag int32) (string, int, error) {
	e, ok := h.entries[tag]
	if !ok || (e.typ != 6 && e.typ != 8) {
		return "", 0, fmt.Errorf("RPM header has no string tag %d", tag)
	}
	at := h.store + e.offset
	if at < h.store || at >= h.end {
		return "", 0, fmt.Errorf("RPM header tag %d points outside its store", tag)
	}
	n := bytes.IndexByte(b[at:h.end], 0)
	if n < 0 {
		return "", 0, fmt.Errorf("RPM header tag %d is not terminated", tag)
	}
	return string(b[at : at+n]), at, nil
}

// replaceHex puts the hex of sum where tag's string, the hex of old, is.
func (h *rpmHeader) replaceHex(b []byte, tag int32, old, sum []byte) error {
	s, at, err := h.str(b, tag)
	if err != nil {
		return err
	}
	if s != hex.EncodeToString(old) {
		return fmt.Errorf("RPM header tag %d is %s, not the digest of what it covers", tag, s)
	}
	copy(b[at:], hex.EncodeToString(sum))
	return nil
}

// relativePayload rewrites the RPM at path in place, as described above.
func relativePayload(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	const leadSize = 96
	sig, err := parseRPMHeader(b, leadSize)
	if err != nil {
		return fmt.Errorf("signature header: %w", err)
	}
	mainAt := sig.end + (8-(sig.end-sig.start)%8)%8
	hdr, err := parseRPMHeader(b, mainAt)
	if err != nil {
		return fmt.Errorf("main header: %w", err)
	}
	for _, t := range []int32{rpmSigSHA1, rpmSigPGP, rpmSigMD5, rpmSigGPG, rpmSigLongSize, rpmSigRSA, rpmSigDSA} {
		if _, ok := sig.entries[t]; ok {
			return fmt.Errorf("the signature header carries tag %d, which rewriting the payload would invalidate", t)
		}
	}
	if _, ok := hdr.entries[rpmTagPayloadDigestAlt]; ok {
		return fmt.Errorf("the header carries tag %d (the uncompressed payload's digest), which rewriting the payload would invalidate", rpmTagPayloadDigestAlt)
	}
	if c, _, err := hdr.str(b, rpmTagPayloadCompress); err != nil || c != "xz" {
		return fmt.Errorf("payload compressor %q (%v): only xz is rewritten; keep rpm.compression: xz in packaging/nfpm.yaml", c, err)
	}
	header := b[hdr.start:hdr.end]
	payload := b[hdr.end:]

	var cp bytes.Buffer
	if err := renameMembers(payload, &cp); err != nil {
		return err
	}
	var z bytes.Buffer
	zw, err := xz.NewWriter(&z)
	if err != nil {
		return err
	}
	if _, err := zw.Write(cp.Bytes()); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}

	out := make([]byte, 0, hdr.end+z.Len())
	out = append(out, b[:hdr.end]...)
	oldPayloadSum := sha256.Sum256(payload)
	newPayloadSum := sha256.Sum256(z.Bytes())
	if err := hdr.replaceHex(out, rpmTagPayloadDigest, oldPayloadSum[:], newPayloadSum[:]); err != nil {
		return err
	}
	oldHeaderSum := sha256.Sum256(header)
	newHeaderSum := sha256.Sum256(out[hdr.start:hdr.end])
	if err := sig.replaceHex(out, rpmSigSHA256, oldHeaderSum[:], newHeaderSum[:]); err != nil {
		return err
	}
	e, ok := sig.entries[rpmSigSize]
	if !ok || e.typ != 4 || e.count != 1 {
		return errors.New("the signature header has no header+payload size")
	}
	at := sig.store + e.offset
	if got, want := binary.BigEndian.Uint32(out[at:]), uint32(len(header)+len(payload)); got != want {
		return fmt.Errorf("the signature header's size is %d, the header and payload are %d bytes", got, want)
	}
	binary.BigEndian.PutUint32(out[at:], uint32(len(header)+z.Len()))
	out = append(out, z.Bytes()...)

	tmp := path + ".rel"
	if err := os.WriteFile(tmp, out, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// renameMembers copies the xz-compressed cpio archive in payload to w,
// uncompressed, with each absolute member name made relative (./usr/...).
// Only regular files and directories are expected in this package.
func renameMembers(payload []byte, w io.Writer) error {
	zr, err := xz.NewReader(bytes.NewReader(payload))
	if err != nil {
		return fmt.Errorf("payload: %w", err)
	}
	r := cpio.NewReader(zr)
	cw := cpio.NewWriter(w)
	for {
		h, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("payload: %w", err)
		}
		if !h.Mode.IsRegular() && !h.Mode.IsDir() {
			return fmt.Errorf("payload member %s is neither a regular file nor a directory; the rewrite does not handle it", h.Name)
		}
		n := *h
		switch {
		case strings.HasPrefix(h.Name, "/"):
			n.Name = "." + h.Name
		case strings.HasPrefix(h.Name, "./"):
		default:
			n.Name = "./" + h.Name
		}
		if err := cw.WriteHeader(&n); err != nil {
			return err
		}
		if _, err := io.Copy(cw, r); err != nil {
			return fmt.Errorf("payload member %s: %w", h.Name, err)
		}
	}
	return cw.Close()
}
