// Package labtest holds what the guest-tier tests share on top of the lab:
// starting a lab a test owns, and writing and reading single blocks of a
// guest's disk with O_DIRECT, so that a write either reaches the target or
// fails there (a fence test must not be fooled by the page cache). It is
// imported by tests only.
package labtest

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// BlockSize is the size of the blocks WriteBlock writes and ReadBlock reads.
const BlockSize = 4096

// Start starts a lab in a temporary directory of t, after edit (if not
// nil) adjusted its configuration, and tears it down when t ends, with
// the last tailLines of each guest's console when t failed. Without the
// guest tier (lab.GuestTierEnabled) it skips t.
func Start(t testing.TB, ctx context.Context, tailLines int, edit func(*lab.Config)) *lab.Lab {
	t.Helper()
	if ok, why := lab.GuestTierEnabled(); !ok {
		t.Skip(why)
	}
	cfg, err := lab.TestConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(&cfg)
	}
	l, err := lab.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, g := range l.Guests {
				t.Logf("%s console tail:\n%s", g.Name, g.ConsoleTail(tailLines))
			}
		}
		if err := l.Close(); err != nil {
			t.Errorf("lab teardown: %v", err)
		}
	})
	return l
}

// WriteBlock writes marker, padded to a block, at block n of dev in g with
// O_DIRECT and fsync.
func WriteBlock(ctx context.Context, g *lab.Guest, dev string, n int, marker string) (*guestexec.Result, error) {
	return g.Sh(ctx, fmt.Sprintf("printf %%s %s | dd of=%s bs=%d seek=%d count=1 conv=sync,fsync oflag=direct 2>&1", marker, dev, BlockSize, n))
}

// MustWrite fails t unless g's write of marker to block n of dev succeeds.
func MustWrite(t testing.TB, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	r, err := WriteBlock(ctx, g, dev, n, marker)
	if err != nil {
		t.Fatal(err)
	}
	if r.Exit != 0 {
		t.Fatalf("%s: write of %q to block %d of %s failed: %s", g.Name, marker, n, dev, r)
	}
}

// MustNotWrite fails t unless the target refuses g's write with a
// reservation conflict, which the kernel reports as EBADE ("Invalid
// exchange"); any other I/O error would not prove the fence.
func MustNotWrite(t testing.TB, ctx context.Context, g *lab.Guest, dev string, n int, marker string) {
	t.Helper()
	r, err := WriteBlock(ctx, g, dev, n, marker)
	if err != nil {
		t.Fatal(err)
	}
	if r.Exit == 0 {
		t.Fatalf("%s: write of %q to block %d of %s succeeded; the target should have refused it: %s", g.Name, marker, n, dev, r)
	}
	if !strings.Contains(r.Stdout, "Invalid exchange") {
		t.Fatalf("%s: write to %s failed, but not with a reservation conflict (EBADE): %s", g.Name, dev, r)
	}
	t.Logf("%s: write refused: %s", g.Name, strings.TrimSpace(r.Stdout))
}
