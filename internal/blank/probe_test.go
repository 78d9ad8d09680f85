package blank

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// mapped attaches img as a loop device (the disk) and a loop device over
// that disk from off (the mapping, as a lease volume's data mapping).
func mapped(t *testing.T, img string, off int64) (disk, mapping string) {
	t.Helper()
	hosttest.NeedRoot(t, "loop devices need root", "blkid", "mkfs.ext4")
	disk, err := loopdev.Attach(img, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { loopdev.Detach(disk) })
	mapping, err = loopdev.Attach(disk, off, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { loopdev.Detach(mapping) })
	return disk, mapping
}

// TestProveMappingTakesAProbeOfItsRegion: a probe of a disk's region,
// begun before the mapping that shows it, gives the mapping's proof its
// signature checks (the proof is as old as the probe); its zero checks are
// read when the proof is made, so data written since is found; a
// filesystem already on the region is named as Prove names it.
func TestProveMappingTakesAProbeOfItsRegion(t *testing.T) {
	ctx := context.Background()
	const off = 1 << 20
	disk, mapping := mapped(t, hosttest.SparseFile(t, 64<<20), off)

	p, err := StartProbe(ctx, disk, off)
	if err != nil {
		t.Fatal(err)
	}
	proof, err := ProveMapping(ctx, mapping, p)
	if err != nil || proof.Device() != mapping || !proof.Taken().Equal(p.taken) || proof.From() != 0 {
		t.Fatalf("a blank mapping with a probe of its region: %+v %v", proof, err)
	}

	// Data written after the probe, in the mapping's first MiB.
	p, err = StartProbe(ctx, disk, off)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(mapping, os.O_WRONLY|os.O_SYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("written after the probe"), 8192); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var nb *NotBlankError
	if _, err := ProveMapping(ctx, mapping, p); !errors.As(err, &nb) || !strings.Contains(nb.Found, "8192") {
		t.Fatalf("data written after the probe: %v", err)
	}

	// A filesystem made on the region after the probe's run: named with
	// its type, as a proof of its own names it (the stage mounts the
	// volume's own filesystem).
	if p, err = StartProbe(ctx, disk, off); err != nil {
		t.Fatal(err)
	}
	<-p.done
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", mapping).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	DropBuffers(mapping)
	if _, err := ProveMapping(ctx, mapping, p); !errors.As(err, &nb) || nb.Type != "ext4" {
		t.Fatalf("an ext4 made after the probe: %v (%+v)", err, nb)
	}

	// A filesystem on the region before the probe: named with its type.
	DropBuffers(disk)
	if p, err = StartProbe(ctx, disk, off); err != nil {
		t.Fatal(err)
	}
	if _, err := ProveMapping(ctx, mapping, p); !errors.As(err, &nb) || nb.Type != "ext4" {
		t.Fatalf("an ext4 on the region: %v (%+v)", err, nb)
	}
}

// TestProveMappingProvesAfreshWithoutItsProbe: a probe of another region
// (another offset, another disk), an old one, or none, is not taken: the
// mapping is proven afresh, and the proof is as new as the call.
func TestProveMappingProvesAfreshWithoutItsProbe(t *testing.T) {
	ctx := context.Background()
	const off = 1 << 20
	disk, mapping := mapped(t, hosttest.SparseFile(t, 64<<20), off)
	other, _ := mapped(t, hosttest.SparseFile(t, 64<<20), off)
	probe := func(disk string, off int64) *Probe {
		p, err := StartProbe(ctx, disk, off)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	old := probe(disk, off)
	old.taken = old.taken.Add(-probeAge - time.Second)
	for name, p := range map[string]*Probe{
		"none":           nil,
		"another offset": probe(disk, 2<<20),
		"another disk":   probe(other, off),
		"an old probe":   old,
		"the mapping's":  probe(mapping, 4096),
	} {
		before := time.Now()
		proof, err := ProveMapping(ctx, mapping, p)
		if err != nil || proof.Taken().Before(before) {
			t.Errorf("%s: %+v %v; want a proof made afresh", name, proof, err)
		}
	}
}

// TestStartProbeRefusesNoRegion: an offset at or past the end, or none,
// is no region.
func TestStartProbeRefusesNoRegion(t *testing.T) {
	img := hosttest.SparseFile(t, 4<<20)
	for _, off := range []int64{0, -1, 4 << 20, 5 << 20} {
		if p, err := StartProbe(context.Background(), img, off); err == nil {
			p.Stop()
			t.Errorf("offset %d: a probe", off)
		}
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
