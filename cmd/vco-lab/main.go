// Command vco-lab runs the multi-node lab: QEMU guests sharing iSCSI disks
// with real SCSI-3 reservations, and the scenarios that use them.
//
// The same binary is the exec server inside the guests ("guest-exec").
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
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// version is set at link time by the Makefile.
var version = "dev"

func usage() {
	fmt.Fprint(os.Stderr, `usage: vco-lab <command> [flags]

commands:
  prepare                  fetch and unpack the guest kernel into the cache
  up [-guests N]           start tgtd and N guests sharing one LUN; leave them running
  up -sim [-kind K]        start the simulator in lab mode, tgtd and N guests running
                           vco-agent and the vco-csi node plugin; leave them running
  status                   show the running lab
  exec NODE -- CMD...      run a command in a guest; prints its output, exits with its code
  down                     kill everything a lab (or a crashed run) left running
  run [-kind K[,K]] [-skip E4,E7,E8,E9] [-report DIR] [-transit vault|fake|none|URL]
                           the RWO story (make lab): simulator in lab mode, tgtd,
                           two guests with vco-agent and vco-csi; CSI calls in
                           Kubernetes' order; report per safety property; writes
                           DIR/lab-report-KIND.txt and .html per disk kind
                           (default: bin/ or .). Given several kinds, the story
                           runs once per kind in a lab of its own; E6, E7 and E9
                           do not depend on the kind and run in the first only.
                           E6 (encrypted volume) wraps with the Vault server
                           built from source (-transit vault, the default;
                           built first unless cached), a FAKE engine (fake),
                           or a Vault/OpenBao on 127.0.0.1 (URL, with
                           -transit-token-file)
  smoke                    the reservation smoke scenario on one shared LUN
  sim [-listen A] [-dir D] [-backend host|bookkeeping] ...
                           the whitesky.cloud API simulator alone on 127.0.0.1
                           (no lab, no guests), until SIGTERM; -h lists its flags
  csi-call METHOD JSON     (inside a guest) one CSI node call to the local plugin
  bench [-attach-rounds N] [-attach-only]
                           guest boot and lab set-up time, PR latency, and
                           attach-to-staged latency per disk kind, each against
                           a reference (make bench-lab)
  k8s up|status|down|run   a Kubernetes cluster built from source: control plane on
                           127.0.0.1, workers as guests with the vco-agent package,
                           the add-on applied (make k8s-lab runs the scenarios)
  vault prefetch           build the Vault server from its sources into the cache
  capi prefetch            build Cluster API's core manager from its sources into
                           the cache (K14, the ClusterResourceSet scenario)
  guest-exec               (inside a guest) serve the exec channel
  version                  print the version

Flags common to up, status, exec, down, run, bench:
  -dir DIR    lab directory (default $VCO_LAB_DIR or /var/tmp/vco-lab; run and
              bench make a fresh one under /var/tmp unless told)
  -bin DIR    directory with static vco-lab and vco-agent (default: this binary's)
`)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	var code int
	switch cmd {
	case "version":
		fmt.Println(version)
	case "guest-exec":
		code = guestExec()
	case "prepare":
		code = prepare(args)
	case "up":
		code = up(args)
	case "status":
		code = status(args)
	case "exec":
		code = execCmd(args)
	case "down":
		code = down(args)
	case "run":
		code = run(args)
	case "smoke":
		code = smoke(args)
	case "sim":
		code = runSim(args)
	case "sim-serve":
		code = simServe(args)
	case "csi-call":
		code = csiCall(args)
	case "bench":
		code = bench(args)
	case "k8s":
		code = k8sCmd(args)
	case "vault":
		code = vaultCmd(args)
	case "capi":
		code = capiCmd(args)
	case "-h", "--help", "help":
		usage()
	default:
		fmt.Fprintf(os.Stderr, "vco-lab: unknown command %q\n\n", cmd)
		usage()
		code = 2
	}
	os.Exit(code)
}

type common struct {
	dir, bin string
	// scratch is set when run or bench made a directory of their own; it
	// is removed after a successful run and kept (for its logs) otherwise.
	scratch bool
}

func flags(name string, args []string, extra func(*flag.FlagSet)) (*common, []string) {
	fs := flag.NewFlagSet("vco-lab "+name, flag.ExitOnError)
	c := &common{}
	def := os.Getenv("VCO_LAB_DIR")
	if def == "" {
		def = "/var/tmp/vco-lab"
	}
	fs.StringVar(&c.dir, "dir", def, "lab directory")
	self, _ := os.Executable()
	fs.StringVar(&c.bin, "bin", filepath.Dir(self), "directory with static vco-lab and vco-agent binaries")
	if extra != nil {
		extra(fs)
	}
	_ = fs.Parse(args)
	return c, fs.Args()
}

// oneShotFlags are the flags of run and bench. Without -dir they work in a
// fresh directory, so that they never touch a lab someone keeps up (or
// another run) in the shared default directory.
func oneShotFlags(name string, args []string, extra func(*flag.FlagSet)) (*common, error) {
	explicit := false
	for _, a := range args {
		if a == "-dir" || a == "--dir" || strings.HasPrefix(a, "-dir=") || strings.HasPrefix(a, "--dir=") {
			explicit = true
		}
	}
	c, _ := flags(name, args, extra)
	if explicit || os.Getenv("VCO_LAB_DIR") != "" {
		return c, nil
	}
	d, err := os.MkdirTemp("/var/tmp", "vco-lab-"+name+"-")
	if err != nil {
		return nil, err
	}
	c.dir, c.scratch = d, true
	return c, nil
}

// finish removes a scratch directory after success, or says where its
// logs are.
func (c *common) finish(code int) int {
	if !c.scratch {
		return code
	}
	if code == 0 {
		_ = os.RemoveAll(c.dir)
	} else {
		fmt.Fprintf(os.Stderr, "vco-lab: logs are in %s\n", c.dir)
	}
	return code
}

func fail(format string, a ...any) int {
	fmt.Fprintf(os.Stderr, "vco-lab: "+format+"\n", a...)
	return 1
}

// guestExec serves the exec channel in a guest. Started as PID 1 (the
// initramfs's init execs it), it first becomes a plain init: it runs the
// server as its child and reaps every orphan the guest's commands leave,
// which the server itself, busy with its own children through os/exec,
// must not do.
func guestExec() int {
	if os.Getpid() == 1 {
		return guestInit()
	}
	ctx := context.Background()
	var port string
	for i := 0; ; i++ {
		p, err := guestexec.FindPort(guestexec.PortName)
		if err == nil {
			port = p
			break
		}
		if i == 100 {
			fmt.Fprintln(os.Stderr, "vco-lab guest-exec:", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Wait for devtmpfs to create the node.
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(port); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Fprintf(os.Stderr, "vco-lab guest-exec: serving on %s\n", port)
	return exitErr(guestexec.NewServer().ServePort(ctx, port))
}

// guestInit runs the exec server as its child, restarting it if it dies,
// and reaps all other children.
func guestInit() int {
	start := func() (int, error) {
		cmd := exec.Command("/proc/self/exe", "guest-exec")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			return 0, err
		}
		return cmd.Process.Pid, nil
	}
	server, err := start()
	if err != nil {
		return exitErr(err)
	}
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if err != nil {
			if err == syscall.EINTR {
				continue
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if pid == server {
			fmt.Fprintf(os.Stderr, "vco-lab guest-exec: server exited (%v); restarting it\n", ws)
			time.Sleep(time.Second)
			if server, err = start(); err != nil {
				return exitErr(err)
			}
		}
	}
}

func exitErr(err error) int {
	if err != nil {
		fmt.Fprintln(os.Stderr, "vco-lab:", err)
		return 1
	}
	return 0
}

func prepare(args []string) int {
	fs := flag.NewFlagSet("vco-lab prepare", flag.ExitOnError)
	cache := fs.String("cache", lab.DefaultCacheDir(), "cache directory for the guest kernel")
	_ = fs.Parse(args)
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	k, err := lab.EnsureKernel(ctx, *cache)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Printf("guest kernel %s in %s\n", k.Version, k.Root)
	return 0
}

// labConfig is the lab configuration for binaries found in bin.
func labConfig(c *common, detached bool) (lab.Config, error) {
	self := filepath.Join(c.bin, "vco-lab")
	if _, err := os.Stat(self); err != nil {
		return lab.Config{}, fmt.Errorf("no vco-lab binary in %s (run 'make build' or pass -bin): %w", c.bin, err)
	}
	bins := map[string]string{"/bin/vco-lab": self}
	if agent := filepath.Join(c.bin, "vco-agent"); fileExists(agent) {
		bins["/bin/vco-agent"] = agent
	} else {
		fmt.Fprintf(os.Stderr, "vco-lab: no vco-agent in %s; guests will not have it\n", c.bin)
	}
	return lab.Config{
		Dir: c.dir, Binaries: bins, ExecServer: []string{"/bin/vco-lab", "guest-exec"}, Detached: detached,
	}, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func nodeNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("node-%c", 'a'+i)
	}
	return names
}

// startShared brings up a lab with one shared LUN attached to every guest
// as scsi-block.
func startShared(ctx context.Context, cfg lab.Config, guests int) (*lab.Lab, *lab.LUN, error) {
	l, err := lab.New(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	lun, err := l.AddLUN(ctx, "shared0", 256<<20)
	if err != nil {
		l.Close()
		return nil, nil, err
	}
	var gcs []lab.GuestConfig
	for _, n := range nodeNames(guests) {
		gcs = append(gcs, lab.GuestConfig{Name: n, Disks: []lab.Disk{{ID: "shared0", Kind: lab.SCSIBlock, LUN: lun}}})
	}
	if _, err := l.StartGuests(ctx, gcs...); err != nil {
		l.Close()
		return nil, nil, err
	}
	return l, lun, nil
}

func up(args []string) int {
	var guests int
	var withSim bool
	var kind string
	c, _ := flags("up", args, func(fs *flag.FlagSet) {
		fs.IntVar(&guests, "guests", 2, "number of guests")
		fs.BoolVar(&withSim, "sim", false, "run the whitesky.cloud simulator in lab mode with the agent and node plugin in every guest")
		fs.StringVar(&kind, "kind", string(lab.SCSIBlock), "with -sim: how disks are shown, scsi-block or virtio-blk")
	})
	if withSim {
		return upSim(c, guests, kind)
	}
	cfg, err := labConfig(c, true)
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	l, lun, err := startShared(ctx, cfg, guests)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Printf("lab up in %s (set-up %s): tgtd on %s (control port %d), LUN %s (%s)\n",
		c.dir, l.SetupTime().Round(time.Millisecond), l.Target.Portal(), l.Target.CtlPort, lun.IQN, lun.File)
	for _, g := range l.Guests {
		fmt.Printf("  %s  uuid %s  initiator %s  boot %s  pid %d\n", g.Name, g.UUID, g.Initiator, g.BootTime.Round(time.Millisecond), g.Proc.PID)
	}
	fmt.Println("run 'vco-lab exec NODE -- CMD' to use it and 'vco-lab down' to stop it")
	return 0
}

func status(args []string) int {
	c, _ := flags("status", args, nil)
	s, err := lab.ReadState(c.dir)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Printf("lab in %s: tgtd pid %d on %s (control port %d)\n", c.dir, s.TargetPID, s.Portal, s.TargetCtlPort)
	if b, err := os.ReadFile(simInfoPath(c.dir)); err == nil {
		var si simInfo
		if json.Unmarshal(b, &si) == nil {
			printSimInfo(c.dir, &si)
		}
	}
	for _, l := range s.LUNs {
		fmt.Printf("  LUN %s  serial %s  file %s\n", l.IQN, l.Serial, l.File)
	}
	code := 0
	for _, g := range s.Guests {
		state := "running"
		if !lab.Alive(g.PID, g.StartTime) {
			state, code = "GONE", 1
		}
		fmt.Printf("  %s  %s  pid %d  uuid %s  initiator %s  console %s\n", g.Name, state, g.PID, g.UUID, g.Initiator, g.Console)
	}
	return code
}

func execCmd(args []string) int {
	var timeout time.Duration
	c, rest := flags("exec", args, func(fs *flag.FlagSet) {
		fs.DurationVar(&timeout, "timeout", 5*time.Minute, "kill the command after this long")
	})
	if len(rest) >= 2 && rest[1] == "--" {
		rest = append(rest[:1], rest[2:]...)
	}
	if len(rest) < 2 {
		return fail("usage: vco-lab exec NODE -- CMD [ARGS...]")
	}
	node, argv := rest[0], rest[1:]
	s, err := lab.ReadState(c.dir)
	if err != nil {
		return fail("%v", err)
	}
	var sock string
	var names []string
	for _, g := range s.Guests {
		names = append(names, g.Name)
		if g.Name == node {
			sock = g.ExecSocket
		}
	}
	if sock == "" {
		return fail("no guest %q in the lab in %s; guests: %s", node, c.dir, strings.Join(names, ", "))
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout+30*time.Second)
	defer cancel()
	dctx, dcancel := context.WithTimeout(ctx, 30*time.Second)
	cl, err := guestexec.Dial(dctx, sock)
	dcancel()
	if err != nil {
		return fail("%v", err)
	}
	defer cl.Close()
	r, err := cl.Run(ctx, timeout, argv...)
	if err != nil {
		return fail("%v", err)
	}
	os.Stdout.WriteString(r.Stdout)
	os.Stderr.WriteString(r.Stderr)
	if r.TimedOut {
		fmt.Fprintf(os.Stderr, "vco-lab: command killed after %s\n", timeout)
	}
	if r.Exit < 0 {
		return 125
	}
	return r.Exit
}

func down(args []string) int {
	c, _ := flags("down", args, nil)
	killed, err := lab.DownRun(c.dir)
	for _, k := range killed {
		fmt.Println("killed", k)
	}
	if err != nil {
		return fail("%v", err)
	}
	if len(killed) == 0 {
		fmt.Println("nothing was running in", c.dir)
	}
	return 0
}

func run(args []string) int {
	var kind, report, transitSpec, transitTokenFile string
	var skipList string
	c, err := oneShotFlags("run", args, func(fs *flag.FlagSet) {
		fs.StringVar(&transitSpec, "transit", "vault", "transit engine for E6: vault (the Vault server built from source, started on 127.0.0.1 with TLS; built first unless cached), fake (a FAKE engine standing in for Vault/OpenBao, started on 127.0.0.1), none (leave E6 out), or http://127.0.0.1:PORT of a real Vault/OpenBao with transit key "+transitKey)
		fs.StringVar(&transitTokenFile, "transit-token-file", "", "with -transit URL: file holding a Vault/OpenBao token for that key")
		fs.StringVar(&kind, "kind", string(lab.SCSIBlock), "how disks are shown to the guests, comma-separated for one run each: scsi-block (SCSI-3 PR), virtio-blk (the on-disk lease)")
		fs.StringVar(&skipList, "skip", "", "comma-separated scenarios to leave out, of: "+optionalScenarios())
		fs.StringVar(&report, "report", "", "directory for lab-report-KIND.txt and lab-report-KIND.html (default: the -bin directory)")
	})
	if err != nil {
		return fail("%v", err)
	}
	if report == "" {
		report = c.bin
	}
	skip, err := skipSet(skipList)
	if err != nil {
		return c.finish(fail("-skip: %v", err))
	}
	var kinds []lab.DiskKind
	for _, k := range strings.Split(kind, ",") {
		switch k := lab.DiskKind(strings.TrimSpace(k)); k {
		case lab.SCSIBlock, lab.VirtioBlk:
			kinds = append(kinds, k)
		default:
			return fail("-kind %q: want scsi-block, virtio-blk, or both comma-separated", k)
		}
	}
	te, err := startTransit(transitSpec, transitTokenFile)
	if err != nil {
		return c.finish(fail("%v", err))
	}
	if te != nil {
		defer te.stop()
	}
	return c.finish(runStories(c, kinds, skip, report, te))
}

func smoke(args []string) int {
	c, err := oneShotFlags("smoke", args, nil)
	if err != nil {
		return fail("%v", err)
	}
	return c.finish(runIn(c))
}

func runIn(c *common) int {
	cfg, err := labConfig(c, false)
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	l, lun, err := startShared(ctx, cfg, 2)
	if err != nil {
		return fail("%v", err)
	}
	setup := l.SetupTime()
	defer func() {
		if err := l.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "vco-lab: teardown:", err)
		}
	}()
	serr := lab.Smoke(ctx, l, lun, os.Stdout)
	if serr == nil {
		serr = fenceDemo(ctx, l, lun, os.Stdout)
	}
	fmt.Println()
	var boot time.Duration
	for _, g := range l.Guests {
		boot = max(boot, g.BootTime)
		fmt.Printf("guest boot (%s)      %8.2fs\n", g.Name, g.BootTime.Seconds())
	}
	fmt.Printf("lab set-up (2 guests)    %8.2fs\n", setup.Seconds())
	if serr != nil {
		return fail("lab scenario failed: %v", serr)
	}
	return 0
}
