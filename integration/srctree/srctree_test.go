package srctree

import (
	"os"
	"path/filepath"
	"testing"
)

func TestRootHoldsTheModule(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(Root(), "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "module github.com/whitesky-cloud/vco-storage\n"; string(b[:len(want)]) != want {
		t.Fatalf("%s/go.mod starts %q", Root(), b[:40])
	}
}
