// Command vco-bench prints the one table `make bench` ends with: every
// benchmark of the project beside its reference, with the ratio, from the
// raw output each bench-* target keeps in bin/bench-*.txt. The parts are
// measured by different tools (Go benchmarks on the host, the lab's own
// timings inside QEMU guests), so their outputs are read here rather than
// made to share one harness.
//
// Go benchmark lines follow one convention: a
// sub-benchmark "vs=NAME" names the reference, the figure is reported in a
// unit U, the reference's as "ref-U", the ratio as "x-ref". The controller
// benchmark reports "drv-U", "ref-U" and "drv/ref". The lab prints a table
// "benchmark value ratio" whose "(reference)" rows are the reference of
// the rows after them.
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"text/tabwriter"
)

// row is one line of the table.
type row struct {
	measure, value, ref, refValue, ratio, source, notes string
}

// titles say in words what a Go benchmark measures.
var titles = map[string]string{
	"ExecToReady":              "agent exec to READY=1",
	"IdleRSS":                  "agent idle RSS 1 s after READY=1",
	"EventsTo10Subscribers":    "events/s delivered to each of 10 subscribers",
	"StageUnstage":             "stage+unstage, ext4 on a loop device",
	"Check64Claims":            "agent check of 64 PR claims",
	"Reconcile64Claims":        "agent start-up check of 64 claims",
	"CreatePublish100":         "100 concurrent CreateVolume+ControllerPublish, API round trip 30 ms",
	"CreatePublish100FastAPI":  "100 concurrent CreateVolume+ControllerPublish, API round trip 2 ms",
	"NodeStageUnstage":         "NodeStage+NodeUnstage, plugin and agent, loop device",
	"UnlockArgon2idDefault":    "LUKS2 unlock, argon2id",
	"UnlockPBKDF2":             "LUKS2 unlock, pbkdf2",
	"FormatArgon2idDefault":    "LUKS2 format, argon2id",
	"FormatPBKDF2":             "LUKS2 format, pbkdf2",
	"LeaseTakeoverExpired":     "lease takeover from a dead holder",
	"LeaseTakeoverGrantedLive": "lease takeover with a grant, holder alive",
	"LeaseCheck64Claims":       "lease check of 64 claims",
	"LeaseIOBusyLoop":          "lease read+write on a busy loop device, the slowest",
	"RefusalLatency":           "refusal of a held disk after its uevent",
}

// refTitles name the references in words.
var refTitles = map[string]string{
	"bin-true":                   "exec to exit of /bin/true",
	"idle-go-process":            "a static Go program that only sleeps",
	"channel-fanout":             "bare Go channel fan-out to 10 readers",
	"mount-umount":               "mount(2)+umount(2) of the same ext4",
	"engine-checks":              "the 64 reservation engines' own Check",
	"one-scan":                   "one discovery scan of the 64 disks",
	"cryptsetup-test-passphrase": "cryptsetup open --test-passphrase",
	"cryptsetup-luksFormat":      "cryptsetup luksFormat",
	"expiry+settle-bound":        "bound: lease expiry + settle time",
	"renew+settle":               "one renewal interval + settle time",
	"grant-live-bound":           "bound: max(2d, R) + d/2",
	"default-io-timeout":         "the default lease I/O timeout d",
	"raw-odirect-reads":          "64 raw O_DIRECT reads of the lease area",
	"one-second-budget":          "the 1 s budget",
	"bare-api":                   "the same API calls made bare",
	"mount-umount-cmd":           "mount + umount commands, same device",
}

var (
	goLine   = regexp.MustCompile(`^Benchmark([^/\s]+?)(?:/vs=(\S+?))?(-\d+)?\s+\d+\s+(.*)$`)
	labHead  = regexp.MustCompile(`^benchmark\s+value\s+ratio\s*$`)
	labRow   = regexp.MustCompile(`^(.+?)\s{2,}(\S+)\s+(\S+)\s*$`)
	failLine = regexp.MustCompile(`^(FAIL|--- FAIL|panic:)`)
)

// parse reads one raw output. It reports whether a benchmark failed.
func parse(r io.Reader, source string) (rows []row, failed bool) {
	sc := bufio.NewScanner(r)
	inLab := false
	var labRef, labRefValue string
	for sc.Scan() {
		text := sc.Text()
		if failLine.MatchString(text) {
			failed = true
		}
		if labHead.MatchString(text) {
			inLab = true
			continue
		}
		if m := goLine.FindStringSubmatch(text); m != nil {
			if r, ok := goRow(m[1], m[2], m[4]); ok {
				r.source = source
				rows = append(rows, r)
			}
			continue
		}
		if !inLab {
			continue
		}
		m := labRow.FindStringSubmatch(text)
		if m == nil {
			continue
		}
		name, value, ratio := strings.TrimSpace(m[1]), m[2], m[3]
		if base, ok := strings.CutSuffix(name, " (reference)"); ok {
			labRef, labRefValue = base, value
			continue
		}
		if labRef == "" {
			continue
		}
		if !strings.HasSuffix(ratio, "x") {
			// Not measured (the row says why in its ratio column).
			value, ratio = "n/a", ""
		}
		rows = append(rows, row{name, value, labRef, labRefValue, ratio, source, ""})
	}
	return rows, failed
}

// goRow turns the metrics of one Go benchmark line into a row.
func goRow(name, vs, metrics string) (row, bool) {
	f := strings.Fields(metrics)
	vals := map[string]string{}
	var units []string
	for i := 0; i+1 < len(f); i += 2 {
		vals[f[i+1]] = f[i]
		units = append(units, f[i+1])
	}
	r := row{measure: name}
	if t := titles[name]; t != "" {
		r.measure = t
	}
	for _, u := range units {
		base, ok := strings.CutPrefix(u, "ref-")
		if !ok {
			continue
		}
		r.refValue = vals[u] + " " + base
		if v, ok := vals[base]; ok {
			r.value = v + " " + base
		} else if v, ok := vals["drv-"+base]; ok {
			r.value = v + " " + base
			if vs == "" {
				vs = "bare-api"
			}
		}
	}
	if r.value == "" || vs == "" {
		return row{}, false
	}
	var notes []string
	for _, u := range units {
		used := u == "ns/op" || u == "x-ref" || u == "drv/ref" || strings.HasPrefix(u, "ref-") || strings.HasPrefix(u, "drv-")
		if !used && r.value != vals[u]+" "+u {
			notes = append(notes, vals[u]+" "+u)
		}
	}
	r.notes = strings.Join(notes, ", ")
	r.ref = vs
	if t := refTitles[vs]; t != "" {
		r.ref = t
	}
	if v, ok := vals["x-ref"]; ok {
		r.ratio = v + "x"
	} else if v, ok := vals["drv/ref"]; ok {
		r.ratio = v + "x"
	}
	return r, true
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: vco-bench bin/bench-*.txt")
		os.Exit(2)
	}
	var all []row
	bad := false
	for _, path := range os.Args[1:] {
		f, err := os.Open(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "vco-bench: %v (run its bench-* target first)\n", err)
			bad = true
			continue
		}
		source := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(path), "bench-"), ".txt")
		rows, failed := parse(f, source)
		f.Close()
		if failed || len(rows) == 0 {
			fmt.Fprintf(os.Stderr, "vco-bench: %s: a benchmark failed or none ran; see that file\n", path)
			bad = true
		}
		all = append(all, rows...)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "measure\tvalue\treference\treference value\tratio\tpart\tnotes")
	for _, r := range all {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.measure, r.value, r.ref, r.refValue, r.ratio, r.source, r.notes)
	}
	tw.Flush()
	if bad {
		os.Exit(1)
	}
}
