package smbios

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
)

// The seed corpora live in testdata/fuzz/<FuzzName>/ in the go fuzz file
// format, so `go test` replays them on every run and `go test -fuzz` starts
// from them. TestSeedCorpus keeps them in step with the builders; rewrite
// them with: go test ./smbios -run TestSeedCorpus -update-corpus
var updateCorpus = flag.Bool("update-corpus", false, "rewrite the checked-in fuzz seed corpus from the table builders")

var canonicalUUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

func FuzzParseTable(f *testing.F) {
	f.Fuzz(func(t *testing.T, ep, tab []byte) {
		info, err := ParseTable(ep, tab)
		if err != nil {
			if info != (Info{}) {
				t.Fatalf("error %v came with a non-zero Info %+v", err, info)
			}
			return
		}
		if !canonicalUUID.MatchString(info.UUID) {
			t.Fatalf("UUID %q is not canonical", info.UUID)
		}
		if info.UUID == "00000000-0000-0000-0000-000000000000" || info.UUID == "ffffffff-ffff-ffff-ffff-ffffffffffff" {
			t.Fatalf("not-present UUID %q accepted", info.UUID)
		}
		if info.Source != SourceDMITable {
			t.Fatalf("Source %q", info.Source)
		}
	})
}

func FuzzParseStructures(f *testing.F) {
	f.Fuzz(func(t *testing.T, tab []byte) {
		ss, err := ParseStructures(tab)
		// Every structure returned must be a faithful slice of the input,
		// laid end to end: re-encoding them reproduces the walked prefix.
		var re []byte
		for i, s := range ss {
			if len(s.Formatted) < headerLen || int(s.Formatted[1]) != len(s.Formatted) || s.Formatted[0] != s.Type {
				t.Fatalf("structure %d: formatted area %x does not match its header", i, s.Formatted)
			}
			if s.Type == typeEndOfTable && i != len(ss)-1 {
				t.Fatalf("structures returned after end-of-table")
			}
			re = append(re, s.Formatted...)
			if len(s.Strings) == 0 {
				re = append(re, 0, 0)
				continue
			}
			for j, str := range s.Strings {
				// An empty string can only be the first of a set that
				// starts with a lone NUL (it keeps the indexes of the rest
				// where dmidecode counts them); anywhere else two NULs
				// would have ended the set.
				if (str == "" && j > 0) || bytes.IndexByte([]byte(str), 0) >= 0 {
					t.Fatalf("structure %d: bad string %q", i, str)
				}
				re = append(re, str...)
				re = append(re, 0)
			}
			re = append(re, 0)
		}
		if !bytes.HasPrefix(tab, re) {
			t.Fatalf("re-encoded structures are not a prefix of the input")
		}
		if err == nil && len(ss) > 0 && ss[len(ss)-1].Type != typeEndOfTable && len(re) != len(tab) {
			t.Fatalf("walk stopped at %d of %d bytes without end-of-table or an error", len(re), len(tab))
		}
	})
}

// seeds returns the seed inputs of each fuzz target, by file name.
func seeds() map[string]map[string][][]byte {
	t1 := func(ep, tab []byte) [][]byte { return [][]byte{ep, tab} }
	v20 := concat(structure(1, 1, []byte{1, 2, 3, 4}, "a", "b", "c", "d"), endOfTable())
	tab3 := concat(biosInfo(), systemInfo(testUUIDRaw), endOfTable())
	return map[string]map[string][][]byte{
		"FuzzParseTable": {
			"smbios-3.2":         t1(table3(3, 2, testUUIDRaw)),
			"smbios-2.8":         t1(table2(2, 8, testUUIDRaw)),
			"smbios-2.4":         t1(table2(2, 4, testUUIDRaw)),
			"smbios-2.0-no-uuid": t1(entryPoint32(2, 0, uint16(len(v20)), 2), v20),
			"legacy-dmi-2.3":     t1(entryPointLegacy(2, 3, uint16(len(tab3)), 3), tab3),
			"uuid-all-ff":        t1(table3(3, 0, [16]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})),
			"truncated-table":    t1(entryPoint64(3, 0, 200), tab3[:45]),
		},
		"FuzzParseStructures": {
			"three-structures":    {tab3},
			"no-end-of-table":     {concat(biosInfo(), systemInfo(testUUIDRaw))},
			"empty-string-set":    {concat(structure(32, 2, []byte{0, 0, 0, 0, 0, 0, 0}), endOfTable())},
			"unterminated-string": {systemInfo(testUUIDRaw)[:40]},
			"short-length":        {{1, 2, 0, 0, 0, 0}},
		},
	}
}

func encodeCorpusFile(args [][]byte) []byte {
	var b bytes.Buffer
	b.WriteString("go test fuzz v1\n")
	for _, a := range args {
		fmt.Fprintf(&b, "[]byte(%s)\n", strconv.Quote(string(a)))
	}
	return b.Bytes()
}

func TestSeedCorpus(t *testing.T) {
	for target, files := range seeds() {
		dir := filepath.Join("testdata", "fuzz", target)
		for name, args := range files {
			path := filepath.Join(dir, name)
			want := encodeCorpusFile(args)
			if *updateCorpus {
				if err := os.MkdirAll(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, want, 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("seed %s: %v (regenerate with -update-corpus)", path, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("seed %s is out of date with the table builders (regenerate with -update-corpus)", path)
			}
		}
	}
}
