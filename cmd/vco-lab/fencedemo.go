package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// fenceDemo shows the project's reservation engine on the shared LUN: the
// first guest claims it, the second is refused with the holder named, and
// the claim is released. It is skipped (and says so) when the guests'
// vco-agent has no fence command.
func fenceDemo(ctx context.Context, l *lab.Lab, lun *lab.LUN, w io.Writer) error {
	a, b := l.Guests[0], l.Guests[1]
	r, err := a.Sh(ctx, "/bin/vco-agent fence --help 2>&1")
	if err != nil {
		return err
	}
	if !strings.Contains(r.Stdout, "usage: vco-agent fence") {
		fmt.Fprintln(w, "* the guests' vco-agent has no fence command; engine demo skipped")
		return nil
	}
	var nodes string
	for _, g := range l.Guests {
		nodes += " --node " + g.Name + "=" + g.UUID
	}
	dev := map[string]string{}
	for _, g := range []*lab.Guest{a, b} {
		d, err := g.DiskBySerial(ctx, lun.Serial)
		if err != nil {
			return err
		}
		dev[g.Name] = "/dev/" + d.Name
	}
	out, err := a.MustSh(ctx, "vco-agent fence acquire "+dev[a.Name]+nodes+" 2>&1")
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "* %s: vco-agent fence acquire: %s", a.Name, out)
	r, err = b.Sh(ctx, "vco-agent fence acquire "+dev[b.Name]+nodes+" 2>&1")
	if err != nil {
		return err
	}
	if r.Exit != 1 || !strings.Contains(r.Stdout, "node "+a.Name) {
		return fmt.Errorf("%s's acquire should be refused naming %s: %s", b.Name, a.Name, r)
	}
	fmt.Fprintf(w, "* %s: vco-agent fence acquire (exit %d): %s", b.Name, r.Exit, r.Stdout)
	out, err = b.MustSh(ctx, "vco-agent fence show "+dev[b.Name]+nodes+" 2>&1")
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "* %s: vco-agent fence show:\n%s", b.Name, indent(out))
	out, err = a.MustSh(ctx, "vco-agent fence release "+dev[a.Name]+nodes+" 2>&1")
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "* %s: vco-agent fence release: %s", a.Name, out)
	return nil
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "    " + l
	}
	return strings.Join(lines, "\n") + "\n"
}
