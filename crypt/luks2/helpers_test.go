package luks2

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Small costs keep the tests fast; the format is the same at any cost.
var testKDF = KDFParams{Type: "argon2id", Time: 4, MemoryKiB: 8 << 10, Threads: 1}

const testDigestIter = 1000

// newImage makes a sparse image file of size bytes.
func newImage(t testing.TB, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return p
}

func formatImage(t testing.TB, size int64, o FormatOptions) (string, *Volume) {
	t.Helper()
	p := newImage(t, size)
	if o.Passphrase == nil {
		o.Passphrase = []byte("correct horse")
	}
	if o.KDF.Type == "" {
		o.KDF = testKDF
	}
	if o.DigestIterations == 0 {
		o.DigestIterations = testDigestIter
	}
	v, err := Format(p, o)
	if err != nil {
		t.Fatalf("Format: %v", err)
	}
	t.Cleanup(func() { v.Close() })
	return p, v
}

func needCryptsetup(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Fatalf("cryptsetup is required (Debian package cryptsetup-bin, installed by make deps): %v", err)
	}
}

// cryptsetup runs the real cryptsetup with stdin and returns stdout, stderr.
func cryptsetup(t testing.TB, stdin []byte, args ...string) (string, string, error) {
	t.Helper()
	cmd := exec.Command("cryptsetup", args...)
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func fileHash(t testing.TB, p string) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

var mkRe = regexp.MustCompile(`(?s)MK dump:\s*(.*)`)

// dumpVolumeKey asks cryptsetup for the volume key of image p.
func dumpVolumeKey(t testing.TB, p string, pass []byte) []byte {
	t.Helper()
	kf := filepath.Join(t.TempDir(), "pass")
	if err := os.WriteFile(kf, pass, 0o600); err != nil {
		t.Fatal(err)
	}
	out, errs, err := cryptsetup(t, nil, "luksDump", "--dump-volume-key", "-q", "--key-file", kf, p)
	if err != nil {
		t.Fatalf("cryptsetup luksDump --dump-volume-key: %v: %s", err, errs)
	}
	m := mkRe.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no MK dump in cryptsetup output:\n%s", out)
	}
	hexs := strings.Join(strings.Fields(m[1]), "")
	key, err := hex.DecodeString(hexs)
	if err != nil {
		t.Fatalf("parse MK dump %q: %v", hexs, err)
	}
	return key
}

// rewriteJSON replaces the JSON area of both header copies of image p with
// edit's result and recomputes the checksums, the way someone who
// understands the format would tamper with it.
func rewriteJSON(t testing.TB, p string, bump uint64, copies []bool, edit func(map[string]any)) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, primary := range copies {
		off := uint64(0)
		if !primary {
			off = formatHdrSize
		}
		hc, err := readCopy(f, off)
		if err != nil {
			t.Fatalf("read copy at %d: %v", off, err)
		}
		var m map[string]any
		if err := jsonUnmarshalNumbers(hc.json, &m); err != nil {
			t.Fatal(err)
		}
		edit(m)
		if hc.json, err = jsonMarshal(m); err != nil {
			t.Fatal(err)
		}
		hc.seqid += bump
		buf, err := encodeCopy(hc)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(buf, int64(off)); err != nil {
			t.Fatal(err)
		}
	}
}

func jsonUnmarshalNumbers(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	return d.Decode(v)
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }

// memDevice is a device in memory: fuzz seeds and crash simulations need
// the write order, not a disk.
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
