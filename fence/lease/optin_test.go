package lease

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/whitesky-cloud/vco-storage/fence"
)

func TestUnfencedOptInIsLogged(t *testing.T) {
	if _, err := NewUnfenced("/dev/vdc", "", "XFS superblock at byte 0", nil); err == nil {
		t.Fatal("opt-in without a volume accepted")
	}
	var buf bytes.Buffer
	u, err := NewUnfenced("/dev/vdc", "pvc-123", "XFS superblock at byte 0", slog.New(slog.NewTextHandler(&buf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	sup, _ := u.Probe(context.Background())
	if sup.Method != fence.MethodNone || !strings.Contains(sup.Reason, "opt-in") {
		t.Fatalf("probe: %+v", sup)
	}
	c, err := u.Acquire(context.Background(), nil)
	if err != nil || c.Method != fence.MethodNone {
		t.Fatalf("acquire: %+v %v", c, err)
	}
	log := buf.String()
	for _, want := range []string{"level=WARN", "WITHOUT fencing", "volume=pvc-123", "device=/dev/vdc", "XFS superblock"} {
		if !strings.Contains(log, want) {
			t.Fatalf("log %q lacks %q", log, want)
		}
	}
}
