package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// simInfo is sim.json in the lab directory: how to reach a simulator that
// `vco-lab up -sim` left running.
type simInfo struct {
	APIURL    string           `json:"api_url"`
	AdminURL  string           `json:"admin_url"`
	Customer  string           `json:"customer"`
	TokenFile string           `json:"token_file"`
	Location  string           `json:"location"`
	VMs       map[string]int64 `json:"vms"`
	PID       int              `json:"pid"`
}

func simInfoPath(dir string) string { return filepath.Join(dir, "sim.json") }

// upSim starts `vco-lab sim-serve` in a session of its own and waits until
// it has written sim.json (or died).
func upSim(c *common, guests int, kind string) int {
	b, code := startDetached(c, "the simulator", simInfoPath(c.dir), "sim-serve.log", 10*time.Minute,
		"sim-serve", "-dir", c.dir, "-bin", c.bin, "-guests", strconv.Itoa(guests), "-kind", kind)
	if code != 0 {
		return code
	}
	var si simInfo
	if err := json.Unmarshal(b, &si); err != nil {
		return fail("%s: %v", simInfoPath(c.dir), err)
	}
	printSimInfo(c.dir, &si)
	fmt.Println("run 'vco-lab exec NODE -- CMD' in a guest, e.g. 'vco-lab exec node-a -- /bin/vco-agent events',")
	fmt.Println("or 'vco-lab exec node-a -- /bin/vco-lab csi-call NodeGetInfo {}'; 'vco-lab down' stops it all")
	return 0
}

// startDetached cleans up an earlier lab in c.dir, starts this binary
// with args in a session of its own (its output in c.dir/logName), and
// waits until it has written the JSON file info, which it returns; it
// fails when the process dies first or limit passes.
func startDetached(c *common, what, info, logName string, limit time.Duration, args ...string) ([]byte, int) {
	if _, err := lab.Down(c.dir); err != nil {
		return nil, fail("cleaning up an earlier lab in %s: %v", c.dir, err)
	}
	_ = os.Remove(info)
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return nil, fail("%v", err)
	}
	logPath := filepath.Join(c.dir, logName)
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fail("%v", err)
	}
	defer logf.Close()
	self, _ := os.Executable()
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fail("starting %s: %v", what, err)
	}
	fmt.Fprintf(os.Stderr, "vco-lab: starting %s (progress in %s)\n", what, logPath)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.After(limit)
	for {
		if b, err := os.ReadFile(info); err == nil && json.Valid(b) {
			return b, 0
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logPath)
			return nil, fail("%s exited while starting (%v):\n%s", what, err, lab.LastLines(string(b), 40))
		case <-deadline:
			return nil, fail("%s did not come up within %s; see %s", what, limit, logPath)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func printSimInfo(dir string, si *simInfo) {
	fmt.Printf("simulator (lab mode) in %s, pid %d\n  API   %s (customer %s, token in %s)\n  admin %s (PUT /admin/faults)\n",
		dir, si.PID, si.APIURL, si.Customer, si.TokenFile, si.AdminURL)
	for n, id := range si.VMs {
		fmt.Printf("  VM %d = guest %s (location %s)\n", id, n, si.Location)
	}
}

// simServe is the process `vco-lab up -sim` leaves running: the lab, the
// guests with their node stacks, and the simulator over HTTP, until it is
// told to stop (SIGTERM, or `vco-lab down`, which kills it by its pid file).
func simServe(args []string) int {
	var guests int
	var kind string
	c, _ := flags("sim-serve", args, func(fs *flag.FlagSet) {
		fs.IntVar(&guests, "guests", 2, "number of guests")
		fs.StringVar(&kind, "kind", string(lab.SCSIBlock), "scsi-block or virtio-blk")
	})
	cfg, err := simLabConfig(c, false)
	if err != nil {
		return fail("%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	env, err := simlab.Start(sctx, simlab.Options{Lab: cfg, Guests: nodeNames(guests), Kind: lab.DiskKind(kind), Log: os.Stdout})
	cancel()
	if err != nil {
		return fail("%v", err)
	}
	defer env.Close()
	// The guests' exec channel takes one client at a time: leave it to
	// `vco-lab exec`. Hot-plug needs only QMP, which this process keeps.
	for _, g := range env.Lab.Guests {
		g.Exec().Close()
	}
	if err := writeSelfPID(lab.PIDDir(c.dir), "vco-lab-sim"); err != nil {
		return fail("%v", err)
	}
	si := simInfo{APIURL: env.APIURL, AdminURL: strings.TrimSuffix(env.APIURL, "/api/1") + "/admin", Customer: simlab.Customer,
		TokenFile: env.TokenFile, Location: simlab.Location, VMs: env.VMs, PID: os.Getpid()}
	b, _ := json.MarshalIndent(si, "", "  ")
	if err := os.WriteFile(simInfoPath(c.dir), b, 0o644); err != nil {
		return fail("%v", err)
	}
	<-ctx.Done()
	_ = os.Remove(simInfoPath(c.dir))
	return 0
}

// writeSelfPID records this process in the lab's pid directory in the
// lab's format (pid, start time, path), so `vco-lab down` stops it too.
func writeSelfPID(pidDir, name string) error {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return err
	}
	// Fields after the command name (which may hold spaces) start at ")".
	rest := string(b[strings.LastIndexByte(string(b), ')')+2:])
	f := strings.Fields(rest)
	if len(f) < 20 {
		return fmt.Errorf("/proc/self/stat: %q", b)
	}
	self, _ := os.Executable()
	if err := os.MkdirAll(pidDir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(pidDir, name+".pid"), fmt.Appendf(nil, "%d %s %s\n", os.Getpid(), f[19], self), 0o644)
}
