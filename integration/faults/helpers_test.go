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

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/lab/labtest"
)

const blockSize = labtest.BlockSize

// figure prints one figure in the form the soak run collects.
func figure(t *testing.T, name string, value any) {
	t.Helper()
	fmt.Printf("FIGURE %s=%v\n", name, value)
	t.Logf("FIGURE %s=%v", name, value)
}

// newLab starts a lab the test owns, with util-linux losetup in the
// guests: the agent maps a leased disk's data area with --find and an
// offset, which busybox's lacks.
func newLab(t *testing.T, ctx context.Context) *lab.Lab {
	t.Helper()
	return labtest.Start(t, ctx, 30, func(cfg *lab.Config) {
		cfg.HostTools = append(append([]string{}, lab.DefaultHostTools...), "/usr/sbin/losetup")
	})
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
