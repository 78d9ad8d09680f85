package makehelp

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	const text = `# a comment: not a rule
X := a:b
Y ?= c \
  d:e
LIST := one:two \
three:four
.PHONY: all b \
        c
all: b c
b:
	echo x: y
c: ; @true
b: extra
d e: all
`
	m := Parse(text)
	wantRules := map[string]int{"all": 1, "b": 2, "c": 1, "d": 1, "e": 1}
	if !reflect.DeepEqual(m.Rules, wantRules) {
		t.Errorf("rules: got %v, want %v", m.Rules, wantRules)
	}
	if want := []string{"all", "b", "c", "d", "e"}; !reflect.DeepEqual(m.Order, want) {
		t.Errorf("order: got %v, want %v", m.Order, want)
	}
	wantPhony := map[string]int{"all": 1, "b": 1, "c": 1}
	if !reflect.DeepEqual(m.Phony, wantPhony) {
		t.Errorf("phony: got %v, want %v", m.Phony, wantPhony)
	}
}

func TestHelp(t *testing.T) {
	count, desc := Help("\nBuild\n  all                the binaries\n  build              bin/\n  all  again\nnot  a line\n")
	if want := map[string]int{"all": 2, "build": 1}; !reflect.DeepEqual(count, want) {
		t.Errorf("count: got %v, want %v", count, want)
	}
	if desc["build"] != "bin/" {
		t.Errorf("build's description: got %q", desc["build"])
	}
}

// TestMakefile checks the repository's Makefile: one rule per target,
// each declared .PHONY once, and `make help` listing each once with a
// description and nothing else.
func TestMakefile(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	text, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := Parse(string(text))
	if len(m.Order) < 10 {
		t.Fatalf("found %d targets in the Makefile (%v): the parser misread it", len(m.Order), m.Order)
	}
	checkRules(t, m)
	checkHelp(t, m, makeHelp(t, root))
}

// checkRules: one rule per target, each declared .PHONY once, and no
// .PHONY without a rule.
func checkRules(t *testing.T, m Makefile) {
	for _, target := range m.Order {
		if n := m.Rules[target]; n != 1 {
			t.Errorf("target %s has %d rules: give it one, with all its prerequisites", target, n)
		}
		if n := m.Phony[target]; n != 1 {
			t.Errorf("target %s is declared .PHONY %d times: declare it once, in its group", target, n)
		}
	}
	for target := range m.Phony {
		if m.Rules[target] == 0 {
			t.Errorf(".PHONY names %s, which has no rule", target)
		}
	}
}

// makeHelp is the output of `make help` in root.
func makeHelp(t *testing.T, root string) string {
	makeBin, err := exec.LookPath("make")
	if err != nil {
		t.Skip("no make on PATH: cannot run make help")
	}
	cmd := exec.Command(makeBin, "-s", "--no-print-directory", "-C", root, "help")
	// A parent make's flags (make unit runs this test) must not reach
	// this one: -n would print the recipe instead of running it.
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "MAKEFLAGS" && k != "MFLAGS" && k != "MAKELEVEL" {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make help: %v\n%s", err, out)
	}
	return string(out)
}

// checkHelp: make help lists every target of m once, with a description,
// and nothing else.
func checkHelp(t *testing.T, m Makefile, out string) {
	count, desc := Help(out)
	for _, target := range m.Order {
		switch n := count[target]; {
		case n == 0:
			t.Errorf("make help does not list %s: write a \"## \" line just above its rule", target)
		case n > 1:
			t.Errorf("make help lists %s %d times", target, n)
		case strings.TrimSpace(desc[target]) == "":
			t.Errorf("make help lists %s without a description", target)
		}
	}
	var unknown []string
	for target := range count {
		if m.Rules[target] == 0 {
			unknown = append(unknown, target)
		}
	}
	sort.Strings(unknown)
	if len(unknown) > 0 {
		t.Errorf("make help lists %v, which have no rule in the Makefile", unknown)
	}
}
