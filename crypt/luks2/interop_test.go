package luks2

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	luksgo "github.com/anatol/luks.go"
)

// Every volume this package formats must be accepted by cryptsetup (the
// reference implementation) without any checksum complaint and without
// cryptsetup feeling the need to rewrite it, and must open to the same
// volume key there.
func TestFormatAcceptedByCryptsetup(t *testing.T) {
	needCryptsetup(t)
	cases := []struct {
		sector, keySize int
		kdf             KDFParams
	}{
		{512, 64, testKDF},
		{4096, 64, testKDF},
		{4096, 32, testKDF},
		{512, 64, KDFParams{Type: "pbkdf2", Iterations: 1000, Hash: "sha256"}},
		{4096, 64, KDFParams{Type: "argon2i", Time: 4, MemoryKiB: 8 << 10, Threads: 2}},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s-sector%d-key%d", c.kdf.Type, c.sector, c.keySize*8), func(t *testing.T) {
			pass := []byte("pass phrase\nwith newline")
			p, v := formatImage(t, 40<<20, FormatOptions{Passphrase: pass, SectorSize: c.sector, KeySize: c.keySize, KDF: c.kdf, Label: "vol1"})
			key, slot, err := v.Unlock(pass)
			if err != nil || slot != 0 {
				t.Fatalf("Unlock: slot %d err %v", slot, err)
			}
			v.Close()
			before := fileHash(t, p)

			out, errs, err := cryptsetup(t, nil, "luksDump", p)
			if err != nil {
				t.Fatalf("luksDump: %v\n%s", err, errs)
			}
			low := strings.ToLower(out + errs)
			for _, bad := range []string{"checksum", "corrupt", "error", "repair"} {
				if strings.Contains(low, bad) {
					t.Fatalf("luksDump output mentions %q:\n%s%s", bad, out, errs)
				}
			}
			for _, want := range []string{"Version:       \t2", fmt.Sprintf("sector: %d [bytes]", c.sector), "cipher: aes-xts-plain64", fmt.Sprintf("Key:        %d bits", c.keySize*8), "Label:         \tvol1"} {
				if !strings.Contains(out, want) {
					t.Errorf("luksDump lacks %q:\n%s", want, out)
				}
			}
			if after := fileHash(t, p); after != before {
				t.Fatal("cryptsetup luksDump changed the image: it found something to repair")
			}

			if _, errs, err := cryptsetup(t, pass, "open", "--test-passphrase", "--key-file", "-", p); err != nil {
				t.Fatalf("cryptsetup open --test-passphrase rejected our passphrase: %v %s", err, errs)
			}
			if _, _, err := cryptsetup(t, []byte("wrong"), "open", "--test-passphrase", "--key-file", "-", p); err == nil {
				t.Fatal("cryptsetup accepted a wrong passphrase")
			}
			if got := dumpVolumeKey(t, p, pass); !bytes.Equal(got, key) {
				t.Fatalf("cryptsetup's volume key %x differs from ours %x", got, key)
			}
			if after := fileHash(t, p); after != before {
				t.Fatal("cryptsetup changed the image while opening it")
			}

			// luks.go, an independent implementation, unseals it too.
			d, err := luksgo.Open(p)
			if err != nil {
				t.Fatalf("luks.go Open: %v", err)
			}
			defer d.Close()
			vol, err := d.UnsealVolume(0, pass)
			if err != nil {
				t.Fatalf("luks.go UnsealVolume: %v", err)
			}
			if vol.StorageSectorSize != uint64(c.sector) || vol.StorageOffset != formatDataOffset || vol.StorageEncryption != cipherXTS {
				t.Fatalf("luks.go reads segment %+v", vol)
			}
		})
	}
}

// Every volume cryptsetup formats with the supported layout must open here
// to the same volume key, including one carrying our token.
func TestCryptsetupFormattedVolumesUnlock(t *testing.T) {
	needCryptsetup(t)
	cases := []struct {
		name string
		args []string
	}{
		{"pbkdf2-512", []string{"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--sector-size", "512"}},
		{"pbkdf2-4096-sha512", []string{"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--sector-size", "4096", "--hash", "sha512"}},
		{"argon2id-512", []string{"--pbkdf", "argon2id", "--pbkdf-force-iterations", "4", "--pbkdf-memory", "8192", "--pbkdf-parallel", "1", "--sector-size", "512"}},
		{"argon2id-4096-aes256", []string{"--pbkdf", "argon2id", "--pbkdf-force-iterations", "4", "--pbkdf-memory", "8192", "--pbkdf-parallel", "2", "--sector-size", "4096", "--key-size", "256"}},
		{"pbkdf2-512-metadata64k", []string{"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--sector-size", "512", "--luks2-metadata-size", "65536", "--luks2-keyslots-size", "2097152"}},
		{"argon2i-4096-token", []string{"--pbkdf", "argon2i", "--pbkdf-force-iterations", "4", "--pbkdf-memory", "8192", "--pbkdf-parallel", "1", "--sector-size", "4096"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newImage(t, 40<<20)
			pass := []byte("cryptsetup made me")
			withToken := strings.HasSuffix(c.name, "-token")
			luksFormatWithCryptsetup(t, p, pass, c.args, withToken)
			want := dumpVolumeKey(t, p, pass)
			before := fileHash(t, p)

			readsAndUnlocksToTheKey(t, p, pass, want, withToken)
			if fileHash(t, p) != before {
				t.Fatal("reading and unlocking changed the image")
			}
			keyslotWeAddWorksInCryptsetup(t, p, pass, want)
		})
	}
}

// luksFormatWithCryptsetup formats image p with cryptsetup, with the extra
// arguments args, and imports a transit token as token 2 if withToken.
func luksFormatWithCryptsetup(t *testing.T, p string, pass []byte, extra []string, withToken bool) {
	t.Helper()
	args := append([]string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-"}, extra...)
	if _, errs, err := cryptsetup(t, pass, append(args, p)...); err != nil {
		t.Fatalf("luksFormat: %v %s", err, errs)
	}
	if withToken {
		tok := `{"type":"vco-transit","keyslots":["0"],"mount":"transit","key_name":"volumes","key_version":3,"ciphertext":"vault:v3:abcd"}`
		tf := filepath.Join(t.TempDir(), "tok.json")
		if err := os.WriteFile(tf, []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, errs, err := cryptsetup(t, nil, "token", "import", "--json-file", tf, "--token-id", "2", p); err != nil {
			t.Fatalf("token import: %v %s", err, errs)
		}
	}
}

// readsAndUnlocksToTheKey opens cryptsetup's volume on p read-only: its
// primary header is whole, pass (and no other passphrase) unlocks slot 0
// to want, luks.go agrees, and the token imported (if withToken) reads
// back.
func readsAndUnlocksToTheKey(t *testing.T, p string, pass, want []byte, withToken bool) {
	t.Helper()
	v, err := Open(p, false)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer v.Close()
	if len(v.Header.Damaged) != 0 || v.Header.Source != "primary" {
		t.Fatalf("header from %s, damaged %v", v.Header.Source, v.Header.Damaged)
	}
	key, slot, err := v.Unlock(pass)
	if err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	if slot != 0 || !bytes.Equal(key, want) {
		t.Fatalf("slot %d key %x, cryptsetup says %x", slot, key, want)
	}
	if _, _, err := v.Unlock([]byte("cryptsetup made me!")); err == nil {
		t.Fatal("a wrong passphrase unlocked the volume")
	}
	luksGoReadsTheSameVolume(t, p, pass, v)
	if withToken {
		id, tok, err := v.TransitToken()
		if err != nil {
			t.Fatal(err)
		}
		if id != 2 || tok.KeyName != "volumes" || tok.KeyVersion != 3 || tok.Ciphertext != "vault:v3:abcd" || tok.Mount != "transit" || len(tok.Keyslots) != 1 || tok.Keyslots[0] != 0 {
			t.Fatalf("token %d %+v", id, tok)
		}
	}
}

// luksGoReadsTheSameVolume: luks.go, the agent's unlock, opens p too (its
// digest check confirms the key it recovered) and reads the same segment
// as v; a wrong passphrase does not match.
func luksGoReadsTheSameVolume(t *testing.T, p string, pass []byte, v *Volume) {
	t.Helper()
	d, err := luksgo.Open(p)
	if err != nil {
		t.Fatalf("luks.go Open: %v", err)
	}
	defer d.Close()
	vol, err := d.UnsealVolume(0, pass)
	if err != nil {
		t.Fatalf("luks.go UnsealVolume: %v", err)
	}
	if vol.UUID != v.Header.UUID || vol.StorageOffset != v.DataOffset() || vol.StorageSectorSize != uint64(v.SectorSize()) || vol.StorageEncryption != v.Cipher() {
		t.Fatalf("luks.go reads %+v", vol)
	}
	if _, err := d.UnsealVolume(0, []byte("cryptsetup made me!")); !errors.Is(err, luksgo.ErrPassphraseDoesNotMatch) {
		t.Fatalf("luks.go with a wrong passphrase: %v", err)
	}
}

// keyslotWeAddWorksInCryptsetup: a keyslot we add to cryptsetup's volume
// on p works in cryptsetup, holds the volume key want, and cryptsetup
// leaves the header we edited as it is.
func keyslotWeAddWorksInCryptsetup(t *testing.T, p string, pass, want []byte) {
	t.Helper()
	w, err := Open(p, true)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	n, err := w.AddKeyslot(pass, []byte("added by us"), testKDF)
	if err != nil {
		t.Fatalf("AddKeyslot: %v", err)
	}
	edited := fileHash(t, p)
	if _, errs, err := cryptsetup(t, []byte("added by us"), "open", "--test-passphrase", "--key-slot", fmt.Sprint(n), "--key-file", "-", p); err != nil {
		t.Fatalf("cryptsetup rejects the keyslot we added: %v %s", err, errs)
	}
	if got := dumpVolumeKey(t, p, []byte("added by us")); !bytes.Equal(got, want) {
		t.Fatal("the added keyslot holds another volume key")
	}
	if fileHash(t, p) != edited {
		t.Fatal("cryptsetup rewrote the header we edited")
	}
}

// A token we write is stored where cryptsetup finds it, and keyslots we add
// open in cryptsetup too.
func TestTokenAndKeyslotsSeenByCryptsetup(t *testing.T) {
	needCryptsetup(t)
	p, v := formatImage(t, 40<<20, FormatOptions{Passphrase: []byte("first")})
	n, err := v.AddKeyslot([]byte("first"), []byte("second"), testKDF)
	if err != nil || n != 1 {
		t.Fatalf("AddKeyslot: %d %v", n, err)
	}
	id, err := v.SetTransitToken(TransitToken{Keyslots: []int{1}, KeyName: "k1", KeyVersion: 2, Ciphertext: "vault:v2:Zm9v"})
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
	out, errs, err := cryptsetup(t, nil, "token", "export", "--token-id", fmt.Sprint(id), p)
	if err != nil {
		t.Fatalf("token export: %v %s", err, errs)
	}
	var tok map[string]any
	if err := json.Unmarshal([]byte(out), &tok); err != nil {
		t.Fatal(err)
	}
	if tok["type"] != TransitTokenType || tok["key_name"] != "k1" || tok["ciphertext"] != "vault:v2:Zm9v" {
		t.Fatalf("cryptsetup exports %v", tok)
	}
	for slot, pass := range []string{"first", "second"} {
		if _, errs, err := cryptsetup(t, []byte(pass), "open", "--test-passphrase", "--key-slot", fmt.Sprint(slot), "--key-file", "-", p); err != nil {
			t.Fatalf("slot %d: %v %s", slot, err, errs)
		}
	}
	dump, _, err := cryptsetup(t, nil, "luksDump", p)
	if err != nil || !strings.Contains(dump, "vco-transit") || !strings.Contains(dump, "Epoch:         \t3") {
		t.Fatalf("luksDump: %v\n%s", err, dump)
	}
}
