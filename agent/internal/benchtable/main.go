// Command benchtable turns `go test -bench` output of the agent's
// benchmarks into the table `make bench` prints. Each benchmark names its
// reference in a sub-benchmark "vs=NAME" and reports its figure in some
// unit U, the reference's as "ref-U", and their ratio as "x-ref"; any other
// metric is printed as a note.
package main

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strings"
	"text/tabwriter"
)

var titles = map[string]string{
	"ExecToReady":           "exec to READY=1",
	"IdleRSS":               "idle RSS 1 s after READY=1",
	"EventsTo10Subscribers": "events/s delivered to each of 10 subscribers",
	"StageUnstage":          "stage+unstage of an ext4 volume on a loop device",
	"Check64Claims":         "one periodic check of 64 claims",
}

var refTitles = map[string]string{
	"bin-true":        "exec to exit of /bin/true",
	"idle-go-process": "a static Go program that only sleeps",
	"channel-fanout":  "bare Go channel fan-out to 10 readers",
	"mount-umount":    "mount(2)+umount(2) of the same ext4",
	"engine-checks":   "the 64 reservation engines' own Check",
}

var line = regexp.MustCompile(`^Benchmark([^/\s]+)/vs=(\S+?)(-\d+)?\s+\d+\s+(.*)$`)

func main() {
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "measure\tagent\treference\treference value\tratio\tnotes")
	rows, failed := 0, false
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		text := sc.Text()
		if strings.HasPrefix(text, "FAIL") || strings.HasPrefix(text, "--- FAIL") {
			failed = true
		}
		m := line.FindStringSubmatch(text)
		if m == nil {
			continue
		}
		f := strings.Fields(m[4])
		var units []string
		vals := map[string]string{}
		for i := 0; i+1 < len(f); i += 2 {
			vals[f[i+1]] = f[i]
			units = append(units, f[i+1])
		}
		var value, unit, ref, ratio string
		for _, u := range units {
			if base, ok := strings.CutPrefix(u, "ref-"); ok {
				unit, value, ref = base, vals[base], vals[u]+" "+base
			}
		}
		if r, ok := vals["x-ref"]; ok {
			ratio = r + "x"
		}
		var notes []string
		for _, u := range units {
			if u != "ns/op" && u != "x-ref" && u != unit && u != "ref-"+unit {
				notes = append(notes, vals[u]+" "+u)
			}
		}
		title := titles[m[1]]
		if title == "" {
			title = m[1]
		}
		rt := refTitles[m[2]]
		if rt == "" {
			rt = m[2]
		}
		fmt.Fprintf(tw, "%s\t%s %s\t%s\t%s\t%s\t%s\n", title, value, unit, rt, ref, ratio, strings.Join(notes, ", "))
		rows++
	}
	tw.Flush()
	if failed || rows == 0 {
		fmt.Fprintln(os.Stderr, "benchtable: a benchmark failed or none ran; see the go test output above")
		os.Exit(1)
	}
}
