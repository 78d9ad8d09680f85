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
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/capi"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/k8s/story"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

const k8sUsage = `usage: vco-lab k8s <up|status|down|run|bench|e2e|prefetch> [flags]

  up      build what is not cached, start a cluster (control plane on
          127.0.0.1, workers as QEMU guests) with the add-on applied, and
          leave it running; prints the kubeconfig path
  status  the cluster's nodes and the add-on's pods
  down    stop the cluster and everything of the lab
  prefetch
          build what a cluster needs and caches (Kubernetes, the images, the
          worker root) without starting one: make test starts it in the
          background at its beginning; the tier waits for its locks
  run [-scenarios K1,K2,K4] [-report DIR]
          a cluster of its own, the scenarios, a report per safety
          property (DIR/k8s-report.txt and .html); nothing is left running.
          K14 (the add-on through a ClusterResourceSet) runs alone:
          -scenarios K14 (make soak-k8s-crs)
  bench [-rounds 1]
          the times a user sees (a claim to its first pod Running, a pod
          moved, a drain, K10's partition failover) on a cluster of its
          own, fenced and with the fence off (the agents' fence_methods
          [none] and the unfenced opt-in: the reference), side by side;
          a table of ratios on stdout
  e2e [-focus REGEXP] [-skip REGEXP] [-class NAME] [-suite-timeout 6h] [-report DIR]
          Kubernetes' external storage suite (e2e.test, External.Storage)
          against deploy/testdriver.yaml on a cluster of its own with the
          snapshot CRDs installed: -focus narrows the patterns, e.g.
          'Dynamic PV \(ext4\)'; the summary (passed, failed, skipped with
          the suite's reasons) in DIR/k8s-e2e-summary.txt and on stdout,
          the JUnit report and e2e.test's log beside it
flags: -dir DIR (default $VCO_LAB_DIR or /var/tmp/vco-lab), -bin DIR, -kind scsi-block|virtio-blk|virtio-blk-file,
  -cloud-init=false (the workers' agent enabled by the package, not its cloud-init seed)
`

// k8sInfo is k8s.json in the lab directory: how to reach a cluster that
// `vco-lab k8s up` left running.
type k8sInfo struct {
	Kubeconfig string `json:"kubeconfig"`
	Kubectl    string `json:"kubectl"`
	PID        int    `json:"pid"`
}

func k8sInfoPath(dir string) string { return filepath.Join(dir, "k8s.json") }

func k8sCmd(args []string) int {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, k8sUsage)
		return 2
	}
	var kind, scenarios, report, focus, skip, class string
	var suiteTimeout time.Duration
	var rounds int
	extra := func(fs *flag.FlagSet) {
		fs.StringVar(&kind, "kind", string(lab.SCSIBlock), "disk kind: scsi-block, virtio-blk (over iSCSI) or virtio-blk-file (over a file: grows online)")
		fs.BoolVar(&k8sCloudInit, "cloud-init", true, "enable the workers' vco-agent with the package's cloud-init seed (false: the package's own enablement; boots faster)")
		fs.StringVar(&k8sAddon, "addon", k8s.AddonRelease, "how the add-on's core bundle is applied: release (deploy/csi.yaml through envsubst) or make (make csi-addon | kubectl apply -f -)")
		fs.StringVar(&scenarios, "scenarios", strings.Join(story.Scenarios, ","), "comma-separated scenarios to run, of: "+scenarioList(story.All))
		fs.StringVar(&report, "report", "", "report directory (default: -bin)")
		fs.StringVar(&focus, "focus", "", "e2e: Ginkgo focus within External.Storage (a regular expression)")
		fs.StringVar(&skip, "skip", "", "e2e: Ginkgo skip expression")
		fs.StringVar(&class, "class", "", "e2e: the StorageClass the suite provisions from (default: the driver file's, vco-csi)")
		fs.DurationVar(&suiteTimeout, "suite-timeout", 6*time.Hour, "e2e: Ginkgo's timeout for the suite; it then reports what ran")
		fs.IntVar(&rounds, "rounds", 1, "bench: rounds of every measure in each mode")
	}
	switch args[0] {
	case "up":
		c, _ := flags("k8s up", args[1:], extra)
		return k8sUp(c, kind)
	case "serve":
		c, _ := flags("k8s serve", args[1:], extra)
		return k8sServe(c, kind)
	case "status":
		c, _ := flags("k8s status", args[1:], extra)
		return k8sStatus(c)
	case "prefetch":
		return k8sPrefetch()
	case "down":
		c, _ := flags("k8s down", args[1:], extra)
		return k8sDown(c)
	case "run":
		c, err := oneShotFlags("k8s-run", args[1:], extra)
		if err != nil {
			return fail("%v", err)
		}
		if report == "" {
			report = c.bin
		}
		return c.finish(k8sRun(c, kind, strings.Split(scenarios, ","), report))
	case "bench":
		c, err := oneShotFlags("k8s-bench", args[1:], extra)
		if err != nil {
			return fail("%v", err)
		}
		return c.finish(k8sBench(c, kind, rounds))
	case "e2e":
		c, err := oneShotFlags("k8s-e2e", args[1:], extra)
		if err != nil {
			return fail("%v", err)
		}
		if report == "" {
			report = filepath.Join(c.bin, "k8s-e2e-"+kind)
		}
		return c.finish(k8sE2E(c, kind, k8s.SuiteOptions{Focus: focus, Skip: skip, Class: class, ReportDir: report, Timeout: suiteTimeout}))
	}
	fmt.Fprint(os.Stderr, k8sUsage)
	return 2
}

func k8sOptions(c *common, kind string, detached bool) (k8s.Options, error) {
	cfg, err := simLabConfig(c, detached)
	if err != nil {
		return k8s.Options{}, err
	}
	return k8s.Options{Lab: cfg, Kind: lab.DiskKind(kind), CloudInit: k8sCloudInit, Addon: k8sAddon, Log: os.Stderr}, nil
}

// k8sCloudInit is the -cloud-init flag of up, serve and run.
var k8sCloudInit = true

// k8sAddon is the -addon flag of up, serve and run: the full story
// applies the release's file; make test's brief story (TestStory) the
// make command.
var k8sAddon = k8s.AddonRelease

// k8sRun is `make k8s-lab`: a cluster, the story, the report; it fails
// unless every scenario passed and every property held.
func k8sRun(c *common, kind string, scenarios []string, report string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if slices.Contains(scenarios, "K14") {
		// Cluster API's manager, built (or cached) before anything boots.
		if _, err := capi.Build(ctx, lab.DefaultCacheDir(), os.Stderr); err != nil {
			return fail("%v", err)
		}
	}
	cl, err := upCluster(ctx, c, kind)
	if err != nil {
		return fail("%v", err)
	}
	defer cl.Close()
	r := story.Run(ctx, cl, scenarios, os.Stderr)
	if err := story.WriteReport(r, report); err != nil {
		return fail("%v", err)
	}
	r.WriteText(os.Stdout)
	if err := story.Judge(r); err != nil {
		return fail("%v", err)
	}
	return 0
}

// upCluster starts a cluster of its own on kind disks for a one-shot
// command.
func upCluster(ctx context.Context, c *common, kind string) (*k8s.Cluster, error) {
	o, err := k8sOptions(c, kind, false)
	if err != nil {
		return nil, err
	}
	return k8s.Up(ctx, o)
}

// k8sBench is `make bench-k8s`: a cluster, story.Bench, and its figures
// as the table cmd/vco-bench reads, each fenced figure against the same
// measure unfenced.
func k8sBench(c *common, kind string, rounds int) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if rounds < 1 {
		return fail("-rounds %d: at least 1", rounds)
	}
	cl, err := upCluster(ctx, c, kind)
	if err != nil {
		return fail("%v", err)
	}
	defer cl.Close()
	figs, err := story.Bench(ctx, cl, rounds, os.Stderr)
	if err != nil {
		return fail("%v", cl.WithLogs(err))
	}
	printRows(benchK8sRows(figs, kind))
	return 0
}

// benchK8sRows are figs as rows: each measure unfenced (the reference),
// then fenced with its ratio.
func benchK8sRows(figs []story.BenchFigure, kind string) []benchRow {
	var rows []benchRow
	for _, m := range story.BenchMeasures {
		var ref, fenced story.BenchFigure
		for _, f := range figs {
			switch {
			case f.Measure == m && f.Unfenced:
				ref = f
			case f.Measure == m:
				fenced = f
			}
		}
		name := fmt.Sprintf("k8s %s, %s, %d round(s)", m, kind, len(fenced.Times))
		rows = append(rows, benchRow{name + ", fence off (reference)", secs(ref.Mean()), "1.00x"},
			benchRow{name + ", fenced", secs(fenced.Mean()), ratio(fenced.Mean(), ref.Mean())})
	}
	return rows
}

// k8sE2E is `make k8s-e2e`: e2e.test and the suite's images built (or
// cached) before anything boots, a cluster with the add-on and the
// snapshot CRDs, the external storage suite, its summary; it fails unless
// every spec that ran passed.
func k8sE2E(c *common, kind string, so k8s.SuiteOptions) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	bin, err := k8s.E2ETest(ctx, lab.DefaultCacheDir(), os.Stderr)
	if err != nil {
		return fail("%v", err)
	}
	o, err := k8sOptions(c, kind, false)
	if err != nil {
		return fail("%v", err)
	}
	o.E2EImages, o.ExternalAddresses = true, true
	cl, err := k8s.Up(ctx, o)
	if err != nil {
		return fail("%v", err)
	}
	defer cl.Close()
	for _, step := range []func(context.Context) (string, error){cl.InstallAddon, cl.InstallSnapshots} {
		out, err := step(ctx)
		if err != nil {
			return fail("%v", err)
		}
		fmt.Fprintf(os.Stderr, "k8s: %s\n", out)
	}
	so.E2ETest, so.Log, so.Label = bin, os.Stderr, ", "+kind+" disks"
	sum, err := k8s.RunStorageSuite(ctx, cl, so)
	if sum != nil {
		sum.Write(os.Stdout)
		fmt.Printf("summary: %s; %s in all\n", filepath.Join(so.ReportDir, "k8s-e2e-summary.txt"), time.Since(start).Round(time.Second))
	}
	if err != nil {
		return fail("%v", err)
	}
	return 0
}

// k8sUp starts `vco-lab k8s serve` in a session of its own and waits
// until it has written k8s.json (or died). The first run builds
// Kubernetes and the images: the wait is long.
func k8sUp(c *common, kind string) int {
	b, code := startDetached(c, "the cluster", k8sInfoPath(c.dir), "k8s-serve.log", 90*time.Minute,
		"k8s", "serve", "-dir", c.dir, "-bin", c.bin, "-kind", kind, fmt.Sprintf("-cloud-init=%v", k8sCloudInit), "-addon", k8sAddon)
	if code != 0 {
		return code
	}
	var info k8sInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return fail("%s: %v", k8sInfoPath(c.dir), err)
	}
	fmt.Printf("cluster up; kubeconfig: %s\n  %s --kubeconfig %s get nodes\nstop it with: vco-lab k8s down -dir %s\n",
		info.Kubeconfig, info.Kubectl, info.Kubeconfig, c.dir)
	return 0
}

// k8sServe runs the cluster in this process until SIGTERM.
func k8sServe(c *common, kind string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o, err := k8sOptions(c, kind, true)
	if err != nil {
		return fail("%v", err)
	}
	cl, err := k8s.Up(ctx, o)
	if err != nil {
		return fail("%v", err)
	}
	defer cl.Close()
	out, err := cl.InstallAddon(ctx)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Fprintln(os.Stderr, out)
	b, _ := json.Marshal(k8sInfo{Kubeconfig: cl.Kubeconfig, Kubectl: cl.Bins.Kubectl, PID: os.Getpid()})
	if err := os.WriteFile(k8sInfoPath(c.dir), b, 0o644); err != nil {
		return fail("%v", err)
	}
	<-ctx.Done()
	_ = os.Remove(k8sInfoPath(c.dir))
	return 0
}

func readK8sInfo(dir string) (*k8sInfo, error) {
	b, err := os.ReadFile(k8sInfoPath(dir))
	if err != nil {
		return nil, fmt.Errorf("no cluster in %s (vco-lab k8s up starts one): %w", dir, err)
	}
	var info k8sInfo
	return &info, json.Unmarshal(b, &info)
}

func k8sStatus(c *common) int {
	info, err := readK8sInfo(c.dir)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Printf("kubeconfig: %s (server process %d)\n", info.Kubeconfig, info.PID)
	for _, a := range [][]string{{"get", "nodes", "-o", "wide"}, {"-n", k8s.AddonNamespace, "get", "pods", "-o", "wide"}} {
		cmd := exec.Command(info.Kubectl, append([]string{"--kubeconfig", info.Kubeconfig}, a...)...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return fail("kubectl %s: %v", strings.Join(a, " "), err)
		}
	}
	return 0
}

func k8sDown(c *common) int {
	if info, err := readK8sInfo(c.dir); err == nil && info.PID > 0 {
		if p, err := os.FindProcess(info.PID); err == nil {
			_ = p.Signal(syscall.SIGTERM)
			for i := 0; i < 100 && p.Signal(syscall.Signal(0)) == nil; i++ {
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
	killed, err := lab.Down(c.dir)
	if err != nil {
		return fail("%v", err)
	}
	_ = os.Remove(k8sInfoPath(c.dir))
	fmt.Printf("stopped %d processes\n", len(killed))
	return 0
}

// k8sPrefetch builds the caches of a cluster. Each cache is built under
// its own lock, so a cluster started meanwhile waits for it and then
// finds it complete.
func k8sPrefetch() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	if err := k8s.Prefetch(ctx, lab.DefaultCacheDir(), os.Stderr); err != nil {
		return fail("prefetch: %v", err)
	}
	fmt.Fprintf(os.Stderr, "vco-lab: the Kubernetes tier's caches are ready (%s)\n", time.Since(start).Round(time.Second))
	return 0
}
