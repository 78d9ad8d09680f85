package k8s

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s/images"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// StorageSuiteFocus selects the external storage patterns among e2e.test's
// specs ("External Storage [Driver: ...] [Testpattern: ...] ...").
const StorageSuiteFocus = `External.Storage`

// SuiteOptions shape one run of Kubernetes' external storage suite.
type SuiteOptions struct {
	// E2ETest is the e2e.test binary (E2ETest).
	E2ETest string
	// Focus narrows the patterns: a regular expression of Ginkgo's over
	// the spec's text after External.Storage, e.g. `Dynamic PV \(ext4\)`
	// or `provisioning|volumes`; empty runs them all.
	Focus string
	// Skip is Ginkgo's skip expression; empty skips nothing.
	Skip string
	// Class is the StorageClass the driver file names (default: the
	// file's, the default class vco-csi).
	Class string
	// ReportDir receives the rendered driver file, the registry list,
	// e2e.test's log, its JUnit report and the summary.
	ReportDir string
	// Timeout bounds the suite (Ginkgo's own timeout, after which it
	// reports what ran); default 6h.
	Timeout time.Duration
	// Label says what ran, for the summary's first line (disk kind ...).
	Label string
	// Log receives e2e.test's progress.
	Log io.Writer
}

// RunStorageSuite runs e2e.test's external storage patterns against the
// driver as deploy/testdriver.yaml describes it, on a cluster whose
// add-on is installed and whose registry serves the suite's images
// (Options.E2EImages); it returns the summary of its JUnit report, also
// written to ReportDir/k8s-e2e-summary.txt. A suite that fails still
// returns its summary, with an error.
func RunStorageSuite(ctx context.Context, c *Cluster, o SuiteOptions) (*SuiteSummary, error) {
	if o.Timeout == 0 {
		o.Timeout = 6 * time.Hour
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	// e2e.test runs in the report directory, so every path it is given
	// must hold from there: a relative -report dir (make k8s-e2e's
	// bin/k8s-e2e-KIND) made it panic reading KUBE_TEST_REPO_LIST.
	dir, err := filepath.Abs(o.ReportDir)
	if err != nil {
		return nil, err
	}
	o.ReportDir = dir
	if err := os.MkdirAll(o.ReportDir, 0o755); err != nil {
		return nil, err
	}
	driverFile, err := renderTestDriver(ctx, o.ReportDir, o.Class)
	if err != nil {
		return nil, err
	}
	repoList := filepath.Join(o.ReportDir, "repo-list.yaml")
	if err := os.WriteFile(repoList, []byte(images.RepoList(GuestRegistry)), 0o644); err != nil {
		return nil, err
	}
	junit := filepath.Join(o.ReportDir, "junit_01.xml")
	_ = os.Remove(junit)
	focus := StorageSuiteFocus
	if o.Focus != "" {
		focus += ".*(" + o.Focus + ")"
	}
	args := []string{"-kubeconfig", c.Kubeconfig, "-storage.testdriver", driverFile, "-report-dir", o.ReportDir,
		"-ginkgo.focus", focus, "-ginkgo.timeout", o.Timeout.String(), "-ginkgo.no-color",
		"-provider", "local"}
	labExpr, labReason := LabSkip(c.Opts.Kind)
	skip := joinSkips(o.Skip, labExpr)
	if skip != "" {
		args = append(args, "-ginkgo.skip", skip)
	}
	logPath := filepath.Join(o.ReportDir, "e2e.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.CommandContext(ctx, o.E2ETest, args...)
	cmd.Dir = o.ReportDir
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+repoList, "KUBECONFIG="+c.Kubeconfig, "PATH="+c.Bins.Dir+":"+os.Getenv("PATH"))
	if c.ssh != nil {
		// The disruptive patterns' way to a node's kubelet and mounts.
		cmd.Env = append(cmd.Env, c.ssh.Env()...)
	}
	// Interrupted (Ctrl-C, a stopped make), Ginkgo still runs its cleanup
	// and writes the report of what ran.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 5 * time.Minute
	cmd.Stdout = io.MultiWriter(logFile, o.Log)
	cmd.Stderr = cmd.Stdout
	fmt.Fprintf(o.Log, "k8s: e2e.test -ginkgo.focus %q -ginkgo.skip %q (log %s)\n", focus, skip, logPath)
	start := time.Now()
	runErr := cmd.Run()
	f, err := os.Open(junit)
	if err != nil {
		return nil, fmt.Errorf("e2e.test wrote no JUnit report (%v; exit: %v); its log: %s", err, runErr, logPath)
	}
	defer f.Close()
	s, err := ParseJUnit(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", junit, err)
	}
	s.Title = fmt.Sprintf("Kubernetes %s external storage suite, driver %s, class %s%s; -ginkgo.focus %q -ginkgo.skip %q; %s",
		Version, simlab.DriverName, classOr(o.Class), o.Label, focus, skip, time.Since(start).Round(time.Second))
	if labExpr != "" {
		s.LabSkip = labReason + " (-ginkgo.skip " + labExpr + ")"
	}
	var text strings.Builder
	s.Write(&text)
	if err := os.WriteFile(filepath.Join(o.ReportDir, "k8s-e2e-summary.txt"), []byte(text.String()), 0o644); err != nil {
		return s, err
	}
	if runErr != nil || len(s.Failed) > 0 {
		return s, fmt.Errorf("the storage suite failed: %d of %d specs run (exit: %v); log %s", len(s.Failed), len(s.Passed)+len(s.Failed), runErr, logPath)
	}
	return s, nil
}

// growsInUse selects the suite's specs that grow a claim while a pod uses
// it: the controller's resize reaches the platform while the disk is
// attached.
const growsInUse = `\(allowExpansion\)\] volume-expand should resize volume when PVC is edited (while pod is using it|and the pod is re-created on the same node after controller resize is finished)|\] ephemeral should support expansion of pvcs created for ephemeral pvcs`

// LabSkip is what the lab cannot run on disks of kind (a Ginkgo skip
// expression, empty for none) and why, for the summary. Only file-backed
// virtio-blk disks grow while attached here: tgtd fixes an iSCSI LUN's
// size while a guest is logged in to it, so the simulator in lab mode
// grows those disks only detached (simlab). The platform grows attached
// disks; the specs run with -kind virtio-blk-file.
func LabSkip(kind lab.DiskKind) (expr, reason string) {
	if kind == simlab.FileVirtioBlk {
		return "", ""
	}
	if kind == "" {
		kind = lab.SCSIBlock
	}
	return growsInUse, "not run on " + string(kind) + " disks, a limit of the lab and not of the driver: the lab's tgtd cannot grow an iSCSI disk a guest is logged in to, and these specs grow a claim a pod is using; they run with -kind " + string(simlab.FileVirtioBlk)
}

// joinSkips is a Ginkgo skip expression matching any of exprs' non-empty
// ones, each in parentheses when there are several.
func joinSkips(exprs ...string) string {
	var parts []string
	for _, e := range exprs {
		if e != "" {
			parts = append(parts, e)
		}
	}
	if len(parts) == 1 {
		return parts[0]
	}
	for i, e := range parts {
		parts[i] = "(" + e + ")"
	}
	return strings.Join(parts, "|")
}

func classOr(c string) string {
	if c == "" {
		return "vco-csi"
	}
	return c
}

// renderTestDriver writes deploy/testdriver.yaml rendered for the lab
// (the driver name as the add-on's) into dir, with class instead of the
// file's StorageClass when given.
func renderTestDriver(ctx context.Context, dir, class string) (string, error) {
	out, err := Envsubst(ctx, "deploy/testdriver.yaml")
	if err != nil {
		return "", err
	}
	if class != "" {
		re := regexp.MustCompile(`(?m)^(StorageClass:\n(?:\s*#.*\n)*\s*FromExistingClassName: ).*$`)
		if !re.MatchString(out) {
			return "", errors.New("deploy/testdriver.yaml: no StorageClass.FromExistingClassName to replace")
		}
		out = re.ReplaceAllString(out, "${1}"+class)
	}
	p := filepath.Join(dir, "testdriver.yaml")
	return p, os.WriteFile(p, []byte(out), 0o644)
}

// SuiteCase is one spec of the suite's report.
type SuiteCase struct {
	Name string
	// Reason is why it was skipped or how it failed, as the suite said.
	Reason string
	Time   time.Duration
}

// SuiteSummary is what a JUnit report of the suite says.
type SuiteSummary struct {
	Title                   string
	Passed, Failed, Skipped []SuiteCase
	// NotSelected counts the specs outside -ginkgo.focus or inside
	// -ginkgo.skip: e2e.test reports every spec it has.
	NotSelected int
	// LabSkip says which specs the lab left out on this disk kind and
	// why (LabSkip), empty when none.
	LabSkip string
}

type junitSuites struct {
	Suites []struct {
		Cases []struct {
			Name    string  `xml:"name,attr"`
			Status  string  `xml:"status,attr"`
			Time    float64 `xml:"time,attr"`
			Skipped *struct {
				Message string `xml:"message,attr"`
			} `xml:"skipped"`
			Failure *junitProblem `xml:"failure"`
			Error   *junitProblem `xml:"error"`
		} `xml:"testcase"`
	} `xml:"testsuite"`
}

type junitProblem struct {
	Message string `xml:"message,attr"`
	Type    string `xml:"type,attr"`
	Text    string `xml:",chardata"`
}

// suiteNode is a spec name of Ginkgo's suite-level nodes, which the
// report lists beside the specs.
var suiteNode = regexp.MustCompile(`^\[(Synchronized)?(Before|After)Suite\]|^\[Report(Before|After)Suite\]|^\[DeferCleanup \(Suite\)\]`)

// ParseJUnit reads the JUnit report e2e.test writes to -report-dir
// (junit_01.xml, Ginkgo's format): passed and failed specs, skipped ones
// with the suite's reason, and how many the focus left out. A failed
// suite-level node (BeforeSuite ...) counts as a failure: nothing ran.
func ParseJUnit(r io.Reader) (*SuiteSummary, error) {
	var j junitSuites
	if err := xml.NewDecoder(r).Decode(&j); err != nil {
		return nil, fmt.Errorf("reading the JUnit report: %w", err)
	}
	s := &SuiteSummary{}
	cases := 0
	for _, su := range j.Suites {
		for _, tc := range su.Cases {
			cases++
			c := SuiteCase{Name: strings.TrimPrefix(tc.Name, "[It] "), Time: time.Duration(tc.Time * float64(time.Second)).Round(100 * time.Millisecond)}
			switch {
			case tc.Failure != nil || tc.Error != nil:
				p := tc.Failure
				if p == nil {
					p = tc.Error
				}
				c.Reason = failureReason(tc.Status, p)
				s.Failed = append(s.Failed, c)
			case tc.Status == "skipped" || tc.Status == "pending" || tc.Skipped != nil:
				var msg string
				if tc.Skipped != nil {
					msg = tc.Skipped.Message
				}
				reason, ok := strings.CutPrefix(msg, "skipped - ")
				if !ok || strings.TrimSpace(reason) == "" {
					s.NotSelected++
					continue
				}
				c.Reason = strings.TrimSpace(reason)
				s.Skipped = append(s.Skipped, c)
			case tc.Status == "passed":
				if !suiteNode.MatchString(tc.Name) {
					s.Passed = append(s.Passed, c)
				}
			default:
				c.Reason = "the report gives the state " + tc.Status
				s.Failed = append(s.Failed, c)
			}
		}
	}
	if cases == 0 {
		return nil, errors.New("the JUnit report lists no spec")
	}
	return s, nil
}

// failureReason is the first lines of a failure as Ginkgo words it
// ("[FAILED] <message>", up to its "In [It] at:" location line).
func failureReason(status string, p *junitProblem) string {
	msg := strings.TrimSpace(p.Message)
	if msg == "" {
		var lines []string
		for _, l := range strings.Split(strings.TrimSpace(p.Text), "\n") {
			if strings.HasPrefix(l, "In [") || (len(lines) > 0 && strings.TrimSpace(l) == "") {
				break
			}
			lines = append(lines, strings.TrimSpace(l))
		}
		msg = strings.Join(lines, " ")
	}
	if len(msg) > 600 {
		msg = msg[:600] + "..."
	}
	if status != "" && status != "failed" {
		msg = status + ": " + msg
	}
	return msg
}

// Write puts the summary as text: the counts, then each failure and skip
// with the suite's words, then the passed specs.
func (s *SuiteSummary) Write(w io.Writer) {
	if s.Title != "" {
		fmt.Fprintln(w, s.Title)
	}
	fmt.Fprintf(w, "%d specs outside the focus or inside the skip expression were not run\n", s.NotSelected)
	if s.LabSkip != "" {
		fmt.Fprintf(w, "Of those, the specs that grow a claim in use were %s\n", s.LabSkip)
	}
	fmt.Fprintln(w)
	for _, g := range []struct {
		head  string
		cases []SuiteCase
	}{{"FAILED", s.Failed}, {"SKIPPED by the suite", s.Skipped}, {"PASSED", s.Passed}} {
		fmt.Fprintf(w, "%s (%d)\n", g.head, len(g.cases))
		for _, c := range g.cases {
			fmt.Fprintf(w, "  %s (%s)\n", c.Name, c.Time)
			if c.Reason != "" {
				fmt.Fprintf(w, "      %s\n", c.Reason)
			}
		}
		fmt.Fprintln(w)
	}
	if len(s.Skipped) > 0 {
		fmt.Fprintln(w, "Skip reasons, by how many specs gave each")
		for _, r := range s.SkipReasons() {
			fmt.Fprintf(w, "  %4d  %s\n", r.Count, r.Reason)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "%d passed, %d failed, %d skipped\n", len(s.Passed), len(s.Failed), len(s.Skipped))
}

// SkipReason is one reason the suite gave for skipping, and how many
// specs it skipped with it.
type SkipReason struct {
	Reason string
	Count  int
}

// SkipReasons tallies the skips by reason, the most frequent first.
func (s *SuiteSummary) SkipReasons() []SkipReason {
	n := map[string]int{}
	for _, c := range s.Skipped {
		n[c.Reason]++
	}
	out := make([]SkipReason, 0, len(n))
	for r, c := range n {
		out = append(out, SkipReason{r, c})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Count != out[j].Count {
			return out[i].Count > out[j].Count
		}
		return out[i].Reason < out[j].Reason
	})
	return out
}
