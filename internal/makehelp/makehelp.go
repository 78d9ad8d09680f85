// Package makehelp reads the repository's Makefile the way its checks need:
// which targets have rules, how many rules each, which are declared
// .PHONY, and what `make help` printed. Its test keeps `make help` listing
// every target once (docs/development.md, "Make targets").
package makehelp

import (
	"regexp"
	"strings"
)

// rule matches a rule line: targets, then ':' or '::' not followed by '='
// (a ':=' or '::=' line is a variable).
var rule = regexp.MustCompile(`^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*::?(?:[^=]|$)`)

// Makefile is what Parse found in a Makefile's text.
type Makefile struct {
	// Rules counts the rule lines naming each target (special targets
	// such as .PHONY left out).
	Rules map[string]int
	// Order lists the targets in the order of their first rule.
	Order []string
	// Phony counts how often each target is declared .PHONY.
	Phony map[string]int
}

// Parse reads a Makefile's rule lines. Recipe lines (starting with a tab),
// comments and the continuation lines of a variable are not rules; the
// continuation lines of a rule or a .PHONY line are part of it.
func Parse(text string) Makefile {
	m := Makefile{Rules: map[string]int{}, Phony: map[string]int{}}
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		// Join this line's continuations so that a rule is read whole and
		// a variable's continuation lines are never taken for rules.
		for strings.HasSuffix(line, `\`) && i+1 < len(lines) {
			i++
			line = strings.TrimSuffix(line, `\`) + " " + lines[i]
		}
		if strings.HasPrefix(line, "\t") || strings.HasPrefix(line, "#") {
			continue
		}
		g := rule.FindStringSubmatch(line)
		if g == nil {
			continue
		}
		targets := strings.Fields(g[1])
		if len(targets) == 1 && targets[0] == ".PHONY" {
			prereqs := line[strings.Index(line, ":")+1:]
			for _, t := range strings.Fields(prereqs) {
				m.Phony[t]++
			}
			continue
		}
		for _, t := range targets {
			if strings.HasPrefix(t, ".") {
				continue
			}
			if m.Rules[t] == 0 {
				m.Order = append(m.Order, t)
			}
			m.Rules[t]++
		}
	}
	return m
}

// helpLine is a line of `make help` naming a target: two spaces, the
// target, spaces, its description.
var helpLine = regexp.MustCompile(`^  (\S+) +(\S.*)$`)

// Help reads `make help`'s output: how often each target is listed and
// its description. Group headings and blank lines are skipped.
func Help(out string) (count map[string]int, desc map[string]string) {
	count, desc = map[string]int{}, map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if g := helpLine.FindStringSubmatch(line); g != nil {
			count[g[1]]++
			desc[g[1]] = g[2]
		}
	}
	return count, desc
}
