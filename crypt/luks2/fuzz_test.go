package luks2

import (
	"bytes"
	"testing"
)

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

// FuzzParseMetadata feeds arbitrary JSON to the validator: what it accepts
// must be supported and within the key derivation bounds (the seeds
// hostile-* carry costs of 2^30 and more memory than allowed).
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
		for id, k := range m.Keyslots {
			if w := int64(k.KDF.Time) * int64(k.KDF.Memory); k.KDF.Memory > MaxArgonMemoryKiB || k.KDF.Time > MaxArgonTime || w > MaxArgonWorkKiB ||
				int64(k.KDF.Iterations)*int64(pbkdf2Blocks(k.KDF.Hash, k.Area.KeySize)) > MaxPBKDF2Blocks {
				t.Fatalf("accepted keyslot %s whose key derivation costs more than the bounds: %+v", id, k.KDF)
			}
		}
		if d := m.digest(); len(d.Digest) > maxDigestLen || int64(d.Iterations)*int64(pbkdf2Blocks(d.Hash, len(d.Digest))) > MaxDigestBlocks {
			t.Fatalf("accepted a digest that costs more than the bound: %d iterations, %d bytes", d.Iterations, len(d.Digest))
		}
	})
}
