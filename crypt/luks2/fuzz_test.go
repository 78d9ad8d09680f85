package luks2

import (
	"bytes"
	"io"
	"testing"
)

// memDevice is a device in memory, so the fuzz targets' seeds are made
// without touching the disk in every fuzzing worker.
type memDevice struct{ b []byte }

func (m *memDevice) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(m.b)) {
		return 0, io.EOF
	}
	n := copy(p, m.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (m *memDevice) WriteAt(p []byte, off int64) (int, error) {
	return copy(m.b[off:], p), nil
}

func (m *memDevice) Seek(off int64, whence int) (int64, error) { return int64(len(m.b)), nil }
func (m *memDevice) Close() error                              { return nil }
func (m *memDevice) Sync() error                               { return nil }

// seedImage formats an in-memory device and returns its header areas.
func seedImage(f *testing.F) []byte {
	m := &memDevice{b: make([]byte, formatDataOffset+4096)}
	if _, err := format(m, "seed", FormatOptions{Passphrase: []byte("seed"), KDF: testKDF, DigestIterations: testDigestIter}); err != nil {
		f.Fatal(err)
	}
	return m.b[:2*formatHdrSize]
}

// FuzzReadHeader feeds arbitrary bytes as a header area: reading must never
// panic, and whatever is accepted must have passed validation.
func FuzzReadHeader(f *testing.F) {
	img := seedImage(f)
	f.Add(img[:2*formatHdrSize])
	f.Add(img[formatHdrSize : 2*formatHdrSize])
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := readHeader(bytes.NewReader(data), "fuzz")
		if err != nil {
			return
		}
		if h.Meta == nil || h.Meta.segment() == nil || h.Meta.digest() == nil || len(h.Meta.Keyslots) == 0 {
			t.Fatalf("accepted a header without segment, digest or keyslot")
		}
	})
}

// FuzzParseMetadata feeds arbitrary JSON to the validator.
func FuzzParseMetadata(f *testing.F) {
	hc, err := readCopy(bytes.NewReader(seedImage(f)), 0)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(hc.json)
	f.Add([]byte(`{"segments":{"0":{},"1":{}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := parseMetadata(data, formatHdrSize)
		if err != nil {
			return
		}
		if len(m.Segments) != 1 || m.segment().Encryption != cipherXTS || len(m.Config.Requirements) > 0 && !emptyRequirements(m.Config.Requirements) {
			t.Fatalf("accepted unsupported metadata: %s", data)
		}
	})
}
