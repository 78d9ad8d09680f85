package vault

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The key backend's recipe as docs/encryption.md gives it, block by block:
// the lab runs these (integration/k8s, K7), so a change of the doc that
// the lab cannot follow fails here first, before a cluster is built.
func TestRecipeOfTheEncryptionDoc(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "encryption.md"))
	if err != nil {
		t.Fatal(err)
	}
	blocks, err := Recipe(doc, "## Setting up the key backend")
	if err != nil {
		t.Fatal(err)
	}
	want := []struct{ lang, file, holds string }{
		{"sh", "", "bao secrets enable -path=transit-prod-1 transit\n"},
		{"hcl", "vco-csi-node-prod-1.hcl", `path "transit-prod-1/decrypt/vco-csi-volumes"`},
		{"sh", "", "bao policy write vco-csi-node-prod-1 vco-csi-node-prod-1.hcl"},
		{"sh", "", "make csi-addon "},
		{"sh", "", "bao write auth/kubernetes-prod-1/role/vco-csi-node"},
		{"yaml", "", "name: csi-key-backend-config"},
		{"sh", "", "kubectl -n csi-driver rollout restart daemonset/vco-csi-node"},
	}
	if len(blocks) != len(want) {
		t.Fatalf("%d blocks, want %d: %+v", len(blocks), len(want), blocks)
	}
	for i, w := range want {
		b := blocks[i]
		if b.Lang != w.lang || b.File != w.file || !strings.Contains(b.Text, w.holds) {
			t.Errorf("block %d: %s file %q:\n%s\nwant %s file %q holding %q", i, b.Lang, b.File, b.Text, w.lang, w.file, w.holds)
		}
		if strings.HasPrefix(b.Text, " ") {
			t.Errorf("block %d keeps the list's indentation: %q", i, b.Text)
		}
	}
}

func TestRecipeRefusesWhatItCannotFollow(t *testing.T) {
	for _, c := range []struct{ name, doc, err string }{
		{"no section", "# T\n## Other\n```sh\nx\n```\n", "no section"},
		{"unclosed", "## Setting up\n```sh\nx\n", "not closed"},
		{"no block", "## Setting up\ntext only\n## Next\n```sh\nx\n```\n", "no fenced block"},
		{"not a heading", "", "not a markdown heading"},
	} {
		heading := "## Setting up"
		if c.name == "not a heading" {
			heading = "Setting up"
		}
		if _, err := Recipe([]byte(c.doc), heading); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.err)
		}
	}
	// A block under a deeper heading belongs to the section; the next
	// heading of the same level ends it.
	b, err := Recipe([]byte("## A\n### a.1\n(`p.hcl`)\n  ```hcl\n  x\n  ```\n## B\n```sh\ny\n```\n"), "## A")
	if err != nil || len(b) != 1 || b[0].Text != "x\n" || b[0].File != "p.hcl" {
		t.Fatalf("%+v, %v; want one hcl block x saved as p.hcl", b, err)
	}
}
