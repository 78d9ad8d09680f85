package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// csiCall runs in a guest: one CSI request to the local plugin, its reply
// (or gRPC status) printed as JSON. Exit 0 whenever the call was made.
func csiCall(args []string) int {
	fs := flag.NewFlagSet("vco-lab csi-call", flag.ExitOnError)
	endpoint := fs.String("endpoint", "unix://"+simlab.CSISocket, "the CSI plugin's endpoint")
	timeout := fs.Duration("timeout", 4*time.Minute, "give up on the call after this long")
	serve := fs.String("serve", "", "stay, connected to the plugin, and answer each request line written into DIR/in on DIR/out (simlab.StartCaller)")
	_ = fs.Parse(args)
	if *serve != "" && fs.NArg() == 0 {
		if err := simlab.ServeCalls(context.Background(), *endpoint, *serve); err != nil {
			return fail("%v", err)
		}
		return 0
	}
	if fs.NArg() != 2 {
		return fail("usage: vco-lab csi-call [-endpoint unix:///path] METHOD REQUEST-JSON | -serve DIR")
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	rep, err := simlab.CallLocal(ctx, *endpoint, fs.Arg(0), fs.Arg(1))
	if err != nil {
		return fail("%v", err)
	}
	b, _ := json.Marshal(rep)
	fmt.Println(string(b))
	return 0
}

// simLabConfig is labConfig with the CSI plugin in the guests, which the
// simulator-driven story needs.
func simLabConfig(c *common, detached bool) (lab.Config, error) {
	cfg, err := labConfig(c, detached)
	if err != nil {
		return cfg, err
	}
	for _, b := range []string{"vco-agent", "vco-csi"} {
		p := filepath.Join(c.bin, b)
		if !fileExists(p) {
			return cfg, fmt.Errorf("no %s in %s (run 'make build' or pass -bin)", b, c.bin)
		}
		cfg.Binaries["/bin/"+b] = p
	}
	return cfg, nil
}

// optionalScenarios lists the scenarios -skip may name, with their names.
func optionalScenarios() string {
	var scs []e2e.Scenario
	for _, id := range e2e.Optional {
		sc, _ := e2e.Lookup(e2e.Story, id)
		scs = append(scs, sc)
	}
	return scenarioList(scs)
}

// scenarioList is scs for a flag's help: each id with its name.
func scenarioList(scs []e2e.Scenario) string {
	l := make([]string, len(scs))
	for i, sc := range scs {
		l[i] = sc.String()
	}
	return strings.Join(l, "; ")
}

// skipSet is -skip's list as a set, refusing a scenario that is not one
// of the story's optional ones.
func skipSet(list string) (map[string]bool, error) {
	skip := map[string]bool{}
	for _, sc := range strings.Split(list, ",") {
		if sc = strings.ToUpper(strings.TrimSpace(sc)); sc == "" {
			continue
		}
		if !slices.Contains(e2e.Optional, sc) {
			return nil, fmt.Errorf("%s is not a scenario that can be left out (those are %s)", sc, strings.Join(e2e.Optional, ", "))
		}
		skip[sc] = true
	}
	return skip, nil
}

// runStories is `vco-lab run` (make lab): the story once per disk kind,
// each in a lab of its own, one verdict per kind at the end. It fails
// unless every property held on every kind.
func runStories(c *common, kinds []lab.DiskKind, skip map[string]bool, reportDir string, te *transitEngine) int {
	verdicts := make([]string, len(kinds))
	code := 0
	for i, k := range kinds {
		sk, why := skip, map[string]string{}
		if i > 0 {
			sk = map[string]bool{}
			for sc := range skip {
				sk[sc] = true
			}
			// The scenarios whose disks do not follow -kind would only
			// repeat themselves.
			for _, sc := range e2e.KindFree {
				if !skip[sc] {
					sk[sc], why[sc] = true, "because it does not depend on the disk kind; it ran in the "+string(kinds[0])+" report"
				}
			}
			te = nil
		}
		fmt.Printf("vco-lab: the RWO story on %s disks\n", k)
		held, err := runStory(c, k, sk, why, reportDir, te)
		switch {
		case err != nil:
			verdicts[i], code = fmt.Sprintf("%-11s did not finish: %v", k, err), 1
		case !held:
			verdicts[i], code = fmt.Sprintf("%-11s NOT every property was shown to hold", k), 1
		default:
			verdicts[i] = fmt.Sprintf("%-11s every property held", k)
		}
	}
	fmt.Println("\nverdict per disk kind:")
	for _, v := range verdicts {
		fmt.Println("  " + v)
	}
	return code
}

// runStory runs the story on disks of one kind: the simulator in lab
// mode, tgtd, two guests with the agent and the node plugin; its text
// report on stdout and lab-report-KIND.txt/.html in the report directory.
// It answers whether every property held; the error is for a lab that
// could not start or a report that could not be written.
func runStory(c *common, kind lab.DiskKind, skip map[string]bool, skipWhy map[string]string, reportDir string, te *transitEngine) (bool, error) {
	cfg, err := simLabConfig(c, false)
	if err != nil {
		return false, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	// A lab of its own per kind, under the run's directory.
	cfg.Dir = lab.KindDir(cfg.Dir, kind)
	so := simlab.Options{Lab: cfg, Kind: kind, Log: os.Stdout}
	eo := e2e.Options{Progress: os.Stdout, Skip: skip, SkipWhy: skipWhy}
	if te != nil {
		simlab.ForEncryption(&so)
		eo.TransitPort, eo.TransitToken, eo.TransitEngine, eo.TransitCA = te.port, te.token, te.description, te.ca
		fmt.Printf("vco-lab: E6 wraps passphrases with the %s\n", te.description)
	}
	env, err := simlab.Start(ctx, so)
	if err != nil {
		return false, fmt.Errorf("starting the lab: %w", err)
	}
	eo.Env = env
	rep := e2e.Run(ctx, eo)
	if err := env.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "vco-lab: teardown:", err)
	}
	rep.WriteText(os.Stdout)
	if reportDir == "" {
		reportDir = "."
	}
	if err := writeReports(rep, reportDir, "lab-report-"+string(kind)); err != nil {
		return false, fmt.Errorf("writing the reports: %w", err)
	}
	return rep.AllHeld(), nil
}

func writeReports(rep *e2e.Report, dir, base string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	txt, err := os.Create(filepath.Join(dir, base+".txt"))
	if err != nil {
		return err
	}
	rep.WriteText(txt)
	if err := txt.Close(); err != nil {
		return err
	}
	h, err := os.Create(filepath.Join(dir, base+".html"))
	if err != nil {
		return err
	}
	if err := rep.WriteHTML(h); err != nil {
		h.Close()
		return err
	}
	if err := h.Close(); err != nil {
		return err
	}
	fmt.Printf("reports: %s, %s\n", txt.Name(), h.Name())
	return nil
}
