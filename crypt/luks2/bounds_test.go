package luks2

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func keyslot0(m map[string]any) map[string]any {
	return m["keyslots"].(map[string]any)["0"].(map[string]any)
}

func kdf0(m map[string]any) map[string]any { return keyslot0(m)["kdf"].(map[string]any) }

func digest0(m map[string]any) map[string]any {
	return m["digests"].(map[string]any)["0"].(map[string]any)
}

// asPBKDF2 turns keyslot 0's KDF into pbkdf2 with the given hash and count
// (the key material then no longer opens, which a header check never sees).
func asPBKDF2(m map[string]any, hash string, iterations int) {
	k := kdf0(m)
	delete(k, "time")
	delete(k, "memory")
	delete(k, "cpus")
	k["type"], k["hash"], k["iterations"] = "pbkdf2", hash, iterations
}

func setArgon(m map[string]any, time, memory, cpus int) {
	k := kdf0(m)
	k["time"], k["memory"], k["cpus"] = time, memory, cpus
}

// Defect 5: a header is not secret, and one asking for a KDF cost of 2^30
// (or for more memory than a node can give) kept whoever unlocked it busy
// for years. Such headers are refused when read, before any key
// derivation, naming the field, the value and the bound. On the code
// before the bounds, Open accepted every one of these headers (the test
// only opens, it never runs the KDF; it uses no name the fix added, so it
// runs unchanged against that code).
func TestHostileKDFCostsRefused(t *testing.T) {
	const huge = 1 << 30
	cases := []struct {
		name, field, value string
		edit               func(m map[string]any)
	}{
		{"argon2 time 2^30", "keyslots.0.kdf.time", "1073741824", func(m map[string]any) {
			kdf0(m)["time"] = huge
		}},
		{"argon2 memory 4 GiB", "keyslots.0.kdf.memory", "4194304", func(m map[string]any) {
			kdf0(m)["memory"] = 4 << 20
		}},
		{"argon2 memory one block above 1 GiB", "keyslots.0.kdf.memory", "1048577", func(m map[string]any) {
			kdf0(m)["memory"] = 1<<20 + 1
		}},
		{"argon2 64 passes over 1 GiB", "keyslots.0.kdf.time", "64", func(m map[string]any) {
			setArgon(m, 64, 1<<20, 4)
		}},
		{"argon2 17 lanes", "keyslots.0.kdf.cpus", "17", func(m map[string]any) {
			kdf0(m)["cpus"] = 17
		}},
		{"keyslot pbkdf2 iterations 2^30", "keyslots.0.kdf.iterations", "1073741824", func(m map[string]any) {
			asPBKDF2(m, "sha256", huge)
		}},
		{"digest pbkdf2 iterations 2^30", "digests.0.iterations", "1073741824", func(m map[string]any) {
			digest0(m)["iterations"] = huge
		}},
		{"digest of 4 KiB", "digests.0.digest", "4096", func(m map[string]any) {
			digest0(m)["digest"] = make([]byte, 4096)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, v := formatImage(t, 32<<20, FormatOptions{})
			v.Close()
			rewriteJSON(t, p, 0, []bool{true, false}, c.edit)
			if os.Getenv("VCO_WRITE_FUZZ_SEEDS") != "" {
				writeFuzzSeed(t, p, "hostile-"+strings.NewReplacer(" ", "-", "^", "").Replace(c.name))
			}
			start := time.Now()
			w, err := Open(p, false)
			took := time.Since(start)
			if err == nil {
				w.Close()
				t.Fatal("Open accepted the header; an unlock would run its key derivation")
			}
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Field != c.field {
				t.Fatalf("refused otherwise than by field %s: %v", c.field, err)
			}
			msg := err.Error()
			for _, want := range []string{p, c.field, c.value, "bound"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error does not say %q: %s", want, msg)
				}
			}
			if c.field != "keyslots.0.kdf.cpus" && c.field != "digests.0.digest" && !strings.Contains(msg, "cryptsetup") {
				t.Errorf("error does not say what the operator can do: %s", msg)
			}
			t.Log(msg)
			if took > time.Second {
				t.Errorf("refusing the header took %v", took)
			}
		})
	}
}

// The bounds themselves are admitted: a header at each bound opens (it is
// only read here), one step above is refused. The values at the bounds lie
// above what cryptsetup's defaults choose on fast hardware (docs/encryption.md).
func TestKDFCostBoundsAdmitGenuineHeaders(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(m map[string]any)
		field string // "" when the header is admitted
	}{
		{"argon2id 32 passes over 1 GiB, 4 lanes", func(m map[string]any) { setArgon(m, 32, MaxArgonMemoryKiB, 4) }, ""},
		{"argon2id 33 passes over 1 GiB", func(m map[string]any) { setArgon(m, 33, MaxArgonMemoryKiB, 4) }, "keyslots.0.kdf.time"},
		{"argon2id 4096 passes over 8 MiB", func(m map[string]any) { setArgon(m, MaxArgonTime, 8<<10, 1) }, ""},
		{"argon2id 4097 passes over 8 KiB", func(m map[string]any) { setArgon(m, MaxArgonTime+1, 8, 1) }, "keyslots.0.kdf.time"},
		{"argon2id 16 lanes", func(m map[string]any) { setArgon(m, 4, 64<<10, MaxArgonThreads) }, ""},
		// The formatted key is 64 bytes: two sha256 blocks, one sha512 block.
		{"pbkdf2-sha256 at the bound", func(m map[string]any) { asPBKDF2(m, "sha256", MaxPBKDF2Blocks/2) }, ""},
		{"pbkdf2-sha256 above the bound", func(m map[string]any) { asPBKDF2(m, "sha256", MaxPBKDF2Blocks/2+1) }, "keyslots.0.kdf.iterations"},
		{"pbkdf2-sha512 at the bound", func(m map[string]any) { asPBKDF2(m, "sha512", MaxPBKDF2Blocks) }, ""},
		{"pbkdf2-sha1 above the bound", func(m map[string]any) { asPBKDF2(m, "sha1", MaxPBKDF2Blocks/4+1) }, "keyslots.0.kdf.iterations"},
		{"digest at the bound", func(m map[string]any) { digest0(m)["iterations"] = MaxDigestBlocks }, ""},
		{"digest above the bound", func(m map[string]any) { digest0(m)["iterations"] = MaxDigestBlocks + 1 }, "digests.0.iterations"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, v := formatImage(t, 32<<20, FormatOptions{})
			v.Close()
			rewriteJSON(t, p, 0, []bool{true, false}, c.edit)
			w, err := Open(p, false)
			if c.field == "" {
				if err != nil {
					t.Fatalf("a header at the bound is refused: %v", err)
				}
				w.Close()
				return
			}
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Field != c.field {
				t.Fatalf("want a refusal of %s, got %v", c.field, err)
			}
		})
	}
}

// Neither can the bounds be exceeded by what this package writes: a
// keyslot asked for beyond them is refused before anything is written.
func TestFormatRefusesCostsBeyondBounds(t *testing.T) {
	for _, p := range []KDFParams{
		{Type: "argon2id", Time: 4, MemoryKiB: 2 << 20, Threads: 1},
		{Type: "argon2id", Time: 64, MemoryKiB: 1 << 20, Threads: 1},
		{Type: "pbkdf2", Hash: "sha256", Iterations: MaxPBKDF2Blocks},
	} {
		img := newImage(t, 32<<20)
		_, err := Format(img, FormatOptions{Passphrase: []byte("x"), KDF: p, DigestIterations: testDigestIter})
		if err == nil || !strings.Contains(err.Error(), "bound") {
			t.Errorf("Format with %+v: %v", p, err)
		}
	}
	img := newImage(t, 32<<20)
	_, err := Format(img, FormatOptions{Passphrase: []byte("x"), KDF: testKDF, DigestIterations: MaxDigestBlocks + 1})
	if err == nil || !strings.Contains(err.Error(), "digests.0.iterations") {
		t.Errorf("Format with digest iterations above the bound: %v", err)
	}
}

// Headers cryptsetup writes with its own defaults (a 2 s benchmark of
// argon2id, or of pbkdf2) pass the bounds. cryptsetup is the oracle here:
// whatever cost it settles on on this machine must be admitted.
func TestCryptsetupDefaultCostsAdmitted(t *testing.T) {
	needCryptsetup(t)
	for _, args := range [][]string{
		{},
		{"--pbkdf", "pbkdf2"},
	} {
		t.Run(fmt.Sprint(args), func(t *testing.T) {
			p := newImage(t, 40<<20)
			a := append([]string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-"}, args...)
			if _, errs, err := cryptsetup(t, []byte("defaults"), append(a, p)...); err != nil {
				t.Fatalf("luksFormat: %v %s", err, errs)
			}
			v, err := Open(p, false)
			if err != nil {
				t.Fatalf("a header cryptsetup wrote with its defaults is refused: %v", err)
			}
			defer v.Close()
			k := v.Header.Meta.Keyslots["0"].KDF
			t.Logf("cryptsetup chose %s time=%d memory=%d cpus=%d iterations=%d; digest iterations %d",
				k.Type, k.Time, k.Memory, k.CPUs, k.Iterations, v.Header.Meta.digest().Iterations)
		})
	}
}

// writeFuzzSeed stores the JSON area of image p as a seed of
// FuzzParseMetadata (VCO_WRITE_FUZZ_SEEDS=1 go test -run
// TestHostileKDFCostsRefused refreshes the hostile-cost seeds).
func writeFuzzSeed(t *testing.T, p, name string) {
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hc, err := readCopy(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	data := hc.json
	dir := filepath.Join("testdata", "fuzz", "FuzzParseMetadata")
	body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", data)
	if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestWorstAllowedKeyslotTime measures what the bounds still allow: one
// keyslot of each kind at its bound, with the digest at its bound, through
// the real unlock path. It takes minutes, so it runs only when asked
// (VCO_LUKS2_WORST=1); docs/encryption.md quotes its figures. The worst
// header has 32 such keyslots.
func TestWorstAllowedKeyslotTime(t *testing.T) {
	if os.Getenv("VCO_LUKS2_WORST") == "" {
		t.Skip("set VCO_LUKS2_WORST=1 to measure (minutes)")
	}
	p, v := formatImage(t, 32<<20, FormatOptions{})
	if _, err := v.AddKeyslot([]byte("correct horse"), []byte("one"), testKDF); err != nil {
		t.Fatal(err)
	}
	v.Close()
	rewriteJSON(t, p, 0, []bool{true, false}, func(m map[string]any) {
		setArgon(m, MaxArgonWorkKiB/MaxArgonMemoryKiB, MaxArgonMemoryKiB, 4)
		s1 := m["keyslots"].(map[string]any)["1"].(map[string]any)
		s1["kdf"] = map[string]any{"type": "pbkdf2", "hash": "sha512", "iterations": MaxPBKDF2Blocks, "salt": kdf0(m)["salt"]}
		digest0(m)["hash"], digest0(m)["iterations"] = "sha512", MaxDigestBlocks
	})
	w, err := Open(p, false)
	if err != nil {
		t.Fatalf("the worst allowed header is refused: %v", err)
	}
	defer w.Close()
	var worst time.Duration
	for slot, what := range []string{"argon2id 32 passes over 1 GiB, 4 lanes", "pbkdf2-sha512 2^26 iterations"} {
		start := time.Now()
		if _, err := w.UnlockSlot(slot, []byte("x")); !errors.Is(err, ErrWrongPassphrase) {
			t.Fatalf("keyslot %d: %v", slot, err)
		}
		took := time.Since(start)
		worst = max(worst, took)
		t.Logf("keyslot %d (%s, then the digest: pbkdf2-sha512 2^24): %v", slot, what, took)
	}
	t.Logf("worst allowed header, 32 keyslots: about %v", 32*worst)
}
