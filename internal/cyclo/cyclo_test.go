package cyclo

import (
	"go/parser"
	"go/token"
	"sort"
	"strings"
	"testing"
)

// Over is the complexity bar: no product function is more complex than this.
const Over = 20

// exempt are the product functions allowed over the bar, each with why. The
// test fails on any other function over it and on an entry here that is no
// longer over it (or no longer exists), so the list only shrinks.
//
// Tests have a list of their own (exemptTests). Not counted at all:
// generated code (the API's *.pb.go and anything else marked "Code
// generated ... DO NOT EDIT.").
//
// Every product function is under the bar now, so the list is empty.
var exempt = map[string]string{}

func TestNoFunctionOverTheBar(t *testing.T) {
	funcs, err := Dir("../..", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(funcs) < 100 {
		t.Fatalf("found %d functions under the repository; is ../.. its root?", len(funcs))
	}
	holdToTheBar(t, funcs, exempt)
}

// Tests are held to the bar too, with their own list of those still over
// it (exemptTests): a new test over it fails.
func TestNoTestOverTheBar(t *testing.T) {
	all, err := Dir("../..", Options{Tests: true})
	if err != nil {
		t.Fatal(err)
	}
	var tests []Func
	for _, f := range all {
		if strings.HasSuffix(f.Path, "_test.go") {
			tests = append(tests, f)
		}
	}
	if len(tests) < 100 {
		t.Fatalf("found %d test functions under the repository; is ../.. its root?", len(tests))
	}
	holdToTheBar(t, tests, exemptTests)
}

// holdToTheBar fails on each function of funcs over the bar that exempt
// does not list, and on each entry of exempt no longer over it.
func holdToTheBar(t *testing.T, funcs []Func, exempt map[string]string) {
	t.Helper()
	over := map[string]Func{}
	var news []string
	for _, f := range funcs {
		if f.Complexity <= Over {
			continue
		}
		over[f.Key()] = f
		if _, ok := exempt[f.Key()]; !ok {
			news = append(news, f.String())
		}
	}
	sort.Strings(news)
	for _, f := range news {
		t.Errorf("%s: cyclomatic complexity over %d; cut it into named steps or, for a table-driven validator, make it a table", f, Over)
	}
	var stale []string
	for k := range exempt {
		if _, ok := over[k]; !ok {
			stale = append(stale, k)
		}
	}
	sort.Strings(stale)
	for _, k := range stale {
		t.Errorf("%s is exempt but no longer over %d (or gone): remove it from the list", k, Over)
	}
}

// The count is gocyclo's: 1, plus each if, for, range, non-default case and
// comm clause, && and ||; closures count toward their function; a function
// literal in a package variable counts on its own.
func TestCountsLikeGocyclo(t *testing.T) {
	const src = `package p

func straight() { println() }

func branches(a, b bool, xs []int, ch chan int) {
	if a && b || !a { // if, &&, ||: 3
	}
	for i := 0; i < 1; i++ { // 1
	}
	for range xs { // 1
	}
	switch { // two cases, default free: 2
	case a:
	case b:
	default:
	}
	select { // one comm clause, default free: 1
	case <-ch:
	default:
	}
	f := func() {
		if a { // a closure's branch is its function's: 1
		}
	}
	_ = f
}

type T[K any] struct{}

func (t *T[K]) m(a bool) { if a {} }

func (T[K]) n() {}

var lit = func(a bool) { if a {}; if !a {} }
`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, fn := range File(fset, "p.go", f) {
		got[fn.Name] = fn.Complexity
	}
	want := map[string]int{"straight": 1, "branches": 10, "(*T).m": 2, "(T).n": 1, "lit": 3}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: complexity %d, want %d", name, got[name], w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("counted %v, want the functions %v", got, want)
	}
}

// Generated files and tests are left out unless asked for.
func TestDirSkipsGeneratedAndTests(t *testing.T) {
	all, err := Dir("../..", Options{Tests: true, Generated: true})
	if err != nil {
		t.Fatal(err)
	}
	some, err := Dir("../..", Options{})
	if err != nil {
		t.Fatal(err)
	}
	var pb, tests int
	for _, f := range all {
		if strings.HasSuffix(f.Path, ".pb.go") {
			pb++
		}
		if strings.HasSuffix(f.Path, "_test.go") {
			tests++
		}
	}
	if pb == 0 || tests == 0 {
		t.Fatalf("the whole tree has %d generated and %d test functions; want some of each", pb, tests)
	}
	for _, f := range some {
		if strings.HasSuffix(f.Path, ".pb.go") || strings.HasSuffix(f.Path, "_test.go") {
			t.Errorf("%s counted", f)
		}
	}
	if len(all)-len(some) < pb+tests {
		t.Errorf("%d functions in all, %d without generated and tests; want at least %d fewer", len(all), len(some), pb+tests)
	}
}
