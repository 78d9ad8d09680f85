package luks2

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Snapshot returns an anonymous memory file (memfd) holding what this
// package validated, for another reader to unlock from: the header copy in
// use, written as the primary copy at byte 0, and the key material of
// every keyslot at its offset, in a file as large as the device (sparse
// elsewhere). luks.go reads the header itself from a path; given the
// device it would read it a second time, and a header rewritten between
// the two reads would be unlocked under a key derivation cost nobody
// validated. Given SnapshotPath(f) it parses exactly the metadata
// validated here. The caller closes f.
func (v *Volume) Snapshot() (f *os.File, err error) {
	h := v.Header
	salt := h.primarySalt
	if h.Source != "primary" {
		salt = h.secondarySalt
	}
	hdr, err := encodeCopy(&headerCopy{primary: true, hdrSize: h.HdrSize, seqid: h.Seqid, uuid: h.UUID,
		label: h.Label, subsystem: h.Subsystem, json: h.raw, salt: salt})
	if err != nil {
		return nil, fmt.Errorf("%s: snapshot of the header: %w", v.path, err)
	}
	size, err := deviceSize(v.f)
	if err != nil {
		return nil, fmt.Errorf("%s: size: %w", v.path, err)
	}
	fd, err := unix.MemfdCreate("vco-luks2-header", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("%s: memory file for the header snapshot: %w", v.path, err)
	}
	f = os.NewFile(uintptr(fd), "vco-luks2-header")
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if err := f.Truncate(int64(size)); err != nil {
		return nil, fmt.Errorf("%s: header snapshot: %w", v.path, err)
	}
	if _, err := f.WriteAt(hdr, 0); err != nil {
		return nil, fmt.Errorf("%s: header snapshot: %w", v.path, err)
	}
	for id, k := range h.Meta.Keyslots {
		buf := make([]byte, k.Area.Size)
		if _, err := v.f.ReadAt(buf, int64(k.Area.Offset)); err != nil {
			return nil, fmt.Errorf("%s: read keyslot %s area: %w", v.path, id, err)
		}
		_, err := f.WriteAt(buf, int64(k.Area.Offset))
		clear(buf)
		if err != nil {
			return nil, fmt.Errorf("%s: header snapshot: %w", v.path, err)
		}
	}
	return f, nil
}

// SnapshotPath is the path another reader opens a Snapshot by.
func SnapshotPath(f *os.File) string { return fmt.Sprintf("/proc/self/fd/%d", f.Fd()) }
