package k8s

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// junitSample is a report as e2e.test v1.34.2 writes it to -report-dir
// (Ginkgo v2's JUnit with OmitFailureMessageAttr, timelines only for
// specs that did not pass or skip), cut to one spec of each kind.
const junitSample = `<?xml version="1.0" encoding="UTF-8"?>
  <testsuites tests="6" disabled="2" errors="0" failures="1" time="412.5">
      <testsuite name="Kubernetes e2e suite" package="/var/tmp/vco-lab/k8s-e2e" tests="6" disabled="0" skipped="3" errors="0" failures="1" time="412.5" timestamp="2026-12-02T01:10:00">
          <properties>
              <property name="SuiteSucceeded" value="false"></property>
              <property name="SuiteHasProgrammaticFocus" value="false"></property>
              <property name="SpecialSuiteFailureReason" value=""></property>
              <property name="SuiteLabels" value="[]"></property>
              <property name="RandomSeed" value="1764637800"></property>
              <property name="RandomizeAllSpecs" value="false"></property>
              <property name="LabelFilter" value=""></property>
              <property name="FocusStrings" value="External.Storage.*(provisioning)"></property>
              <property name="SkipStrings" value=""></property>
          </properties>
          <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="3.2"></testcase>
          <testcase name="[It] External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (default fs)] provisioning should provision storage with mount options" classname="Kubernetes e2e suite" status="passed" time="95.61"></testcase>
          <testcase name="[It] External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (block volmode)] provisioning should provision storage with pvc data source in parallel [Slow]" classname="Kubernetes e2e suite" status="failed" time="301.2">
              <failure message="" type="failed">[FAILED] Timed out after 300.000s.&#xA;expected pod &#34;pvc-datasource-writer-x2x9q&#34; success: Gave up after waiting 5m0s for pod to be &#34;Succeeded or Failed&#34;&#xA;In [It] at: k8s.io/kubernetes/test/e2e/storage/testsuites/provisioning.go:1176 @ 12/02/26 01:15:12.123&#xA;</failure>
              <system-err>&gt; Enter [BeforeEach] ...</system-err>
          </testcase>
          <testcase name="[It] External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (default fs)] provisioning should provision storage with any volume data source [Serial]" classname="Kubernetes e2e suite" status="skipped" time="0.31">
              <skipped message="skipped - Driver &#34;cloud.whitesky.csi&#34; does not support populating data from a volume data source - skipping"></skipped>
          </testcase>
          <testcase name="[It] External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (ntfs)][Feature:Windows] provisioning should provision storage with defaults" classname="Kubernetes e2e suite" status="skipped" time="0.02">
              <skipped message="skipped - Distro debian doesn&#39;t support ntfs -- skipping"></skipped>
          </testcase>
          <testcase name="[It] [sig-storage] CSI Mock volume expansion should expand volume without restarting pod if nodeExpansion=off" classname="Kubernetes e2e suite" status="skipped" time="0">
              <skipped message="skipped"></skipped>
          </testcase>
          <testcase name="[It] [sig-apps] Deployment should run the lifecycle of a Deployment [Conformance]" classname="Kubernetes e2e suite" status="skipped" time="0">
              <skipped message="skipped"></skipped>
          </testcase>
          <testcase name="[ReportAfterSuite] Kubernetes e2e suite report" classname="Kubernetes e2e suite" status="passed" time="0.01"></testcase>
      </testsuite>
  </testsuites>`

func TestParseJUnit(t *testing.T) {
	s, err := ParseJUnit(strings.NewReader(junitSample))
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Passed) != 1 || len(s.Failed) != 1 || len(s.Skipped) != 2 || s.NotSelected != 2 {
		t.Fatalf("passed %d, failed %d, skipped %d, not selected %d; want 1, 1, 2, 2 (suite nodes are no specs)",
			len(s.Passed), len(s.Failed), len(s.Skipped), s.NotSelected)
	}
	if p := s.Passed[0]; !strings.HasPrefix(p.Name, "External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (default fs)] provisioning should provision storage with mount options") ||
		p.Time != 95600*time.Millisecond {
		t.Errorf("passed %+v", p)
	}
	f := s.Failed[0]
	if want := `[FAILED] Timed out after 300.000s. expected pod "pvc-datasource-writer-x2x9q" success: Gave up after waiting 5m0s for pod to be "Succeeded or Failed"`; f.Reason != want {
		t.Errorf("failure reason\n%q, want\n%q (the message up to its location line)", f.Reason, want)
	}
	if got := s.Skipped[0].Reason; got != `Driver "cloud.whitesky.csi" does not support populating data from a volume data source - skipping` {
		t.Errorf("skip reason %q", got)
	}
	var out strings.Builder
	s.Title = "title"
	s.Write(&out)
	for _, want := range []string{"title\n", "2 specs outside the focus", "FAILED (1)\n  External Storage",
		"      Distro debian doesn't support ntfs -- skipping\n", "PASSED (1)\n",
		"Skip reasons, by how many specs gave each\n     1  Distro debian doesn't support ntfs -- skipping\n", "\n1 passed, 1 failed, 2 skipped\n"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}

// A suite whose BeforeSuite failed ran nothing: that is a failure, not
// an empty success.
func TestParseJUnitBeforeSuiteFailure(t *testing.T) {
	const report = `<testsuites><testsuite name="Kubernetes e2e suite">
<testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="failed" time="600"><failure message="" type="failed">[FAILED] Error waiting for all pods to be running and ready: Told to stop trying after 600.0s.
In [SynchronizedBeforeSuite] at: k8s.io/kubernetes/test/e2e/e2e.go:294
</failure></testcase>
<testcase name="[It] External Storage [Driver: cloud.whitesky.csi] [Testpattern: Dynamic PV (default fs)] provisioning should provision storage with defaults" classname="Kubernetes e2e suite" status="skipped" time="0"><skipped message="skipped"></skipped></testcase>
</testsuite></testsuites>`
	s, err := ParseJUnit(strings.NewReader(report))
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Failed) != 1 || !strings.Contains(s.Failed[0].Reason, "Error waiting for all pods") || len(s.Passed) != 0 {
		t.Fatalf("%+v", s)
	}
	if _, err := ParseJUnit(strings.NewReader(`<testsuites></testsuites>`)); err == nil {
		t.Error("a report of no spec parsed without error")
	}
}

func TestRenderTestDriverForTheLab(t *testing.T) {
	dir := t.TempDir()
	p, err := renderTestDriver(t.Context(), dir, "vco-csi-physical")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b := string(raw)
	for _, want := range []string{"  Name: cloud.whitesky.csi\n", "  FromExistingClassName: vco-csi-physical\n", "SnapshotClass:\n"} {
		if !strings.Contains(b, want) {
			t.Errorf("rendered driver file lacks %q:\n%s", want, b)
		}
	}
	if strings.Contains(b, "${") || strings.Count(b, "FromExistingClassName: vco-csi\n") != 1 {
		t.Errorf("rendered driver file: a placeholder left, or the snapshot class changed too:\n%s", b)
	}
}

// RunStorageSuite against a stand-in e2e.test that records how it was
// called and writes the report a real one writes.
func TestRunStorageSuiteCallsE2ETestAsTheSuiteExpects(t *testing.T) {
	dir := t.TempDir()
	fake := filepath.Join(dir, "e2e.test")
	script := `#!/bin/sh
printf '%s\n' "$@" > "` + dir + `/args"
cp "$KUBE_TEST_REPO_LIST" "` + dir + `/repo-list"
echo "$PATH" > "` + dir + `/path"
while [ $# -gt 0 ]; do [ "$1" = -report-dir ] && rd=$2; shift; done
cat > "$rd/junit_01.xml" <<'XML'
` + junitSample + `
XML
echo "Ran 2 of 7450 Specs"
exit 1
`
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Kubeconfig: "/lab/k8s/admin.kubeconfig", Bins: &Binaries{Dir: "/cache/k8s/v1.34.2-abc"}}
	var log strings.Builder
	report := filepath.Join(dir, "report")
	s, err := RunStorageSuite(t.Context(), c, SuiteOptions{E2ETest: fake, Focus: `Dynamic PV \(ext4\)`, Skip: `\[Disruptive\]`,
		Class: "vco-csi-physical", ReportDir: report, Label: ", scsi-block disks", Log: &log})
	if err == nil || s == nil || len(s.Failed) != 1 {
		t.Fatalf("a suite with a failure: %v, %+v; want its summary and an error", err, s)
	}
	args, _ := os.ReadFile(filepath.Join(dir, "args"))
	for _, want := range []string{"-kubeconfig\n/lab/k8s/admin.kubeconfig\n", "-storage.testdriver\n" + report + "/testdriver.yaml\n",
		"-report-dir\n" + report + "\n", "-ginkgo.focus\nExternal.Storage.*(Dynamic PV \\(ext4\\))\n", "-ginkgo.skip\n(\\[Disruptive\\])|(" + growsInUse + ")\n",
		"-provider\nlocal\n"} {
		if !strings.Contains(string(args), want) {
			t.Errorf("e2e.test arguments lack %q:\n%s", want, args)
		}
	}
	if rl, _ := os.ReadFile(filepath.Join(dir, "repo-list")); !strings.Contains(string(rl), "promoterE2eRegistry: "+GuestRegistry+"/e2e-test-images\n") {
		t.Errorf("KUBE_TEST_REPO_LIST file:\n%s", rl)
	}
	if p, _ := os.ReadFile(filepath.Join(dir, "path")); !strings.HasPrefix(string(p), c.Bins.Dir+":") {
		t.Errorf("PATH %q: the suite's kubectl is the cluster's", p)
	}
	sum, err := os.ReadFile(filepath.Join(report, "k8s-e2e-summary.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"driver cloud.whitesky.csi, class vco-csi-physical, scsi-block disks", "1 passed, 1 failed, 2 skipped\n",
		"grow a claim in use were not run on scsi-block disks, a limit of the lab and not of the driver"} {
		if !strings.Contains(string(sum), want) {
			t.Errorf("summary lacks %q:\n%s", want, sum)
		}
	}
	if l, _ := os.ReadFile(filepath.Join(report, "e2e.log")); !strings.Contains(string(l), "Ran 2 of 7450 Specs") || !strings.Contains(log.String(), "Ran 2 of 7450 Specs") {
		t.Errorf("e2e.test's output is not in e2e.log and the progress log")
	}
}

// A relative report directory (make k8s-e2e gives bin/k8s-e2e-KIND) still
// reaches e2e.test, which runs in that directory, as paths that hold there.
func TestRunStorageSuiteWithARelativeReportDir(t *testing.T) {
	dir := t.TempDir()
	fake := filepath.Join(dir, "e2e.test")
	script := `#!/bin/sh
cat "$KUBE_TEST_REPO_LIST" >/dev/null || exit 2
while [ $# -gt 0 ]; do
	case $1 in -report-dir) rd=$2;; -storage.testdriver) td=$2;; esac; shift; done
cat "$td" >/dev/null || exit 2
cat > "$rd/junit_01.xml" <<'XML'
` + junitSample + `
XML
`
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	c := &Cluster{Kubeconfig: "/lab/k8s/admin.kubeconfig", Bins: &Binaries{Dir: "/cache/k8s/v1.34.2-abc"}}
	s, _ := RunStorageSuite(t.Context(), c, SuiteOptions{E2ETest: fake, ReportDir: filepath.Join("bin", "k8s-e2e-scsi-block")})
	if s == nil || len(s.Failed) != 1 {
		t.Fatalf("with a relative report directory e2e.test found neither its repo list nor its driver file, or wrote no report: %+v", s)
	}
}

// The lab skips the specs that grow a claim a pod is using on every disk
// kind but file-backed virtio-blk, and only those: the spec names are the
// pinned suite's.
func TestLabSkipsOnlyGrowthInUseOnISCSIDisks(t *testing.T) {
	const prefix = "External Storage [Driver: cloud.whitesky.csi] [Testpattern: "
	inUse := []string{
		prefix + "Dynamic PV (default fs)(allowExpansion)] volume-expand should resize volume when PVC is edited while pod is using it",
		prefix + "Dynamic PV (block volmode)(allowExpansion)] volume-expand should resize volume when PVC is edited and the pod is re-created on the same node after controller resize is finished",
		prefix + "Generic Ephemeral-volume (default fs) (late-binding)] ephemeral should support expansion of pvcs created for ephemeral pvcs",
	}
	others := []string{
		prefix + "Dynamic PV (default fs)(allowExpansion)] volume-expand Verify if offline PVC expansion works",
		prefix + "Dynamic PV (default fs)] volume-expand should not allow expansion of pvcs without AllowVolumeExpansion property",
		prefix + "Dynamic PV (default fs)] provisioning should provision correct filesystem size when restoring snapshot to larger size pvc",
		prefix + "Generic Ephemeral-volume (default fs) (late-binding)] ephemeral should create read/write inline ephemeral volume",
	}
	for _, kind := range []lab.DiskKind{"", lab.SCSIBlock, lab.VirtioBlk} {
		expr, reason := LabSkip(kind)
		re := regexp.MustCompile(expr)
		for _, n := range inUse {
			if expr == "" || !re.MatchString(n) {
				t.Errorf("%q disks: %q is run, but the lab cannot grow an attached iSCSI disk", kind, n)
			}
		}
		for _, n := range others {
			if re.MatchString(n) {
				t.Errorf("%q disks: %q is skipped", kind, n)
			}
		}
		if !strings.Contains(reason, "-kind virtio-blk-file") {
			t.Errorf("%q disks: the reason %q does not say where the specs run", kind, reason)
		}
	}
	if expr, reason := LabSkip(simlab.FileVirtioBlk); expr != "" || reason != "" {
		t.Errorf("file-backed virtio-blk disks grow attached, yet the lab skips %q (%s)", expr, reason)
	}
	if got := joinSkips("", `a`, ""); got != "a" {
		t.Errorf("joinSkips of one expression: %q", got)
	}
}
