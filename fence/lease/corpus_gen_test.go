package lease

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// TestWriteCorpus regenerates the checked-in fuzz seed corpus when
// LEASE_WRITE_CORPUS=1.
func TestWriteCorpus(t *testing.T) {
	if os.Getenv("LEASE_WRITE_CORPUS") != "1" {
		t.Skip("set LEASE_WRITE_CORPUS=1 to regenerate testdata/fuzz")
	}
	tm := DefaultTiming()
	held := area(Slot{Key: keyA, Epoch: 3, Counter: 9, State: StateHeld, Timing: tm, Node: "node-a"})
	tie := area(Slot{Key: keyA, Epoch: 2, Counter: 1, State: StateHeld, Timing: tm}, Slot{Key: keyB, Epoch: 2, Counter: 1, State: StateHeld, Timing: tm})
	taken := area(Slot{Key: keyA, Epoch: 1, Counter: 50, State: StateFenced, Timing: tm}, Slot{Key: keyB, Epoch: 2, Counter: 3, State: StateHeld, Timing: tm, Supersedes: keyA})
	torn := held.bytes()
	torn[BlockSize+100] ^= 0x40
	geometry := held.bytes()
	h := held.Header
	h.Slots = 8
	copy(geometry, EncodeHeader(h))
	write := func(fuzz, name string, args ...[]byte) {
		dir := filepath.Join("testdata", "fuzz", fuzz)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		s := "go test fuzz v1\n"
		for _, a := range args {
			if fuzz == "FuzzDecodeArea" {
				// The target pads with zeros; trailing ones need no space.
				a = bytes.TrimRight(a, "\x00")
			}
			s += fmt.Sprintf("[]byte(%s)\n", strconv.Quote(string(a)))
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	blocks := func(b []byte) [][]byte {
		return [][]byte{b[:BlockSize], b[BlockSize : 2*BlockSize], b[2*BlockSize : 3*BlockSize]}
	}
	write("FuzzDecodeArea", "held", blocks(held.bytes())...)
	write("FuzzDecodeArea", "tie", blocks(tie.bytes())...)
	write("FuzzDecodeArea", "taken-over", blocks(taken.bytes())...)
	write("FuzzDecodeArea", "torn-slot", blocks(torn)...)
	write("FuzzDecodeArea", "foreign-geometry", blocks(geometry)...)
	ext4 := make([]byte, 2048)
	ext4[1080], ext4[1081] = 0x53, 0xef
	write("FuzzClassify", "ext4", ext4, nil)
	write("FuzzClassify", "lease", held.bytes()[:BlockSize], nil)
	gptEnd := make([]byte, 4096)
	copy(gptEnd[4096-512:], "EFI PART")
	write("FuzzClassify", "gpt-backup", make([]byte, 4096), gptEnd)
}
