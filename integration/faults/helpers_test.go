package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

const blockSize = 4096

// figure prints one figure in the form the soak run collects.
func figure(t *testing.T, name string, value any) {
	t.Helper()
	fmt.Printf("FIGURE %s=%v\n", name, value)
	t.Logf("FIGURE %s=%v", name, value)
}

// newLab starts a lab in a temporary directory, torn down when the test
// ends (with the guests' console tails when it failed).
func newLab(t *testing.T, ctx context.Context) *lab.Lab {
	t.Helper()
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	cfg, err := lab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// util-linux losetup: the agent maps a leased disk's data area with
	// --find and an offset, which busybox's lacks.
	cfg.HostTools = append(append([]string{}, lab.DefaultHostTools...), "/usr/sbin/losetup")
	l, err := lab.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, g := range l.Guests {
				t.Logf("%s console tail:\n%s", g.Name, g.ConsoleTail(30))
			}
		}
		if err := l.Close(); err != nil {
			t.Errorf("lab teardown: %v", err)
		}
	})
	return l
}

// attach hot-plugs lun into g as a scsi-block disk and returns its device
// node in the guest.
func attach(t *testing.T, ctx context.Context, g *lab.Guest, lun *lab.LUN) string {
	t.Helper()
	if err := g.AttachDisk(ctx, lab.Disk{ID: lun.Serial, Kind: lab.SCSIBlock, LUN: lun}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	d, err := g.WaitDiskBySerial(wctx, lun.Serial)
	if err != nil {
		t.Fatal(err)
	}
	return "/dev/" + d.Name
}

// writeBlock writes marker at block n of dev with O_DIRECT and fsync, so
// the write reaches the target or fails there.
func writeBlock(ctx context.Context, g *lab.Guest, dev string, n int, marker string) (*guestexec.Result, error) {
	return g.Sh(ctx, fmt.Sprintf("printf %%s %s | dd of=%s bs=%d seek=%d count=1 conv=sync,fsync oflag=direct 2>&1", marker, dev, blockSize, n))
}

func mustWrite(t *testing.T, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	r, err := writeBlock(ctx, g, dev, n, marker)
	if err != nil {
		t.Fatal(err)
	}
	if r.Exit != 0 {
		t.Fatalf("%s: write of %q to block %d of %s failed: %s", g.Name, marker, n, dev, r)
	}
}

// mustNotWrite asserts that the target refuses g's write with a
// reservation conflict (EBADE, "Invalid exchange" in the guest).
func mustNotWrite(t *testing.T, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	r, err := writeBlock(ctx, g, dev, n, marker)
	if err != nil {
		t.Fatal(err)
	}
	if r.Exit == 0 {
		t.Fatalf("%s: write of %q to block %d of %s succeeded; the target should have refused it: %s", g.Name, marker, n, dev, r)
	}
	if !strings.Contains(r.Stdout, "Invalid exchange") {
		t.Fatalf("%s: write to %s failed, but not with a reservation conflict (EBADE): %s", g.Name, dev, r)
	}
}

// backingBlock reads block n of a LUN's or disk's backing file on the host.
func backingBlock(t *testing.T, file string, n int) string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, blockSize)
	if _, err := f.ReadAt(b, int64(n*blockSize)); err != nil {
		t.Fatal(err)
	}
	return string(bytes.TrimRight(b, "\x00"))
}

func backingHas(t *testing.T, file, marker string) bool {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(b, []byte(marker))
}

// fenceReply is the JSON `vco-agent fence ... --json` prints.
type fenceReply struct {
	OK         bool   `json:"ok"`
	Error      string `json:"error"`
	Refused    bool   `json:"refused"`
	Lost       bool   `json:"lost"`
	Holder     string `json:"holder"`
	HolderNode string `json:"holder_node"`
	Claim      *struct {
		Key     string `json:"key"`
		Already bool   `json:"already"`
	} `json:"claim"`
}

// fence runs `vco-agent fence SUB DEV --json` in g, naming the given nodes
// so that refusals say which node holds the disk.
func fence(ctx context.Context, g *lab.Guest, nodes []*lab.Guest, sub, dev string, extra ...string) (*fenceReply, int, string, error) {
	argv := append([]string{"/bin/vco-agent", "fence", sub, dev, "--json"}, extra...)
	for _, n := range nodes {
		argv = append(argv, "--node", n.Name+"="+n.UUID)
	}
	r, err := g.Exec().Run(ctx, 0, argv...)
	if err != nil {
		return nil, 0, "", err
	}
	out := r.Stdout + r.Stderr
	var rep fenceReply
	if err := json.Unmarshal([]byte(r.Stdout), &rep); err != nil {
		return nil, r.Exit, out, fmt.Errorf("%s: %s: output is not the JSON reply: %v\n%s", g.Name, strings.Join(argv, " "), err, out)
	}
	return &rep, r.Exit, out, nil
}
