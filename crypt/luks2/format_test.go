package luks2

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// P5: Format refuses any device that holds a signature, made by the real
// tools where they are installed.
func TestFormatRefusesExistingData(t *testing.T) {
	cases := []struct {
		name string
		want string
		prep func(t *testing.T, p string)
	}{
		{"ext4", "ext2/ext3/ext4", func(t *testing.T, p string) { run(t, "mkfs.ext4", "-q", "-F", p) }},
		{"xfs", "xfs", func(t *testing.T, p string) { run(t, "mkfs.xfs", "-q", "-f", p) }},
		{"dos partition table", "DOS partition table", func(t *testing.T, p string) { sfdisk(t, p, "label: dos\n,10M\n") }},
		{"gpt", "GPT", func(t *testing.T, p string) { sfdisk(t, p, "label: gpt\n,10M\n") }},
		{"luks2 by cryptsetup", "LUKS", func(t *testing.T, p string) {
			if _, errs, err := cryptsetup(t, []byte("x"), "luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", p); err != nil {
				t.Fatalf("%v %s", err, errs)
			}
		}},
		{"luks2 secondary only", "LUKS2 secondary", func(t *testing.T, p string) {
			if _, errs, err := cryptsetup(t, []byte("x"), "luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", p); err != nil {
				t.Fatalf("%v %s", err, errs)
			}
			corrupt(t, p, 0, make([]byte, 4096))
		}},
		{"btrfs magic", "btrfs", func(t *testing.T, p string) { corrupt(t, p, 64<<10+64, []byte("_BHRfS_M")) }},
		{"swap", "swap", func(t *testing.T, p string) { run(t, "mkswap", p) }},
		{"gpt backup only", "GPT backup", func(t *testing.T, p string) { corrupt(t, p, 48<<20-512, []byte("EFI PART")) }},
		{"registered magic", "test lease", func(t *testing.T, p string) {
			ExtraSignatures = append(ExtraSignatures, Signature{Name: "test lease", Offset: 8192, Magic: []byte("TESTMAGC")})
			t.Cleanup(func() { ExtraSignatures = nil })
			corrupt(t, p, 8192, []byte("TESTMAGC"))
		}},
		{"disk lease", "vco-agent disk lease", func(t *testing.T, p string) { corrupt(t, p, 0, []byte("VCOLEASE\x00\x00\x00\x01")) }},
		{"random data", "unrecognised", func(t *testing.T, p string) { corrupt(t, p, 40000, []byte{7}) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			size := int64(48 << 20)
			if c.name == "xfs" {
				size = 300<<20 + 4<<20 // mkfs.xfs wants 300 MB
			}
			p := newImage(t, size)
			c.prep(t, p)
			before := fileHash(t, p)
			_, err := Format(p, FormatOptions{Passphrase: []byte("x"), KDF: testKDF, DigestIterations: testDigestIter})
			if !errors.Is(err, ErrSignature) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), p) {
				t.Fatalf("Format over %s: %v", c.name, err)
			}
			if fileHash(t, p) != before {
				t.Fatal("a refused format wrote to the device")
			}
			v, err := Format(p, FormatOptions{Passphrase: []byte("x"), KDF: testKDF, DigestIterations: testDigestIter, Force: true})
			if err != nil {
				t.Fatalf("forced format: %v", err)
			}
			v.Close()
		})
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v %s", name, err, out)
	}
}

func sfdisk(t *testing.T, p, script string) {
	t.Helper()
	cmd := exec.Command("sfdisk", "-q", p)
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk: %v %s", err, out)
	}
}

func TestFormatRejectsBadGeometry(t *testing.T) {
	small := newImage(t, 16<<20)
	if _, err := Format(small, FormatOptions{Passphrase: []byte("x")}); err == nil || !strings.Contains(err.Error(), "too small") {
		t.Fatalf("small device: %v", err)
	}
	odd := newImage(t, 32<<20+512)
	if _, err := Format(odd, FormatOptions{Passphrase: []byte("x"), SectorSize: 4096}); err == nil || !strings.Contains(err.Error(), "multiple") {
		t.Fatalf("unaligned device: %v", err)
	}
	v, err := Format(odd, FormatOptions{Passphrase: []byte("x"), SectorSize: 512, KDF: testKDF, DigestIterations: testDigestIter})
	if err != nil {
		t.Fatalf("512-byte sectors on the same device: %v", err)
	}
	n, _ := v.DataSize()
	if n != 16<<20+512 {
		t.Fatalf("data size %d", n)
	}
	v.Close()
}

// crashDevice passes writes and syncs through until the budget of
// operations runs out, then fails every later one, as a power cut would.
type crashDevice struct {
	device
	budget int
}

func (c *crashDevice) WriteAt(b []byte, off int64) (int, error) {
	if c.budget <= 0 {
		return 0, errors.New("simulated crash")
	}
	c.budget--
	return c.device.WriteAt(b, off)
}

func (c *crashDevice) Sync() error {
	if c.budget <= 0 {
		return errors.New("simulated crash")
	}
	c.budget--
	return c.device.Sync()
}

// A format interrupted after any number of writes leaves either no valid
// header at all (an old header over the device is gone too) or the
// complete new volume that opens with the new passphrase.
func TestFormatCrashLeavesNoHalfHeader(t *testing.T) {
	complete, sawGone, sawNew := false, false, false
	old := &memDevice{b: make([]byte, formatDataOffset+1<<20)}
	if _, err := format(old, "old", FormatOptions{Passphrase: []byte("old"), KDF: testKDF, DigestIterations: testDigestIter}); err != nil {
		t.Fatal(err)
	}
	for budget := 0; !complete; budget++ {
		m := &memDevice{b: bytes.Clone(old.b)}
		o := FormatOptions{Passphrase: []byte("new"), KDF: testKDF, DigestIterations: testDigestIter, Force: true, SectorSize: 4096}
		_, ferr := format(&crashDevice{device: m, budget: budget}, "mem", o)
		complete = ferr == nil
		h, err := readHeader(m, "mem")
		v := &Volume{path: "mem", f: m, Header: h}
		switch {
		case errors.Is(err, ErrNotLUKS2):
			sawGone = true
			if complete || sawNew {
				t.Fatal("format reported success but left no header")
			}
		case err != nil:
			t.Fatalf("after %d writes: a half-written header: %v", budget, err)
		default:
			_, _, errNew := v.Unlock([]byte("new"))
			_, _, errOld := v.Unlock([]byte("old"))
			v.Close()
			switch {
			case errNew == nil && errOld != nil:
				sawNew = true
			case errOld == nil && errNew != nil && !sawGone && !sawNew:
				// Nothing reached the old header yet.
			default:
				t.Fatalf("after %d writes: new passphrase: %v, old passphrase: %v (damaged %v)", budget, errNew, errOld, v.Header.Damaged)
			}
		}
		if budget > 100 {
			t.Fatal("format never completes")
		}
	}
	if !sawGone || !sawNew {
		t.Fatalf("the crash points never hit the window between wipe and header (gone %v, new %v)", sawGone, sawNew)
	}
}

// Keyslot rotation: add a slot, remove the old one, never the last one,
// never without proof that another slot works.
func TestKeyslotRotation(t *testing.T) {
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("one")})
	key0, _, err := v.Unlock([]byte("one"))
	if err != nil {
		t.Fatal(err)
	}
	area := addSlotTwoThenRemoveSlotOne(t, v)
	v.Close()

	v, err = Open(p, true)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if _, _, err := v.Unlock([]byte("one")); !errors.Is(err, ErrWrongPassphrase) {
		t.Fatalf("old passphrase after removal: %v", err)
	}
	key1, slot, err := v.Unlock([]byte("two"))
	if err != nil || slot != 1 || !bytes.Equal(key0, key1) {
		t.Fatalf("new passphrase: slot %d err %v", slot, err)
	}
	f, _ := os.Open(p)
	defer f.Close()
	buf := make([]byte, area.Size)
	f.ReadAt(buf, int64(area.Offset))
	if !allZero(buf) {
		t.Fatal("the removed slot's key material was not wiped")
	}
	// The freed area is reused by the next slot.
	n, err := v.AddKeyslot([]byte("two"), []byte("three"), KDFParams{Type: "pbkdf2", Iterations: 1000})
	if err != nil || n != 0 || v.Header.Meta.Keyslots["0"].Area.Offset != area.Offset {
		t.Fatalf("re-add: slot %d err %v", n, err)
	}
	needCryptsetup(t)
	for slot, pass := range map[string]string{"0": "three", "1": "two"} {
		if _, errs, err := cryptsetup(t, []byte(pass), "open", "--test-passphrase", "--key-slot", slot, "--key-file", "-", p); err != nil {
			t.Fatalf("cryptsetup slot %s: %v %s", slot, err, errs)
		}
	}
}

// addSlotTwoThenRemoveSlotOne rotates v's only passphrase "one" (slot 0)
// to "two" (slot 1): the only slot is never removed, a slot is added only
// with a passphrase that opens one and gets an area of its own, and slot 0
// goes only with proof that another slot works. It returns slot 0's area.
func addSlotTwoThenRemoveSlotOne(t *testing.T, v *Volume) Area {
	t.Helper()
	if err := v.RemoveKeyslot(0, []byte("one")); err == nil || !strings.Contains(err.Error(), "last") {
		t.Fatalf("removing the only slot: %v", err)
	}
	if _, err := v.AddKeyslot([]byte("wrong"), []byte("two"), testKDF); !errors.Is(err, ErrWrongPassphrase) {
		t.Fatalf("AddKeyslot with a wrong passphrase: %v", err)
	}
	n, err := v.AddKeyslot([]byte("one"), []byte("two"), testKDF)
	if err != nil || n != 1 {
		t.Fatalf("AddKeyslot: %d %v", n, err)
	}
	if v.Header.Meta.Keyslots["1"].Area.Offset == v.Header.Meta.Keyslots["0"].Area.Offset {
		t.Fatal("two keyslots share an area")
	}
	if err := v.RemoveKeyslot(0, []byte("one")); err == nil {
		t.Fatal("removed slot 0 with a passphrase that only opens slot 0")
	}
	area := v.Header.Meta.Keyslots["0"].Area
	if err := v.RemoveKeyslot(0, []byte("two")); err != nil {
		t.Fatal(err)
	}
	return area
}

func TestRemoveKeyslotDropsItsTokens(t *testing.T) {
	_, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("a")})
	if _, err := v.AddKeyslot([]byte("a"), []byte("b"), testKDF); err != nil {
		t.Fatal(err)
	}
	if _, err := v.SetTransitToken(TransitToken{Keyslots: []int{0}, KeyName: "k", KeyVersion: 1, Ciphertext: "vault:v1:x"}); err != nil {
		t.Fatal(err)
	}
	if err := v.RemoveKeyslot(0, []byte("b")); err != nil {
		t.Fatal(err)
	}
	if id, tok, err := v.TransitToken(); err != nil || tok != nil || id != -1 {
		t.Fatalf("token of a removed slot survives: %d %+v %v", id, tok, err)
	}
}

// A keyslot or token change interrupted at any write leaves a volume that
// opens with the passphrase it had before, and after the last header write
// also with the new one.
func TestHeaderUpdateCrash(t *testing.T) {
	for budget := 0; ; budget++ {
		p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("one")})
		f := v.f.(*os.File)
		v.f = &crashDevice{device: f, budget: budget}
		_, addErr := v.AddKeyslot([]byte("one"), []byte("two"), testKDF)
		v.f = f
		v.Close()

		v2, err := Open(p, false)
		if err != nil {
			t.Fatalf("after %d writes: %v", budget, err)
		}
		if _, _, err := v2.Unlock([]byte("one")); err != nil {
			t.Fatalf("after %d writes: the old passphrase fails: %v", budget, err)
		}
		_, _, newErr := v2.Unlock([]byte("two"))
		newSlot := len(v2.Header.Meta.Keyslots) == 2
		v2.Close()
		if newSlot != (newErr == nil) {
			t.Fatalf("after %d writes: keyslot 1 listed %v but the new passphrase gives %v", budget, newSlot, newErr)
		}
		if addErr == nil {
			if !newSlot {
				t.Fatal("AddKeyslot succeeded but the slot is not there")
			}
			return
		}
		if budget > 20 {
			t.Fatal("AddKeyslot never completes")
		}
	}
}
