package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// prRounds is how many acquire/release sequences one timing runs; the
// sequence is timed from the host as one exec call, so the channel's
// round trip is spread over all rounds.
const prRounds = 20

// sgPersistSequence is docs/fencing.md's acquire and release done with
// sg_persist: read keys and reservation, register and ignore existing
// key, reserve Write Exclusive, re-read; then release and unregister.
const sgPersistSequence = `dev=$1; n=$2; k=0x5643000000b0b0b0
i=0
while [ $i -lt $n ]; do
	sg_persist -n -i -k $dev >/dev/null && sg_persist -n -i -r $dev >/dev/null &&
	sg_persist -n -o -I -S $k $dev >/dev/null && sg_persist -n -o -R -T 1 -K $k $dev >/dev/null &&
	sg_persist -n -i -r $dev >/dev/null &&
	sg_persist -n -o -L -T 1 -K $k $dev >/dev/null && sg_persist -n -o -G -K $k -S 0 $dev >/dev/null || exit 1
	i=$((i+1))
done`

// agentSequence is the same acquire and release through the project's
// engine, `vco-agent fence`.
const agentSequence = `dev=$1; n=$2
i=0
while [ $i -lt $n ]; do
	/bin/vco-agent fence acquire $dev >/dev/null && /bin/vco-agent fence release $dev >/dev/null || exit 1
	i=$((i+1))
done`

type benchRow struct {
	name  string
	value string
	ratio string
}

// bench prints the lab's timings as ratios against a reference: a guest
// booting alone is the reference for boot and set-up times; sg_persist is
// the reference for reservation latency; the same hot-plug followed by
// mkfs and mount by hand is the reference for attach-to-staged latency.
func bench(args []string) int {
	var rounds int
	var attachOnly bool
	c, err := oneShotFlags("bench", args, func(fs *flag.FlagSet) {
		fs.IntVar(&rounds, "attach-rounds", 5, "volumes staged per disk kind on each side of the attach-to-staged comparison (0: leave it out)")
		fs.BoolVar(&attachOnly, "attach-only", false, "only the attach-to-staged comparison")
	})
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	var rows []benchRow
	if !attachOnly {
		rows, err = labRows(ctx, c)
	}
	if err == nil && rounds > 0 {
		var more []benchRow
		more, err = attachBench(ctx, c, rounds)
		rows = append(rows, more...)
	}
	if err != nil {
		return c.finish(fail("%v", err))
	}
	printRows(rows)
	return c.finish(0)
}

// printRows prints rows as the table cmd/vco-bench reads: names, then two
// or more spaces.
func printRows(rows []benchRow) {
	w := len("benchmark")
	for _, r := range rows {
		w = max(w, len(r.name))
	}
	fmt.Printf("%-*s  %10s %8s\n", w, "benchmark", "value", "ratio")
	for _, r := range rows {
		fmt.Printf("%-*s  %10s %8s\n", w, r.name, r.value, r.ratio)
	}
}

// labRows times guest boots, lab set-up and reservation commands.
func labRows(ctx context.Context, c *common) ([]benchRow, error) {
	cfg, err := labConfig(c, false)
	if err != nil {
		return nil, err
	}

	l1, _, err := startShared(ctx, cfg, 1)
	if err != nil {
		return nil, err
	}
	alone, setup1 := l1.Guests[0].BootTime, l1.SetupTime()
	if err := l1.Close(); err != nil {
		return nil, fmt.Errorf("teardown: %w", err)
	}

	l2, lun, err := startShared(ctx, cfg, 2)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := l2.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "vco-lab: teardown:", err)
		}
	}()
	setup2 := l2.SetupTime()
	rows := []benchRow{
		{"guest boot, alone (reference)", secs(alone), "1.00x"},
		{"lab set-up, 1 guest", secs(setup1), ratio(setup1, alone)},
	}
	for _, g := range l2.Guests {
		rows = append(rows, benchRow{"guest boot, 2 in parallel (" + g.Name + ")", secs(g.BootTime), ratio(g.BootTime, alone)})
	}
	rows = append(rows, benchRow{"lab set-up, 2 guests", secs(setup2), ratio(setup2, alone)})

	g := l2.Guests[0]
	d, err := g.DiskBySerial(ctx, lun.Serial)
	if err != nil {
		return nil, err
	}
	pr, err := prRows(ctx, g, "/dev/"+d.Name)
	return append(rows, pr...), err
}

// prRows times a reservation's acquire and release on dev in g, with
// sg_persist (the reference) and with the guest's vco-agent fence when it
// has that command.
func prRows(ctx context.Context, g *lab.Guest, dev string) ([]benchRow, error) {
	sg, err := timeSequence(ctx, g, sgPersistSequence, dev, "sg_persist")
	if err != nil {
		return nil, err
	}
	rows := []benchRow{{"PR acquire+release, sg_persist (reference)", ms(sg), "1.00x"}}
	probe, err := g.Sh(ctx, "/bin/vco-agent fence --help 2>&1")
	if err != nil {
		return nil, err
	}
	if !strings.Contains(probe.Stdout, "usage: vco-agent fence") {
		return append(rows, benchRow{"PR acquire+release, vco-agent fence", "n/a", "(no fence command in this vco-agent)"}), nil
	}
	engine, err := timeSequence(ctx, g, agentSequence, dev, "vco-agent fence")
	if err != nil {
		return nil, err
	}
	return append(rows, benchRow{"PR acquire+release, vco-agent fence", ms(engine), ratio(engine, sg)}), nil
}

// timeSequence runs the shell script seq on dev prRounds times in g and
// returns the time of one round.
func timeSequence(ctx context.Context, g *lab.Guest, seq, dev, what string) (time.Duration, error) {
	start := time.Now()
	r, err := g.Exec().Run(ctx, 0, "/bin/sh", "-c", seq, "bench", dev, fmt.Sprint(prRounds))
	if err != nil {
		return 0, err
	}
	if r.Exit != 0 {
		return 0, fmt.Errorf("%s sequence failed in %s: %s", what, g.Name, r)
	}
	return time.Since(start) / prRounds, nil
}

func ratio(d, ref time.Duration) string { return fmt.Sprintf("%.2fx", d.Seconds()/ref.Seconds()) }

func secs(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }
func ms(d time.Duration) string   { return fmt.Sprintf("%.1fms", float64(d.Microseconds())/1000) }
