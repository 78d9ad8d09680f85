package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
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
	_ = fs.Parse(args)
	if fs.NArg() != 2 {
		return fail("usage: vco-lab csi-call [-endpoint unix:///path] METHOD REQUEST-JSON")
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

// runStory is `vco-lab run` (make lab): the simulator in lab mode, tgtd,
// two guests with the agent and the node plugin, the RWO story, its text
// report on stdout and report.txt/report.html in the report directory.
func runStory(c *common, kind string, skip map[string]bool, reportDir string, te *transitEngine) int {
	cfg, err := simLabConfig(c, false)
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	so := simlab.Options{Lab: cfg, Kind: lab.DiskKind(kind), Log: os.Stdout}
	eo := e2e.Options{Progress: os.Stdout, Skip: skip}
	if te != nil {
		defer te.stop()
		simlab.ForEncryption(&so)
		eo.TransitPort, eo.TransitToken, eo.TransitEngine = te.port, te.token, te.description
		fmt.Printf("vco-lab: E6 wraps passphrases with the %s\n", te.description)
	}
	env, err := simlab.Start(ctx, so)
	if err != nil {
		return fail("starting the lab: %v", err)
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
	if err := writeReports(rep, reportDir); err != nil {
		fmt.Fprintln(os.Stderr, "vco-lab: writing the reports:", err)
		return 1
	}
	if !rep.AllHeld() {
		return 1
	}
	return 0
}

func writeReports(rep *e2e.Report, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	txt, err := os.Create(filepath.Join(dir, "lab-report.txt"))
	if err != nil {
		return err
	}
	rep.WriteText(txt)
	if err := txt.Close(); err != nil {
		return err
	}
	h, err := os.Create(filepath.Join(dir, "lab-report.html"))
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
