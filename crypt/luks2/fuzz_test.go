package luks2

import (
	"bytes"
	"os"
	"testing"
)

// FuzzReadHeader feeds arbitrary bytes as a header area: reading must never
// panic, and whatever is accepted must have passed validation.
func FuzzReadHeader(f *testing.F) {
	p, v := formatImage(f, 32<<20, FormatOptions{})
	v.Close()
	img, err := os.ReadFile(p)
	if err != nil {
		f.Fatal(err)
	}
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
	_, v := formatImage(f, 32<<20, FormatOptions{})
	raw, err := jsonMarshal(v.Header.Meta)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(raw)
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
