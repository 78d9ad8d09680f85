package lease

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// The blank proof knows the lease header's magic and data offset without
// importing this package (which uses it); these keep them in step.
func TestBlankProofKnowsTheLeaseLayout(t *testing.T) {
	if !strings.HasPrefix(string(EncodeHeader(Header{})), blank.LeaseMagic) {
		t.Fatalf("the lease header does not begin with blank.LeaseMagic %q", blank.LeaseMagic)
	}
	if blank.LeaseDataOffset != DataOffset || DataOffset+AreaSize > blank.HeadSize {
		t.Fatalf("the blank proof reads %d bytes from the start with the data offset at %d; the lease keeps its data from %d",
			blank.HeadSize, blank.LeaseDataOffset, DataOffset)
	}
}

// Format writes the lease area only on a disk the blank proof passes:
// data past the first MiB (where the volume of a lease disk lives) is
// found too, and the disk is left as it was.
func TestFormatRefusesDataAtTheDataOffset(t *testing.T) {
	ctx := context.Background()
	dev := loopDevice(t, 64<<20, 512, func(img string) {
		f, err := os.OpenFile(img, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt([]byte("the data area of a volume whose lease header is gone"), DataOffset+8192); err != nil {
			t.Fatal(err)
		}
	})
	d := openDev(t, dev)
	wrote, err := Format(ctx, d, FormatOptions{Key: keyA})
	var fe *ForeignError
	if wrote || !errors.As(err, &fe) || !strings.Contains(fe.Signature, "lease data offset") {
		t.Fatalf("format: wrote %v, %v; want a refusal naming the data at the lease data offset", wrote, err)
	}
	area, err := d.ReadArea(ctx, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range area {
		if c != 0 {
			t.Fatalf("format refused but wrote byte %d", i)
		}
	}
}

// Two nodes race the first stage of one blank disk (the lab's L4): the
// other node's lease header lands after this node read a blank layout and
// before its blank proof. Format must take the disk as the lease disk it
// now is, leaving the other node's header as written, so that the
// acquisition names the holder; it must not refuse the disk as foreign
// data and tell the operator to wipe it.
func TestFormatTakesALeaseAreaWrittenDuringItsProof(t *testing.T) {
	ctx := context.Background()
	dev := loopDevice(t, 64<<20, 512, nil)
	d := openDev(t, dev)
	other := openDev(t, dev)
	raced := false
	testHookBeforeProof = func(*Device) {
		testHookBeforeProof = nil
		wrote, err := Format(ctx, other, FormatOptions{Key: keyB, Timeout: time.Second})
		if err != nil || !wrote {
			t.Fatalf("the other node's format: %v %v", wrote, err)
		}
		raced = true
	}
	t.Cleanup(func() { testHookBeforeProof = nil })
	wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second})
	if !raced || wrote || err != nil {
		t.Fatalf("format raced by another node's (raced %v): wrote %v, %v; want the other node's lease area taken as it is", raced, wrote, err)
	}
	b, err := d.read(ctx, 0, BlockSize, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	h, err := DecodeHeader(b)
	if err != nil || h.Creator != keyB {
		t.Fatalf("header after the race: %+v %v; want the other node's (creator %s)", h, err, keyB)
	}
}

// A caller's recent proof of the whole disk spares Format a second one
// (the agent's stage proved the disk blank to choose the lease); any other
// proof is not taken, and what changed the disk's first MiB since the
// caller's proof is seen by the layout read before the write.
func TestFormatTakesARecentProofOfTheSameDiskOnly(t *testing.T) {
	ctx := context.Background()
	dev := loopDevice(t, 64<<20, 512, nil)
	elsewhere := loopDevice(t, 64<<20, 512, nil)
	proofOf := func(path string) blank.Proof {
		p, err := blank.Prove(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	proved := 0
	testHookBeforeProof = func(*Device) { proved++ }
	t.Cleanup(func() { testHookBeforeProof = nil })

	d := openDev(t, dev)
	for _, c := range []struct {
		name   string
		proof  blank.Proof
		proves bool
	}{
		{"no proof", blank.Proof{}, true},
		{"another disk's proof", proofOf(elsewhere), true},
		{"a proof of this disk from the stage", proofOf(dev), false},
	} {
		proved = 0
		// Back to blank: the header is the only thing Format writes.
		if err := d.write(ctx, 0, make([]byte, BlockSize), time.Second); err != nil {
			t.Fatal(err)
		}
		wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second, Proof: c.proof})
		if err != nil || !wrote || (proved == 1) != c.proves {
			t.Fatalf("%s: wrote %v, %v, proved the disk again %d times; want it written, proven again: %v", c.name, wrote, err, proved, c.proves)
		}
	}

	// The proof of this disk, then foreign data at its start: the layout
	// read before the write finds it, and nothing is written.
	if err := d.write(ctx, 0, make([]byte, BlockSize), time.Second); err != nil {
		t.Fatal(err)
	}
	p := proofOf(dev)
	foreign := make([]byte, BlockSize)
	copy(foreign[1080:], []byte{0x53, 0xef}) // ext4's magic
	if err := d.write(ctx, 0, foreign, time.Second); err != nil {
		t.Fatal(err)
	}
	wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second, Proof: p})
	var fe *ForeignError
	if wrote || !errors.As(err, &fe) {
		t.Fatalf("format over data written after the caller's proof: wrote %v, %v; want a refusal", wrote, err)
	}
}

// A proof older than proofReuse is no longer taken: Format proves the disk
// again.
func TestFormatProvesAgainPastTheReuseBound(t *testing.T) {
	ctx := context.Background()
	dev := loopDevice(t, 64<<20, 512, nil)
	p, err := blank.Prove(ctx, dev)
	if err != nil {
		t.Fatal(err)
	}
	proved := 0
	testHookBeforeProof = func(*Device) { proved++ }
	t.Cleanup(func() { testHookBeforeProof = nil })
	reuse := proofReuse
	t.Cleanup(func() { proofReuse = reuse })
	proofReuse = time.Nanosecond
	time.Sleep(time.Millisecond)
	wrote, err := Format(ctx, openDev(t, dev), FormatOptions{Key: keyA, Timeout: time.Second, Proof: p})
	if err != nil || !wrote || proved != 1 {
		t.Fatalf("format with an old proof: wrote %v, %v, proved again %d times; want it proven again and written", wrote, err, proved)
	}
}

// provenDisk is a blank loop device, opened for the lease, and its blank
// proof.
func provenDisk(t *testing.T) (*Device, blank.Proof) {
	t.Helper()
	dev := loopDevice(t, 64<<20, 512, nil)
	p, err := blank.Prove(context.Background(), dev)
	if err != nil {
		t.Fatal(err)
	}
	return openDev(t, dev), p
}

// A recent proof is taken without its blkid run, not without its zero
// checks: data written past the first MiB since the proof refuses the
// format as it did before.
func TestFormatWithAProofReadsItsZerosAgain(t *testing.T) {
	ctx := context.Background()
	d, p := provenDisk(t)
	data := make([]byte, BlockSize)
	copy(data, "someone's data at 2 MiB")
	if err := d.write(ctx, 2<<20, data, time.Second); err != nil {
		t.Fatal(err)
	}
	wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second, Proof: p})
	var fe *ForeignError
	if wrote || !errors.As(err, &fe) || !strings.Contains(fe.Signature, "2097152") {
		t.Fatalf("format over data written at 2 MiB after the proof: wrote %v, %v; want a refusal naming it", wrote, err)
	}
}

// A recent proof, then another node's lease area written on the disk (two
// nodes given one blank disk): Format leaves that area alone and writes
// nothing, as when the other header lands before the layout read.
func TestFormatWithAProofUsesALeaseAreaWrittenSince(t *testing.T) {
	ctx := context.Background()
	d, p := provenDisk(t)
	if wrote, err := Format(ctx, d, FormatOptions{Key: keyB, Timeout: time.Second}); err != nil || !wrote {
		t.Fatalf("the other node's format: %v %v", wrote, err)
	}
	wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second, Proof: p})
	if err != nil || wrote {
		t.Fatalf("format with a proof older than another node's lease area: wrote %v, %v; want that area used", wrote, err)
	}
	b, err := d.read(ctx, 0, BlockSize, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := DecodeHeader(b); err != nil || h.Creator != keyB {
		t.Fatalf("the header is %+v (%v), want the other node's", h, err)
	}
}

// A proof of a path that names another device since (a /dev/disk/by-*
// link retargeted) is not taken: Format proves the disk it opened.
func TestFormatTakesNoProofOfAPathRetargeted(t *testing.T) {
	ctx := context.Background()
	first := loopDevice(t, 64<<20, 512, nil)
	second := loopDevice(t, 64<<20, 512, nil)
	link := filepath.Join(t.TempDir(), "disk")
	if err := os.Symlink(first, link); err != nil {
		t.Fatal(err)
	}
	p, err := blank.Prove(ctx, link)
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(link)
	if err := os.Symlink(second, link); err != nil {
		t.Fatal(err)
	}
	proved := 0
	testHookBeforeProof = func(*Device) { proved++ }
	t.Cleanup(func() { testHookBeforeProof = nil })
	wrote, err := Format(ctx, openDev(t, link), FormatOptions{Key: keyA, Timeout: time.Second, Proof: p})
	if err != nil || !wrote || proved != 1 {
		t.Fatalf("format through a retargeted path: wrote %v, %v, proved again %d times; want it proven again and written", wrote, err, proved)
	}
}

// ClassifyFirstBlock decides by the first block alone: zeros are blank
// there (a stage then proves the whole disk), a formatted disk has its
// header, a filesystem's superblock in that block makes the disk foreign,
// naming it, and a disk too small for a volume is refused as ReadLayout
// refuses it.
func TestClassifyFirstBlock(t *testing.T) {
	ctx := context.Background()
	d := openDev(t, loopDevice(t, 64<<20, 512, nil))
	if c, err := ClassifyFirstBlock(ctx, d, time.Second); err != nil || c.Layout != LayoutBlank {
		t.Fatalf("a blank disk: %+v (%v); want blank", c, err)
	}
	if wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Timeout: time.Second}); err != nil || !wrote {
		t.Fatalf("format: %v %v", wrote, err)
	}
	if c, err := ClassifyFirstBlock(ctx, d, time.Second); err != nil || c.Layout != LayoutLease {
		t.Fatalf("a formatted disk: %+v (%v); want a lease area", c, err)
	}
	fs := openDev(t, loopDevice(t, 64<<20, 512, func(img string) {
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v: %s", err, out)
		}
	}))
	if c, err := ClassifyFirstBlock(ctx, fs, time.Second); err != nil || c.Layout != LayoutForeign || !strings.Contains(c.Signature, "ext2/3/4 superblock") {
		t.Fatalf("an ext4 disk: %+v (%v); want foreign, naming its superblock", c, err)
	}
	small := openDev(t, loopDevice(t, AreaSize, 512, nil))
	if _, err := ClassifyFirstBlock(ctx, small, time.Second); err == nil || !strings.Contains(err.Error(), "too small") {
		t.Fatalf("a disk of one lease area: %v; want it refused as too small", err)
	}
}
