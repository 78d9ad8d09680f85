package volume

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// adv10Swapped proves a zero file blank, then puts another file holding
// data (a volume's, say) at its path, as a disk removed and another
// attached at its device node does (or a /dev/disk/by-* link retargeted):
// the proof names the path, and records in File what it named.
func adv10Swapped(t *testing.T, prove func(string) (blank.Proof, error)) (blank.Proof, string, []byte) {
	t.Helper()
	dir := t.TempDir()
	p := filepath.Join(dir, "disk")
	if err := os.WriteFile(p, make([]byte, 32<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	proof, err := prove(p)
	if err != nil {
		t.Skipf("cannot prove a zero file blank here (blkid?): %v", err)
	}
	data := bytes.Repeat([]byte("another volume's data. "), (32<<20)/23)
	other := filepath.Join(dir, "other")
	if err := os.WriteFile(other, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, p); err != nil {
		t.Fatal(err)
	}
	return proof, p, data
}

// A blank proof names the path it read and what that path named then
// (Proof.File, a block device's number). The formats that take it, mkfs
// (makeFS) and the LUKS2 header (LUKS.Format), run on the path without
// looking whether it still names what was proven: a device that took the
// path since (a disk removed and another attached at its node between the
// proof and the format) is formatted without any proof of its own (P5:
// nothing is formatted without a proof of blankness for that device).
// Control: the same format on the file proven leaves a format.
func TestAdv10FormatTakesAProofOfAnotherDevice(t *testing.T) {
	ctx := context.Background()
	mkfs := func(p blank.Proof) error {
		return makeFS(ctx, p, "ext4", false, "0b0e1d2c-3f4a-4b5c-8d6e-7f8091a2b3c4")
	}
	luks := func(p blank.Proof) error {
		l := &LUKS{KDF: luks2.KDFParams{Type: "pbkdf2", Iterations: 1000}}
		return l.Format(ctx, p, []byte(secret), wrapped)
	}
	whole := func(p string) (blank.Proof, error) { return blank.Prove(ctx, p) }
	// A LUKS2 format of this agent's cut short is made again over its
	// own leftovers, proven blank past the header area (ProvePast).
	past := func(p string) (blank.Proof, error) { return blank.ProvePast(ctx, p, luksHeaderArea) }
	formats := map[string]struct {
		prove  func(string) (blank.Proof, error)
		format func(blank.Proof) error
	}{
		"mkfs":                                {whole, mkfs},
		"LUKS2 format":                        {whole, luks},
		"LUKS2 format over its own cut short": {past, luks},
	}
	for name, f := range formats {
		t.Run(name+" control", func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "disk")
			if err := os.WriteFile(p, make([]byte, 32<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			proof, err := f.prove(p)
			if err != nil {
				t.Skipf("cannot prove a zero file blank here: %v", err)
			}
			if err := f.format(proof); err != nil {
				t.Fatalf("%s of the file proven blank: %v", name, err)
			}
		})
		t.Run(name, func(t *testing.T) {
			proof, p, data := adv10Swapped(t, f.prove)
			err := f.format(proof)
			got, rerr := os.ReadFile(p)
			if rerr != nil {
				t.Fatal(rerr)
			}
			if !bytes.Equal(got, data) {
				t.Errorf("%s wrote over %s, which now names another file than the one proven blank (format answered %v)", name, p, err)
			}
			if err == nil {
				t.Errorf("%s of a path that names another file than the one proven blank answered no error", name)
			}
		})
	}
}
