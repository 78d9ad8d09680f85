package luks2

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	luksgo "github.com/anatol/luks.go"
)

// The benchmarks compare with cryptsetup on identical work. Each is one
// sub-benchmark "vs=<reference>" reporting our time per operation in ms,
// cryptsetup's as ref-ms and the ratio as x-ref (below 1: we are faster),
// the shape make bench turns into its table. cryptsetup's time includes
// starting its process, which an operator or a node plugin calling it
// would pay too.

var benchKDFs = []struct {
	name string
	p    KDFParams
	args []string
}{
	{"argon2id-default", DefaultKDF, []string{"--pbkdf", "argon2id",
		"--pbkdf-force-iterations", strconv.Itoa(DefaultKDF.Time),
		"--pbkdf-memory", strconv.Itoa(DefaultKDF.MemoryKiB),
		"--pbkdf-parallel", strconv.Itoa(DefaultKDF.Threads)}},
	{"pbkdf2-sha256-200k", KDFParams{Type: "pbkdf2", Hash: "sha256", Iterations: 200000},
		[]string{"--pbkdf", "pbkdf2", "--hash", "sha256", "--pbkdf-force-iterations", "200000"}},
}

func timeCryptsetup(b *testing.B, n int, stdin []byte, args ...string) time.Duration {
	b.Helper()
	var total time.Duration
	for range n {
		start := time.Now()
		if _, errs, err := cryptsetup(b, stdin, args...); err != nil {
			b.Fatalf("cryptsetup %v: %v %s", args, err, errs)
		}
		total += time.Since(start)
	}
	return total / time.Duration(n)
}

func report(b *testing.B, ours time.Duration, theirs time.Duration) {
	b.ReportMetric(float64(ours.Microseconds())/1000, "ms")
	b.ReportMetric(float64(theirs.Microseconds())/1000, "ref-ms")
	b.ReportMetric(float64(ours)/float64(theirs), "x-ref")
}

// benchUnlock: the agent's unlock up to the mapping (package crypt): both
// header copies read and validated, the snapshot made, luks.go's unseal of
// keyslot 0 run through Unseal; against `cryptsetup open --test-passphrase`
// on the same image.
func benchUnlock(b *testing.B, which int) {
	needCryptsetup(b)
	pass := []byte("benchmark passphrase")
	k := benchKDFs[which]
	b.Run("vs=cryptsetup-test-passphrase", func(b *testing.B) {
		p, v := formatImage(b, 32<<20, FormatOptions{Passphrase: pass, KDF: k.p, DigestIterations: DefaultDigestIterations})
		v.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		start := time.Now()
		n := 0
		for b.Loop() {
			v, err := Open(p, false)
			if err != nil {
				b.Fatal(err)
			}
			snap, err := v.Snapshot()
			if err != nil {
				b.Fatal(err)
			}
			d, err := luksgo.Open(SnapshotPath(snap))
			if err != nil {
				b.Fatal(err)
			}
			u := &luksGoUnsealer{d: d}
			if _, _, err := Unseal(ctx, v, pass, UnlockLimits{}, u.unseal, nil); err != nil {
				b.Fatal(err)
			}
			d.Close()
			snap.Close()
			v.Close()
			n++
		}
		ours := time.Since(start) / time.Duration(n)
		theirs := timeCryptsetup(b, 3, pass, "open", "--test-passphrase", "--key-file", "-", p)
		report(b, ours, theirs)
	})
}

// benchFormat: a complete format of a 64 MiB image (wipe, keyslot, both
// headers, syncs), against `cryptsetup luksFormat` with the same keyslot
// cost.
func benchFormat(b *testing.B, which int) {
	needCryptsetup(b)
	pass := []byte("benchmark passphrase")
	k := benchKDFs[which]
	b.Run("vs=cryptsetup-luksFormat", func(b *testing.B) {
		p := newImage(b, 64<<20)
		start := time.Now()
		n := 0
		for b.Loop() {
			v, err := Format(p, FormatOptions{Passphrase: pass, KDF: k.p, Force: true})
			if err != nil {
				b.Fatal(err)
			}
			v.Close()
			n++
		}
		ours := time.Since(start) / time.Duration(n)
		args := append([]string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--sector-size", "4096"}, k.args...)
		theirs := timeCryptsetup(b, 3, pass, append(args, p)...)
		report(b, ours, theirs)
	})
}

// Argon2id at the default cost, pbkdf2-sha256 at 200000 iterations.
func BenchmarkUnlockArgon2idDefault(b *testing.B) { benchUnlock(b, 0) }
func BenchmarkUnlockPBKDF2(b *testing.B)          { benchUnlock(b, 1) }
func BenchmarkFormatArgon2idDefault(b *testing.B) { benchFormat(b, 0) }
func BenchmarkFormatPBKDF2(b *testing.B)          { benchFormat(b, 1) }

// TestBenchmarkKDFsMatchCryptsetup keeps the benchmark honest: the image
// cryptsetup formats in BenchmarkFormat carries the same keyslot cost as
// ours.
func TestBenchmarkKDFsMatchCryptsetup(t *testing.T) {
	needCryptsetup(t)
	for _, k := range benchKDFs {
		p := newImage(t, 32<<20)
		args := append([]string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-"}, k.args...)
		if k.p.Type != "pbkdf2" {
			// The cost does not matter for this check; keep it cheap.
			args = []string{"luksFormat", "--type", "luks2", "-q", "--key-file", "-", "--pbkdf", "argon2id",
				"--pbkdf-force-iterations", strconv.Itoa(k.p.Time), "--pbkdf-memory", "8192", "--pbkdf-parallel", strconv.Itoa(k.p.Threads)}
		}
		if _, errs, err := cryptsetup(t, []byte("x"), append(args, p)...); err != nil {
			t.Fatalf("%s: %v %s", k.name, err, errs)
		}
		v, err := Open(p, false)
		if err != nil {
			t.Fatal(err)
		}
		kdf := v.Header.Meta.Keyslots["0"].KDF
		v.Close()
		want := k.p.withDefaults()
		got := fmt.Sprintf("%s/%d/%d/%s", kdf.Type, kdf.Time, kdf.CPUs, kdf.Hash)
		exp := fmt.Sprintf("%s/%d/%d/%s", want.Type, want.Time, want.Threads, "")
		if want.Type == "pbkdf2" {
			got = fmt.Sprintf("%s/%s/%d", kdf.Type, kdf.Hash, kdf.Iterations)
			exp = fmt.Sprintf("%s/%s/%d", want.Type, want.Hash, want.Iterations)
		}
		if got != exp {
			t.Errorf("%s: cryptsetup wrote %s, ours %s", k.name, got, exp)
		}
	}
}
