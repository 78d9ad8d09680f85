package e2e

import (
	"fmt"
	"html/template"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// Property is one of the safety properties of the design (P1-P5).
type Property string

// The safety properties, as docs/architecture.md, Safety properties words them.
const (
	P1 Property = "P1"
	P2 Property = "P2"
	P3 Property = "P3"
	P4 Property = "P4"
	P5 Property = "P5"
)

var propertyText = map[Property]string{
	P1: "a RWO volume is never writable from two nodes at once",
	P2: "a node that finds a disk held by another live holder refuses it (read-only, not mounted, DiskRefused naming the holder, FAILED_PRECONDITION)",
	P3: "takeover only with a grant from the controller",
	P4: "a node that loses its claim to another holder stops I/O, emits DiskFenced, never takes it back by itself",
	P5: "no operation destroys data it did not create (no mkfs over data, no double format)",
}

// Properties lists the properties in order.
var Properties = []Property{P1, P2, P3, P4, P5}

// Step is one action of the story: a CSI call, a platform action or a
// check, with how long it took.
type Step struct {
	Scenario string
	Name     string
	Node     string // where it ran: "controller", "platform", "host" or a node name
	Start    time.Time
	Duration time.Duration
	OK       bool
	Detail   string
}

// Check is one piece of evidence for or against a property.
type Check struct {
	Property Property
	Scenario string
	Held     bool
	Evidence string
}

// Report is what a run of the story found.
type Report struct {
	Started  time.Time
	Finished time.Time
	Kind     string
	// Setup is the lab's set-up time (tgtd, initramfs, guests booted with
	// their node stacks), Boot each guest's boot time.
	Setup time.Duration
	Boot  map[string]time.Duration
	// Scenarios are the scenarios that ran (or began), in order.
	Scenarios []Scenario
	Steps     []Step
	Checks    []Check
	Events    []simlab.Event
	// NotRun lists scenarios or checks that did not run, with the reason.
	NotRun []string
	// Err is the error that ended the story early, if any.
	Err error
}

// Run runs f as one step of the report and returns the step recorded:
// its detail is f's text, followed by f's error when it failed.
func (r *Report) Run(scenario, node, name string, f func() (string, error)) (Step, error) {
	st := Step{Scenario: scenario, Node: node, Name: name, Start: time.Now()}
	detail, err := f()
	st.Duration = time.Since(st.Start)
	st.OK = err == nil
	st.Detail = detail
	if err != nil {
		if st.Detail != "" {
			st.Detail += "\n"
		}
		st.Detail += err.Error()
	}
	r.Steps = append(r.Steps, st)
	return st, err
}

// Check records one piece of evidence for or against p.
func (r *Report) Check(p Property, scenario string, held bool, format string, a ...any) {
	r.Checks = append(r.Checks, Check{Property: p, Scenario: scenario, Held: held, Evidence: fmt.Sprintf(format, a...)})
}

// Verdict is a property's outcome: held only when it was checked and no
// check failed.
func (r *Report) Verdict(p Property) (held bool, checks []Check) {
	for _, c := range r.Checks {
		if c.Property == p {
			checks = append(checks, c)
		}
	}
	if len(checks) == 0 {
		return false, nil
	}
	for _, c := range checks {
		if !c.Held {
			return false, checks
		}
	}
	return true, checks
}

// AllHeld reports whether every property held and the story ran to its end.
func (r *Report) AllHeld() bool {
	if r.Err != nil {
		return false
	}
	for _, p := range Properties {
		if ok, _ := r.Verdict(p); !ok {
			return false
		}
	}
	return true
}

// WriteText prints the report for a terminal.
func (r *Report) WriteText(w io.Writer) {
	fmt.Fprintf(w, "\n== vco-storage lab: RWO volume on two nodes (%s disks), %s\n\n", r.Kind, r.Finished.Sub(r.Started).Round(time.Second))
	if r.Setup > 0 {
		fmt.Fprintf(w, "lab set-up %.1fs (tgtd, initramfs, guests, agents and node plugins);", r.Setup.Seconds())
		for _, n := range sortedKeys(r.Boot) {
			fmt.Fprintf(w, " %s booted in %.1fs", n, r.Boot[n].Seconds())
		}
		fmt.Fprintln(w)
		fmt.Fprintln(w)
	}
	if len(r.Scenarios) > 0 {
		fmt.Fprintln(w, "scenarios:")
		for _, sc := range r.Scenarios {
			fmt.Fprintf(w, "  %-4s %s [%s]\n", sc.ID, sc.Name, PropsText(sc.Props))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "%-4s %-10s %-11s %-58s %9s\n", "", "scenario", "where", "step", "duration")
	for _, s := range r.Steps {
		mark := "ok"
		if !s.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "%-4s %-10s %-11s %-58s %8.2fs\n", mark, s.Scenario, s.Node, s.Name, s.Duration.Seconds())
		if s.Detail != "" {
			for _, line := range strings.Split(s.Detail, "\n") {
				fmt.Fprintf(w, "%27s %s\n", "", line)
			}
		}
	}
	fmt.Fprintf(w, "\nevents the nodes emitted (vco-agent events --json):\n")
	for _, ev := range r.sortedEvents() {
		fmt.Fprintf(w, "  %s  %-7s %-16s %s\n", ev.Time.UTC().Format("15:04:05.000"), ev.Node, ev.Name(), eventFields(ev))
	}
	if len(r.NotRun) > 0 {
		fmt.Fprintf(w, "\nnot run:\n")
		for _, n := range r.NotRun {
			fmt.Fprintf(w, "  - %s\n", n)
		}
	}
	fmt.Fprintf(w, "\nsafety properties (docs/architecture.md, Safety properties):\n")
	for _, p := range Properties {
		held, checks := r.Verdict(p)
		v := "HELD"
		switch {
		case len(checks) == 0:
			v = "NOT SHOWN"
		case !held:
			v = "VIOLATED"
		}
		fmt.Fprintf(w, "  %s %-9s %s\n", p, v, propertyText[p])
		for _, c := range checks {
			m := "+"
			if !c.Held {
				m = "!"
			}
			fmt.Fprintf(w, "       %s [%s] %s\n", m, c.Scenario, c.Evidence)
		}
	}
	if r.Err != nil {
		fmt.Fprintf(w, "\nthe story stopped early: %v\n", r.Err)
	}
	if r.AllHeld() {
		fmt.Fprintf(w, "\nverdict: every property held\n")
	} else {
		fmt.Fprintf(w, "\nverdict: NOT every property was shown to hold\n")
	}
}

func sortedKeys(m map[string]time.Duration) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func eventFields(ev simlab.Event) string {
	var parts []string
	for _, kv := range [][2]string{{"volume", ev.Volume}, {"device", ev.Device}, {"serial", ev.Serial},
		{"holder_key", ev.HolderKey}, {"holder_node", ev.HolderNode}, {"reason", ev.Reason}} {
		if kv[1] != "" {
			parts = append(parts, kv[0]+"="+kv[1])
		}
	}
	if ev.Message != "" {
		parts = append(parts, fmt.Sprintf("%q", ev.Message))
	}
	return strings.Join(parts, " ")
}

func (r *Report) sortedEvents() []simlab.Event {
	evs := append([]simlab.Event(nil), r.Events...)
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].Time.Before(evs[j].Time) })
	return evs
}

// nodes are the lanes of the timeline: the host's steps first, then each
// node's events.
func (r *Report) nodes() []string {
	seen := map[string]bool{}
	var out []string
	for _, ev := range r.Events {
		if !seen[ev.Node] {
			seen[ev.Node] = true
			out = append(out, ev.Node)
		}
	}
	sort.Strings(out)
	return out
}

type htmlItem struct {
	// Row alternates 0 and 1 along a lane so labels of close items do not
	// overlap.
	Row          int
	Left, Width  float64
	Label, Title string
	Class        string
}

type htmlLane struct {
	Name  string
	Items []htmlItem
}

type htmlProp struct {
	ID, Text, Verdict, Class string
	Checks                   []Check
}

// WriteHTML writes a self-contained page: a timeline with one lane for the
// steps and one per node for its events, the steps table and the verdicts.
func (r *Report) WriteHTML(w io.Writer) error {
	span := r.Finished.Sub(r.Started)
	if span <= 0 {
		span = time.Second
	}
	pos := func(t time.Time) float64 {
		p := 100 * float64(t.Sub(r.Started)) / float64(span)
		return min(max(p, 0), 99.5)
	}
	steps := htmlLane{Name: "steps (host)"}
	for _, s := range r.Steps {
		cls := "step"
		if !s.OK {
			cls = "step fail"
		}
		steps.Items = append(steps.Items, htmlItem{Row: len(steps.Items) % 2, Left: pos(s.Start), Width: max(100*float64(s.Duration)/float64(span), 0.3),
			Label: s.Scenario, Title: fmt.Sprintf("%s %s on %s: %.2fs %s", s.Scenario, s.Name, s.Node, s.Duration.Seconds(), s.Detail), Class: cls})
	}
	lanes := []htmlLane{steps}
	for _, n := range r.nodes() {
		l := htmlLane{Name: n}
		for _, ev := range r.Events {
			if ev.Node != n {
				continue
			}
			l.Items = append(l.Items, htmlItem{Row: len(l.Items) % 2, Left: pos(ev.Time), Width: 0.4, Label: ev.Name(),
				Title: ev.Time.UTC().Format("15:04:05.000") + " " + ev.Name() + " " + eventFields(ev), Class: "ev " + ev.Name()})
		}
		lanes = append(lanes, l)
	}
	var props []htmlProp
	for _, p := range Properties {
		held, checks := r.Verdict(p)
		hp := htmlProp{ID: string(p), Text: propertyText[p], Verdict: "HELD", Class: "held", Checks: checks}
		if len(checks) == 0 {
			hp.Verdict, hp.Class = "NOT SHOWN", "bad"
		} else if !held {
			hp.Verdict, hp.Class = "VIOLATED", "bad"
		}
		props = append(props, hp)
	}
	errText := ""
	if r.Err != nil {
		errText = r.Err.Error()
	}
	return reportPage.Execute(w, map[string]any{
		"Started": r.Started.UTC().Format(time.RFC3339), "Span": span.Round(time.Second).String(), "Kind": r.Kind,
		"Lanes": lanes, "Steps": r.Steps, "Props": props, "Events": r.sortedEvents(), "NotRun": r.NotRun,
		"Err": errText, "AllHeld": r.AllHeld(),
	})
}

var reportPage = template.Must(template.New("report").Funcs(template.FuncMap{
	"secs":   func(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) },
	"clock":  func(t time.Time) string { return t.UTC().Format("15:04:05.000") },
	"fields": eventFields,
}).Parse(`<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>vco-storage lab report</title>
<style>
body{font-family:sans-serif;margin:1.5em;color:#222}
.lane{position:relative;height:3.6em;border-bottom:1px solid #ddd;margin-left:9em}
.lane .name{position:absolute;left:-9em;width:8.5em;top:.5em;font-weight:bold;font-size:.9em}
.item{position:absolute;height:1.5em;font-size:.7em;overflow:visible;white-space:nowrap;border-radius:3px}
.step{background:#cfe3ff;border:1px solid #69c}
.fail{background:#f99;border-color:#c00}
.ev{background:#666;color:#fff;padding:0 .3em;width:auto!important}
.DiskClaimed{background:#2a7}.DiskRefused{background:#d80}.DiskFenced{background:#c22}.DiskReleased{background:#57a}.TakeoverGranted{background:#85c}
table{border-collapse:collapse;margin-top:1em}td,th{border:1px solid #ccc;padding:.2em .5em;font-size:.85em;text-align:left;vertical-align:top}
.held{color:#070;font-weight:bold}.bad{color:#c00;font-weight:bold}
</style></head><body>
<h1>vco-storage lab: RWO volume on two nodes</h1>
<p>Started {{.Started}}, {{.Span}}, {{.Kind}} disks. Verdict: {{if .AllHeld}}<span class="held">every property held</span>{{else}}<span class="bad">not every property was shown to hold</span>{{end}}</p>
{{if .Err}}<p class="bad">The story stopped early: {{.Err}}</p>{{end}}
<h2>Timeline</h2>
{{range .Lanes}}<div class="lane"><span class="name">{{.Name}}</span>{{range .Items}}<div class="item {{.Class}}" style="top:{{if .Row}}1.9em{{else}}.2em{{end}};left:{{printf "%.2f" .Left}}%;width:{{printf "%.2f" .Width}}%" title="{{.Title}}">{{.Label}}</div>{{end}}</div>
{{end}}
<h2>Safety properties</h2>
<table><tr><th></th><th>verdict</th><th>property and evidence</th></tr>
{{range .Props}}<tr><td>{{.ID}}</td><td class="{{.Class}}">{{.Verdict}}</td><td>{{.Text}}<ul>{{range .Checks}}<li>{{if .Held}}&#10003;{{else}}<b>&#10007;</b>{{end}} [{{.Scenario}}] {{.Evidence}}</li>{{end}}</ul></td></tr>
{{end}}</table>
<h2>Steps</h2>
<table><tr><th>scenario</th><th>where</th><th>step</th><th>duration</th><th>result</th></tr>
{{range .Steps}}<tr><td>{{.Scenario}}</td><td>{{.Node}}</td><td>{{.Name}}</td><td>{{secs .Duration}}</td><td class="{{if .OK}}held{{else}}bad{{end}}">{{if .OK}}ok{{else}}FAIL{{end}} {{.Detail}}</td></tr>
{{end}}</table>
<h2>Events</h2>
<table><tr><th>time (UTC)</th><th>node</th><th>event</th><th>fields</th></tr>
{{range .Events}}<tr><td>{{clock .Time}}</td><td>{{.Node}}</td><td>{{.Name}}</td><td>{{fields .}}</td></tr>
{{end}}</table>
{{if .NotRun}}<h2>Not run</h2><ul>{{range .NotRun}}<li>{{.}}</li>{{end}}</ul>{{end}}
</body></html>
`))
