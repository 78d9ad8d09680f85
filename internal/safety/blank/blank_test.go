package blank

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// image makes a sparse file of size bytes with data written at off (none
// when data is nil).
func image(t *testing.T, size, off int64, data []byte) string {
	t.Helper()
	p := hosttest.SparseFile(t, size)
	if data != nil {
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(data, off); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func needBlkid(t *testing.T) {
	if _, err := exec.LookPath("blkid"); err != nil {
		t.Skip("blkid (util-linux) is not installed")
	}
}

func TestProveNamesWhatItFinds(t *testing.T) {
	needBlkid(t)
	ctx := context.Background()
	const size = 32 << 20
	cases := []struct {
		name string
		off  int64
		data string
		want string
	}{
		{"lease header", 0, LeaseMagic, "lease"},
		{"LUKS primary header", 0, "LUKS\xba\xbe\x00\x02", "LUKS signature at offset 0"},
		{"LUKS2 secondary header at 16 KiB", 16 << 10, "SKUL\xba\xbe\x00\x02", "LUKS2 secondary header signature at offset 16384"},
		{"LUKS2 secondary header at 4 MiB", 4 << 20, "SKUL\xba\xbe\x00\x02", "LUKS2 secondary header at byte 4194304"},
		{"ext4 magic", 1024 + 56, "\x53\xef", "ext2/ext3/ext4"},
		{"a byte in the first MiB", 5000, "x", "5000"},
		{"a byte at the lease data offset", LeaseDataOffset + 4096, "x", "at the lease data offset"},
		{"a byte in the fifth MiB", 4<<20 + 100, "x", "in the first 5 MiB"},
		{"a byte in the last MiB", size - 1, "x", "in the last MiB"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := image(t, size, c.off, []byte(c.data))
			proof, err := Prove(ctx, p)
			var nb *NotBlankError
			if !errors.As(err, &nb) || !strings.Contains(nb.Found, c.want) || proof.Valid() {
				t.Fatalf("Prove: %+v %v; want a refusal naming %q", proof, err, c.want)
			}
			if !strings.Contains(err.Error(), p) {
				t.Fatalf("the refusal does not name the device: %v", err)
			}
		})
	}
}

func TestProveOfABlankImage(t *testing.T) {
	needBlkid(t)
	ctx := context.Background()
	for _, size := range []int64{32 << 20, 3 << 20, 1 << 20} {
		p := image(t, size, 0, nil)
		proof, err := Prove(ctx, p)
		if err != nil || !proof.Valid() || proof.Device() != p || proof.Size() != size || proof.From() != 0 {
			t.Fatalf("%d-byte blank image: %+v %v", size, proof, err)
		}
	}
	if (Proof{}).Valid() {
		t.Fatal("the zero Proof is valid")
	}
}

// A device whose regions are all zeros is proven without keeping them
// (readChecked): that holds only because no check finds anything in
// zeros, which this keeps true of the checks on the regions read whole.
func TestNoCheckFindsAnythingInZeros(t *testing.T) {
	for _, size := range []int64{64 << 20, 5 << 20, 1 << 20} {
		r, err := read(context.Background(), image(t, size, 0, nil))
		if err != nil {
			t.Fatal(err)
		}
		if r.zero {
			t.Fatal("read gave regions it did not keep")
		}
		if sig, h, nz := r.signature(), r.headers(), r.nonZero(); sig != "" || h != "" || nz != "" {
			t.Fatalf("%d bytes of zeros: signature %q, headers %q, non-zero %q; want nothing found", size, sig, h, nz)
		}
		sc, err := allZero(context.Background(), image(t, size, 0, nil))
		if err != nil || !sc.zero || sc.size != size {
			t.Fatalf("allZero of %d bytes of zeros: %+v %v", size, sc, err)
		}
	}
}

func TestProbeBlkidNamesWhatItFinds(t *testing.T) {
	needBlkid(t)
	if _, err := exec.LookPath("mkswap"); err != nil {
		t.Skip("mkswap is not installed")
	}
	p := image(t, 32<<20, 0, nil)
	if found, err := ProbeBlkid(context.Background(), p); err != nil || found != "" {
		t.Fatalf("blkid of a blank image: %q %v", found, err)
	}
	if out, err := exec.Command("mkswap", p).CombinedOutput(); err != nil {
		t.Fatalf("mkswap: %v: %s", err, out)
	}
	found, err := ProbeBlkid(context.Background(), p)
	if err != nil || !strings.Contains(found, "TYPE=swap") {
		t.Fatalf("blkid of a swap image: %q %v", found, err)
	}
}

// Without blkid's answer there is no proof: a blank image whose blkid
// cannot run is not proven blank.
func TestNoProofWithoutBlkid(t *testing.T) {
	p := image(t, 32<<20, 0, nil)
	t.Setenv("PATH", t.TempDir())
	proof, err := Prove(context.Background(), p)
	var nb *NotBlankError
	if err == nil || errors.As(err, &nb) || proof.Valid() {
		t.Fatalf("Prove without blkid: %+v %v; want an error and no proof", proof, err)
	}
}

// ProvePast sets aside what lies before from (the agent's own cut-short
// LUKS2 format) but nothing after it, nor a lease header.
func TestProvePast(t *testing.T) {
	ctx := context.Background()
	const size, from = 64 << 20, 16 << 20
	p := image(t, size, 32<<10, []byte("keyslot material of a format cut short"))
	if proof, err := ProvePast(ctx, p, from); err != nil || !proof.Valid() || proof.From() != from {
		t.Fatalf("leftovers before %d: %+v %v", from, proof, err)
	}
	for _, c := range []struct {
		off  int64
		data string
	}{{0, LeaseMagic}, {from + 100, "x"}, {size - 100, "x"}} {
		p := image(t, size, c.off, []byte(c.data))
		_, err := ProvePast(ctx, p, from)
		var nb *NotBlankError
		if !errors.As(err, &nb) {
			t.Fatalf("data at %d: %v; want a refusal", c.off, err)
		}
	}
}

// What blkid names comes with the refusal, also when the blank checks
// found the device's data first: the agent mounts a device whose Type is
// the volume's filesystem and refuses one blkid names nothing on.
func TestRefusalCarriesWhatBlkidNamed(t *testing.T) {
	needBlkid(t)
	for _, c := range []struct {
		tool   string
		args   []string
		typ    string
		pttype string
	}{
		{"mkswap", nil, "swap", ""},
		{"mkfs.ext4", []string{"-q", "-F"}, "ext4", ""},
		{"sfdisk", nil, "", "dos"},
	} {
		if _, err := exec.LookPath(c.tool); err != nil {
			t.Logf("%s is not installed; skipped", c.tool)
			continue
		}
		p := image(t, 32<<20, 0, nil)
		cmd := exec.Command(c.tool, append(c.args, p)...)
		if c.tool == "sfdisk" {
			cmd.Stdin = strings.NewReader("label: dos\n,16M\n")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", c.tool, err, out)
		}
		_, err := Prove(context.Background(), p)
		var nb *NotBlankError
		if !errors.As(err, &nb) || nb.Type != c.typ || nb.PTType != c.pttype {
			t.Fatalf("after %s: %v (%+v); want blkid's TYPE %q and PTTYPE %q with the refusal", c.tool, err, nb, c.typ, c.pttype)
		}
	}
	p := image(t, 32<<20, 5000, []byte("x"))
	_, err := Prove(context.Background(), p)
	var nb *NotBlankError
	if !errors.As(err, &nb) || nb.Type != "" || nb.PTType != "" {
		t.Fatalf("a stray byte: %v (%+v); want a refusal with no blkid type", err, nb)
	}
}

// FirstNonZero finds the first non-zero byte wherever it lies: against
// the words and groups of words it ORs, in a slice that starts anywhere
// against a word boundary, with any byte value, and whatever lies after
// it.
func TestFirstNonZero(t *testing.T) {
	naive := func(b []byte) int {
		for i, c := range b {
			if c != 0 {
				return i
			}
		}
		return -1
	}
	if got := FirstNonZero(nil); got != -1 {
		t.Fatalf("nothing: %d; want -1", got)
	}
	backing := make([]byte, 4096+16)
	for start := 0; start < 16; start++ {
		for _, n := range []int{0, 1, 7, 8, 9, 63, 64, 65, 127, 200, 4096} {
			b := backing[start : start+n]
			clear(backing)
			if got := FirstNonZero(b); got != -1 {
				t.Fatalf("start %d, %d zeros: %d; want -1", start, n, got)
			}
			for at := 0; at < n; at++ {
				clear(backing)
				// Bytes just before the slice are not its own.
				if start > 0 {
					backing[start-1] = 0xff
				}
				backing[start+n] = 0xff
				b[at] = byte(1 << (at % 8))
				if at+1 < n {
					b[n-1] |= 0x10 // a later one must not be taken instead
				}
				if got, want := FirstNonZero(b), naive(b); got != want || got != at {
					t.Fatalf("start %d, length %d, non-zero at %d: found %d (a byte loop finds %d)", start, n, at, got, want)
				}
			}
		}
	}
	big := make([]byte, 6<<20+3)
	for _, at := range []int{0, 1<<20 - 1, 5 << 20, len(big) - 1} {
		clear(big)
		big[at] = 0x80
		// The slice starts a byte in: a non-zero byte 0 of big is not
		// in it.
		want := at - 1
		if at == 0 {
			want = -1
		}
		if got := FirstNonZero(big[1:]); got != want {
			t.Fatalf("6 MiB less a byte, non-zero byte %d of big: found %d; want %d", at, got, want)
		}
	}
}

// Recheck reads a proof's zero regions again: data written there since
// the proof is found and named, a blank device keeps its proof, and a
// device whose size changed is no longer the one proven.
func TestRecheck(t *testing.T) {
	needBlkid(t)
	ctx := context.Background()
	p := image(t, 32<<20, 0, nil)
	proof, err := Prove(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := Recheck(ctx, proof); err != nil || again != proof {
		t.Fatalf("Recheck of a device still blank: %+v %v; want the same proof", again, err)
	}
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("someone's data at 2 MiB"), 2<<20); err != nil {
		t.Fatal(err)
	}
	_, err = Recheck(ctx, proof)
	var nb *NotBlankError
	if !errors.As(err, &nb) || !strings.Contains(nb.Found, "2097152") {
		t.Fatalf("Recheck after a write at 2 MiB: %v; want a refusal naming byte 2097152", err)
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := Recheck(ctx, proof); err == nil || errors.As(err, &nb) {
		t.Fatalf("Recheck of a device that grew: %v; want an error that is no refusal", err)
	}
	if _, err := Recheck(ctx, Proof{}); err == nil {
		t.Fatal("Recheck of no proof succeeded")
	}
}

// When blkid does not answer, nothing is known of what the device holds,
// also when the reads found data: the error is blkid's (ErrProbe), not a
// refusal that would say the device holds no filesystem.
func TestBlkidFailureIsNoRefusal(t *testing.T) {
	p := image(t, 32<<20, 1024+56, []byte("\x53\xef"))
	t.Setenv("PATH", t.TempDir())
	_, err := Prove(context.Background(), p)
	var nb *NotBlankError
	if !errors.Is(err, ErrProbe) || errors.As(err, &nb) {
		t.Fatalf("Prove of data without blkid: %v; want ErrProbe and no refusal", err)
	}
}

// TestRecheckOfAPathNamingAnotherDevice: a proof is of the device its path
// named when it was made; the path made to name another one (as a
// /dev/disk/by-* link retargeted), blank too, is not taken on the proof's
// word: Recheck refuses it.
func TestRecheckOfAPathNamingAnotherDevice(t *testing.T) {
	needBlkid(t)
	ctx := context.Background()
	dir := t.TempDir()
	a, b := hosttest.SparseFile(t, 32<<20), hosttest.SparseFile(t, 32<<20)
	link := dir + "/disk"
	if err := os.Symlink(a, link); err != nil {
		t.Fatal(err)
	}
	p, err := Prove(ctx, link)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Recheck(ctx, p); err != nil {
		t.Fatalf("the same device: %v", err)
	}
	os.Remove(link)
	if err := os.Symlink(b, link); err != nil {
		t.Fatal(err)
	}
	if _, err := Recheck(ctx, p); err == nil || !strings.Contains(err.Error(), "another device") {
		t.Fatalf("the path retargeted to another blank device: %v; want a refusal", err)
	}
}
