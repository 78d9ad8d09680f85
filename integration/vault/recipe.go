package vault

import (
	"bufio"
	"bytes"
	"fmt"
	"regexp"
	"strings"
)

// Block is one fenced block of a doc's section: its language (sh, hcl,
// yaml) and text. File is the name the prose before it gives in
// parentheses and backticks ("(`policy.hcl`)"): a block an operator saves
// to that file rather than runs.
type Block struct {
	Lang, Text, File string
}

// fileName is how the prose names the file a block is saved to.
var fileName = regexp.MustCompile("\\(`([^`/ ]+\\.(?:hcl|json|yaml))`\\)")

// Recipe returns, in order, the fenced blocks of the section of the
// markdown doc whose heading line is heading (up to the next heading of
// the same or a higher level), so the lab runs a doc's commands as an
// operator reads them. A block's lines lose the indentation of its
// opening fence. A section that is absent, or holds an unclosed block or
// none, is an error.
func Recipe(doc []byte, heading string) ([]Block, error) {
	level := strings.IndexFunc(heading, func(r rune) bool { return r != '#' })
	if level < 1 {
		return nil, fmt.Errorf("%q is not a markdown heading", heading)
	}
	sc := bufio.NewScanner(bytes.NewReader(doc))
	in, found := false, false
	var blocks []Block
	var cur *Block
	var indent, prose string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case cur != nil:
			if strings.TrimSpace(line) == "```" {
				blocks = append(blocks, *cur)
				cur, prose = nil, ""
				continue
			}
			cur.Text += strings.TrimPrefix(line, indent) + "\n"
		case line == heading:
			in, found = true, true
		case !in:
		case isHeading(line, level):
			in = false
		case strings.HasPrefix(strings.TrimSpace(line), "```"):
			t := strings.TrimSpace(line)
			indent = line[:len(line)-len(strings.TrimLeft(line, " "))]
			cur = &Block{Lang: strings.TrimPrefix(t, "```")}
			if m := fileName.FindAllStringSubmatch(prose, -1); m != nil {
				cur.File = m[len(m)-1][1]
			}
		default:
			prose += line + "\n"
		}
	}
	switch {
	case !found:
		return nil, fmt.Errorf("no section %q", heading)
	case cur != nil:
		return nil, fmt.Errorf("section %q: a %s block is not closed", heading, cur.Lang)
	case len(blocks) == 0:
		return nil, fmt.Errorf("section %q holds no fenced block", heading)
	}
	return blocks, sc.Err()
}

// isHeading says whether line is a markdown heading of level or higher
// (fewer #).
func isHeading(line string, level int) bool {
	n := len(line) - len(strings.TrimLeft(line, "#"))
	return n >= 1 && n <= level && strings.HasPrefix(line[n:], " ")
}
