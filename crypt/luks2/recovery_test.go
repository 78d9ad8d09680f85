package luks2

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"
)

func corrupt(t *testing.T, p string, off int64, data []byte) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, off); err != nil {
		t.Fatal(err)
	}
}

// A damaged primary header is read from the secondary, reported, and left
// alone until Repair is asked for; cryptsetup is satisfied afterwards.
func TestDamagedPrimaryReadFromSecondary(t *testing.T) {
	pass := []byte("pw")
	for _, where := range []struct {
		name string
		off  int64
		data []byte
	}{
		{"json", binHeaderSize + 10, []byte("garbage")},
		{"magic", 0, []byte("XXXX")},
		{"checksum", offCsum, []byte{1, 2, 3}},
		{"zeroed", 0, make([]byte, formatHdrSize)},
	} {
		t.Run(where.name, func(t *testing.T) {
			p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: pass})
			want, _, err := v.Unlock(pass)
			if err != nil {
				t.Fatal(err)
			}
			v.Close()
			corrupt(t, p, where.off, where.data)
			before := fileHash(t, p)

			v, err = Open(p, true)
			if err != nil {
				t.Fatalf("Open with damaged primary: %v", err)
			}
			defer v.Close()
			if v.Header.Source != "secondary" || len(v.Header.Damaged) != 1 || !strings.Contains(v.Header.Damaged[0], "primary") {
				t.Fatalf("source %s damaged %v", v.Header.Source, v.Header.Damaged)
			}
			key, _, err := v.Unlock(pass)
			if err != nil || !bytes.Equal(key, want) {
				t.Fatalf("unlock from secondary: %v", err)
			}
			if fileHash(t, p) != before {
				t.Fatal("opening and unlocking rewrote the damaged image")
			}
			if err := v.Repair(); err != nil {
				t.Fatal(err)
			}
			v2, err := Open(p, false)
			if err != nil {
				t.Fatal(err)
			}
			defer v2.Close()
			if v2.Header.Source != "primary" || len(v2.Header.Damaged) != 0 || v2.Header.Seqid != 2 {
				t.Fatalf("after repair: source %s damaged %v seqid %d", v2.Header.Source, v2.Header.Damaged, v2.Header.Seqid)
			}
			needCryptsetup(t)
			repaired := fileHash(t, p)
			if _, errs, err := cryptsetup(t, pass, "open", "--test-passphrase", "--key-file", "-", p); err != nil {
				t.Fatalf("cryptsetup after repair: %v %s", err, errs)
			}
			if fileHash(t, p) != repaired {
				t.Fatal("cryptsetup found more to repair")
			}
		})
	}
}

// When both copies checksum but one has the higher seqid, that one wins and
// the other is reported stale.
func TestHigherSeqidWins(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{})
	v.Close()
	rewriteJSON(t, p, 5, []bool{false}, func(m map[string]any) {
		m["config"].(map[string]any)["flags"] = []string{"allow-discards"}
	})
	v, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if v.Header.Source != "secondary" || v.Header.Seqid != 6 || len(v.Flags()) != 1 {
		t.Fatalf("source %s seqid %d flags %v", v.Header.Source, v.Header.Seqid, v.Flags())
	}
	if len(v.Header.Damaged) != 1 || !strings.Contains(v.Header.Damaged[0], "stale") {
		t.Fatalf("damaged %v", v.Header.Damaged)
	}
}

// Copies that checksum, share a seqid and disagree are refused: one of them
// was written by someone else.
func TestSameSeqidDifferentMetadataRefused(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{})
	v.Close()
	rewriteJSON(t, p, 0, []bool{true}, func(m map[string]any) {
		m["config"].(map[string]any)["flags"] = []string{"allow-discards"}
	})
	if _, err := Open(p, false); err == nil || !strings.Contains(err.Error(), "same seqid") {
		t.Fatalf("Open: %v", err)
	}
}

// Headers tampered with by someone who recomputed the checksums are
// refused, whichever copy carries the change, with the field named.
func TestTamperedHeadersRefused(t *testing.T) {
	cases := []struct {
		name  string
		field string
		edit  func(m map[string]any)
	}{
		{"null cipher", "segments.0.encryption", func(m map[string]any) {
			seg(m)["encryption"] = "cipher_null-ecb"
		}},
		{"null keyslot cipher", "keyslots.0.area", func(m map[string]any) {
			m["keyslots"].(map[string]any)["0"].(map[string]any)["area"].(map[string]any)["encryption"] = "cipher_null-ecb"
		}},
		{"requirements array", "config.requirements", func(m map[string]any) {
			m["config"].(map[string]any)["requirements"] = []string{"offline-reencrypt"}
		}},
		{"requirements mandatory", "config.requirements", func(m map[string]any) {
			m["config"].(map[string]any)["requirements"] = map[string]any{"mandatory": []string{"online-reencrypt-v2"}}
		}},
		{"two segments", "segments", func(m map[string]any) {
			s2 := map[string]any{}
			for k, v := range seg(m) {
				s2[k] = v
			}
			s2["offset"] = "33554432"
			m["segments"].(map[string]any)["1"] = s2
		}},
		{"integrity", "segments.0.integrity", func(m map[string]any) {
			seg(m)["integrity"] = map[string]any{"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"}
		}},
		{"cbc cipher", "segments.0.encryption", func(m map[string]any) {
			seg(m)["encryption"] = "aes-cbc-essiv:sha256"
		}},
		{"odd sector size", "segments.0.sector_size", func(m map[string]any) {
			seg(m)["sector_size"] = 8192
		}},
		{"unknown field", "json", func(m map[string]any) {
			seg(m)["shiny"] = true
		}},
		{"data over keyslots", "segments.0.offset", func(m map[string]any) {
			seg(m)["offset"] = "32768"
		}},
		{"huge argon2 memory", "keyslots.0.kdf.memory", func(m map[string]any) {
			m["keyslots"].(map[string]any)["0"].(map[string]any)["kdf"].(map[string]any)["memory"] = 1 << 30
		}},
		{"unbound keyslot", "digests.0.keyslots", func(m map[string]any) {
			m["digests"].(map[string]any)["0"].(map[string]any)["keyslots"] = []string{}
		}},
	}
	for _, c := range cases {
		for _, copies := range [][]bool{{true, false}, {true}} {
			name := c.name + "/both"
			bump := uint64(0)
			if len(copies) == 1 {
				name, bump = c.name+"/primary-newer", 1
			}
			t.Run(name, func(t *testing.T) {
				p, v := formatImage(t, 64<<20, FormatOptions{})
				v.Close()
				rewriteJSON(t, p, bump, copies, c.edit)
				_, err := Open(p, false)
				var ve *ValidationError
				if !errors.As(err, &ve) {
					t.Fatalf("Open accepted or failed otherwise: %v", err)
				}
				if ve.Field != c.field {
					t.Fatalf("refused field %q (%v), want %q", ve.Field, err, c.field)
				}
				if !strings.Contains(err.Error(), p) {
					t.Fatalf("error does not name the device: %v", err)
				}
			})
		}
	}
}

// A key given twice (which copy wins differs between JSON parsers) is
// refused, even when both copies are valid.
func TestDuplicateJSONKeyRefused(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{})
	v.Close()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, off := range []uint64{0, formatHdrSize} {
		hc, err := readCopy(f, off)
		if err != nil {
			t.Fatal(err)
		}
		hc.json = bytes.Replace(hc.json, []byte(`"encryption":"aes-xts-plain64","sector_size"`), []byte(`"encryption":"aes-xts-plain64","encryption":"cipher_null-ecb","sector_size"`), 1)
		if !bytes.Contains(hc.json, []byte("cipher_null")) {
			t.Fatalf("segment not found in %s", hc.json)
		}
		buf, err := encodeCopy(hc)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(buf, int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	_, err = Open(p, false)
	var ve *ValidationError
	if !errors.As(err, &ve) || ve.Field != "segments.0.encryption" || !strings.Contains(err.Error(), "more than once") {
		t.Fatalf("Open: %v", err)
	}
}

func seg(m map[string]any) map[string]any {
	return m["segments"].(map[string]any)["0"].(map[string]any)
}

// Refusals also hold for what cryptsetup itself writes when asked for a
// layout we do not support.
func TestCryptsetupUnsupportedLayoutsRefused(t *testing.T) {
	needCryptsetup(t)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"cbc-essiv", []string{"--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newImage(t, 40<<20)
			args := append([]string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"}, c.args...)
			if _, errs, err := cryptsetup(t, []byte("x"), append(args, p)...); err != nil {
				t.Fatalf("luksFormat: %v %s", err, errs)
			}
			_, err := Open(p, false)
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("Open: %v", err)
			}
		})
	}
}

func TestNotLUKS(t *testing.T) {
	p := newImage(t, 1<<20)
	if _, err := Open(p, false); !errors.Is(err, ErrNotLUKS2) {
		t.Fatalf("blank image: %v", err)
	}
}
