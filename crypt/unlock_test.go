package crypt

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	luksgo "github.com/anatol/luks.go"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// These tests run luks.go's unseal for real on image files; only
// SetupMapper, which needs device-mapper (absent from this host's kernel),
// is left to the guest test in crypt/dmcrypt (make test-crypt-lab).

func formatted(t *testing.T, size int64, o luks2.FormatOptions) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "vol.img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	if o.KDF.Type == "" {
		o.KDF = testKDF
	}
	v, err := luks2.Format(p, o)
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
	return p
}

func validated(t *testing.T, p string) *luks2.Volume {
	t.Helper()
	v, err := luks2.Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Close() })
	return v
}

// luks.go unseals an intact volume; crypt/luks2 opens what luks.go cannot:
// a volume whose primary header is damaged (luks.go reads only the
// primary), and a read-only mapping (luks.go maps every volume writable).
func TestChooseReader(t *testing.T) {
	p := formatted(t, 32<<20, luks2.FormatOptions{Passphrase: []byte("pw")})
	v := validated(t, p)
	if r, why := chooseReader(v, OpenOptions{}); r != ReaderLuksGo || why != "" {
		t.Fatalf("intact volume: %s (%s)", r, why)
	}
	if r, why := chooseReader(v, OpenOptions{ReadOnly: true}); r != ReaderOwn || !strings.Contains(why, "read-only") {
		t.Fatalf("read-only mapping: %s (%s)", r, why)
	}

	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("garbage"), 4096+10); err != nil { // the primary's JSON
		t.Fatal(err)
	}
	f.Close()
	if _, err := luksgo.Open(p); err == nil {
		t.Fatal("luks.go read the damaged primary header")
	}
	d := validated(t, p)
	r, why := chooseReader(d, OpenOptions{})
	if r != ReaderOwn || !strings.Contains(why, "secondary") || d.Header.Source != "secondary" || len(d.Header.Damaged) == 0 {
		t.Fatalf("damaged primary: %s (%s), source %s, damage %v", r, why, d.Header.Source, d.Header.Damaged)
	}
	// Our reader opens it (the mapping itself is the guest test's).
	key, _, err := d.UnlockContext(context.Background(), []byte("pw"), luks2.UnlockLimits{})
	if err != nil {
		t.Fatalf("crypt/luks2 on the secondary header: %v", err)
	}
	clear(key)
}

// The Volume luks.go unseals is set to the mapping the agent makes: the
// validated device, the data area rounded down to whole encryption
// sectors (luks.go leaves a dynamic segment's size unrounded and
// SetupMapper then refuses it), allow-discards only when asked for.
func TestUnsealLuksGoSetsTheMapping(t *testing.T) {
	p := formatted(t, 40<<20, luks2.FormatOptions{Passphrase: []byte("pw"), SectorSize: 4096})
	// The disk grew by what is not a whole encryption sector.
	const size = 40<<20 + 3*512
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	v := validated(t, p)
	vol, err := unsealLuksGo(context.Background(), v, p, []byte("pw"), OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := uint64(size) - v.DataOffset()
	want -= want % 4096
	if vol.BackingDevice != p || vol.StorageSize != want || vol.StorageOffset != v.DataOffset() || vol.StorageSectorSize != 4096 ||
		vol.StorageEncryption != "aes-xts-plain64" || len(vol.Flags) != 0 {
		t.Fatalf("volume %+v, want %d bytes at %d on %s, no flags", vol, want, v.DataOffset(), p)
	}
	if vol, err = unsealLuksGo(context.Background(), v, p, []byte("pw"), OpenOptions{AllowDiscards: true}); err != nil || len(vol.Flags) != 1 || vol.Flags[0] != luksgo.FlagAllowDiscards {
		t.Fatalf("with discards: %+v %v", vol, err)
	}
	q := formatted(t, 32<<20, luks2.FormatOptions{Passphrase: []byte("pw"), AllowDiscards: true})
	if vol, err = unsealLuksGo(context.Background(), validated(t, q), q, []byte("pw"), OpenOptions{}); err != nil || len(vol.Flags) != 1 || vol.Flags[0] != luksgo.FlagAllowDiscards {
		t.Fatalf("the header's allow-discards flag: %+v %v", vol, err)
	}
}

// A wrong passphrase is the error the agent's hint looks for; a volume
// formatted again after crypt/luks2 validated its header is not unsealed
// (luks.go reads the validated header, whose keyslot no longer matches
// the key material on the device).
func TestUnsealLuksGoRefuses(t *testing.T) {
	p := formatted(t, 32<<20, luks2.FormatOptions{Passphrase: []byte("pw")})
	v := validated(t, p)
	if _, err := unsealLuksGo(context.Background(), v, p, []byte("wrong"), OpenOptions{}); !errors.Is(err, luks2.ErrWrongPassphrase) || !strings.Contains(err.Error(), p) {
		t.Fatalf("wrong passphrase: %v", err)
	}
	if _, err := luks2.Format(p, luks2.FormatOptions{Passphrase: []byte("pw"), KDF: testKDF, Force: true}); err != nil {
		t.Fatal(err)
	}
	// luks.go worked from the validated header (v's Snapshot), not from
	// what the device holds now: it found the old keyslot, which the new
	// key material does not match, not the new header.
	if vol, err := unsealLuksGo(context.Background(), v, p, []byte("pw"), OpenOptions{}); !errors.Is(err, luks2.ErrWrongPassphrase) {
		t.Fatalf("a volume formatted again since its header was validated: %+v, %v", vol, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := unsealLuksGo(ctx, validated(t, p), p, []byte("pw"), OpenOptions{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("an unlock whose context has ended: %v", err)
	}
}

// A panic in luks.go on a header rewritten under it is an error, not the
// end of the agent.
func TestLuksGoPanicIsAnError(t *testing.T) {
	p := formatted(t, 32<<20, luks2.FormatOptions{Passphrase: []byte("pw")})
	d, err := luksGoOpen(p)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// A nil device stands in for luks.go dereferencing what is not
	// there; a keyslot it has no metadata for is an ordinary error.
	if _, err := luksGoUnseal(nil, 0, []byte("pw")); err == nil || !strings.Contains(err.Error(), "luks.go failed") {
		t.Fatalf("panic not recovered: %v", err)
	}
	if _, err := luksGoUnseal(d, 7, []byte("pw")); err == nil || errors.Is(err, luks2.ErrWrongPassphrase) {
		t.Fatalf("missing keyslot: %v", err)
	}
}
