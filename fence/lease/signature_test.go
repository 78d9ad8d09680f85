package lease

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		t.Skipf("%s not installed", name)
	}
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
}

// Real tools write real layouts; Format must refuse each of them, name
// what it found, and write nothing.
func TestFormatRefusesForeignLayouts(t *testing.T) {
	ctx := context.Background()
	writeAt := func(off int64, data string) func(*testing.T, string) {
		return func(t *testing.T, img string) {
			f, err := os.OpenFile(img, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if off < 0 {
				st, _ := f.Stat()
				off += st.Size()
			}
			if _, err := f.WriteAt([]byte(data), off); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name    string
		prepare func(t *testing.T, img string)
		want    string
	}{
		{"ext4", func(t *testing.T, img string) { run(t, "mkfs.ext4", "-q", "-F", img) }, "ext2/3/4"},
		{"xfs", func(t *testing.T, img string) { run(t, "mkfs.xfs", "-q", "-f", img) }, "XFS"},
		{"luks2", func(t *testing.T, img string) {
			key := img + ".key"
			if err := os.WriteFile(key, []byte("not-a-real-secret"), 0o600); err != nil {
				t.Fatal(err)
			}
			run(t, "cryptsetup", "luksFormat", "--batch-mode", "--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-file", key, img)
		}, "LUKS"},
		{"gpt", func(t *testing.T, img string) {
			cmd := exec.Command("sfdisk", "--quiet", img)
			cmd.Stdin = strings.NewReader("label: gpt\n,10MiB\n")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Skipf("sfdisk: %v: %s", err, out)
			}
		}, "GPT header"},
		{"swap", func(t *testing.T, img string) { run(t, "mkswap", img) }, "swap"},
		{"stray bytes in the first MiB", writeAt(700_000, "x"), "non-zero data at byte 700000"},
		{"stray bytes at the end", writeAt(-10, "x"), "of the last MiB"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// Sparse; XFS wants 300 MB.
			dev := loopDevice(t, 320<<20, 512, func(img string) { c.prepare(t, img) })
			d := openDev(t, dev)
			before, err := d.ReadArea(ctx, time.Second)
			if err != nil {
				t.Fatal(err)
			}
			wrote, err := Format(ctx, d, FormatOptions{Key: keyA, Blkid: true})
			var fe *ForeignError
			if wrote || !errors.As(err, &fe) || !strings.Contains(fe.Signature, c.want) {
				t.Fatalf("format: wrote %v, %v; want a refusal naming %q", wrote, err, c.want)
			}
			if !strings.Contains(err.Error(), dev) || !strings.Contains(err.Error(), "opt-in") {
				t.Fatalf("refusal does not name the device and the way out: %v", err)
			}
			after, err := d.ReadArea(ctx, time.Second)
			if err != nil || string(after) != string(before) {
				t.Fatalf("format refused but the disk changed (%v)", err)
			}
			a := newNodeTiming(t, dev, uuidA, "node-a", readTiming)
			sup, err := a.e.Probe(ctx)
			if err != nil || sup.Method == fence.MethodLease || !strings.Contains(sup.Reason, c.want) {
				t.Fatalf("probe of a foreign disk: %+v %v", sup, err)
			}
		})
	}
}

// ProbeBlkid, Format's second opinion, reports nothing on a blank disk
// and names what blkid finds.
func TestProbeBlkid(t *testing.T) {
	dev := loopDevice(t, 8<<20, 512, nil)
	sig, err := ProbeBlkid(context.Background(), dev)
	if err != nil || sig != "" {
		t.Fatalf("blkid on a blank disk: %q %v", sig, err)
	}
	run(t, "mkfs.ext4", "-q", "-F", dev)
	sig, err = ProbeBlkid(context.Background(), dev)
	if err != nil || !strings.Contains(sig, "TYPE=ext4") {
		t.Fatalf("blkid on ext4: %q %v", sig, err)
	}
}
