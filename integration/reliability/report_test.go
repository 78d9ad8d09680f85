package reliability

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// tally collects the figures docs/reliability.md reports.
type tally struct {
	mu    sync.Mutex
	n     map[string]int
	notes map[string]string
}

var figures = &tally{n: map[string]int{}, notes: map[string]string{}}

func (t *tally) add(k string, n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.n[k] += n
}

func (t *tally) note(k, v string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.notes[k] = v
}

// writeReport writes the figures of this run as Markdown to p.
func writeReport(p string) error {
	figures.mu.Lock()
	defer figures.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "# Reliability figures\n\n")
	fmt.Fprintf(&b, "Written by `make soak` (integration/reliability, %s). Every figure is counted by the tests\n", time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(&b, "as they run; a run that loses data or leaks a mount fails and writes nothing.\n\n")
	b.WriteString(reportIntro)
	fmt.Fprintf(&b, "| figure | count |\n|---|---|\n")
	keys := make([]string, 0, len(figures.n))
	for k := range figures.n {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "| %s | %d |\n", k, figures.n[k])
	}
	if len(figures.notes) > 0 {
		fmt.Fprintf(&b, "\n")
		nk := make([]string, 0, len(figures.notes))
		for k := range figures.notes {
			nk = append(nk, k)
		}
		sort.Strings(nk)
		for _, k := range nk {
			fmt.Fprintf(&b, "## %s\n\n%s\n\n", k, strings.TrimSpace(figures.notes[k]))
		}
	}
	if log := os.Getenv("VCO_FUZZ_LOG"); log != "" {
		x, err := os.ReadFile(log)
		if err != nil {
			return err
		}
		b.WriteString(fuzzTable(string(x)))
	}
	return os.WriteFile(p, []byte(b.String()), 0o644)
}

var (
	fuzzHead  = regexp.MustCompile(`^== (\S+) (Fuzz\w+) \((\S+)\)`)
	fuzzExecs = regexp.MustCompile(`execs: (\d+) .*\(total: (\d+)\)`)
)

// fuzzTable turns the output of `make fuzz-all` into a table: each
// target's package, time, executions and corpus size at the end, and
// whether it found a failure.
func fuzzTable(log string) string {
	type row struct {
		pkg, fn, dur   string
		execs, corpus  int64
		failed, passed bool
	}
	var rows []*row
	var cur *row
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if m := fuzzHead.FindStringSubmatch(l); m != nil {
			cur = &row{pkg: strings.TrimPrefix(m[1], "./"), fn: m[2], dur: m[3]}
			rows = append(rows, cur)
			continue
		}
		if cur == nil {
			continue
		}
		if m := fuzzExecs.FindStringSubmatch(l); m != nil {
			cur.execs, _ = strconv.ParseInt(m[1], 10, 64)
			cur.corpus, _ = strconv.ParseInt(m[2], 10, 64)
		}
		switch {
		case strings.HasPrefix(l, "--- FAIL") || strings.HasPrefix(l, "FAIL"):
			cur.failed = true
		case strings.HasPrefix(l, "ok "):
			cur.passed = true
		}
	}
	var b strings.Builder
	var total int64
	fmt.Fprintf(&b, "## Fuzzing\n\n| package | target | time | inputs tried | corpus | result |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		res := "no failure"
		if r.failed || !r.passed {
			res = "FAILED"
		}
		total += r.execs
		fmt.Fprintf(&b, "| %s | %s | %s | %d | %d | %s |\n", r.pkg, r.fn, r.dur, r.execs, r.corpus, res)
	}
	fmt.Fprintf(&b, "\n%d targets, %d inputs in all.\n", len(rows), total)
	return b.String()
}

func TestFuzzTable(t *testing.T) {
	log := "== ./smbios FuzzParseTable (3s)\nfuzz: elapsed: 0s, gathering baseline coverage: 0/9 completed\n" +
		"fuzz: elapsed: 3s, execs: 1200 (400/sec), new interesting: 2 (total: 11)\nPASS\nok  \tgithub.com/x/smbios\t3.1s\n" +
		"== ./fence FuzzParseKey (3s)\n--- FAIL: FuzzParseKey (0.1s)\nFAIL\n"
	got := fuzzTable(log)
	for _, want := range []string{"| smbios | FuzzParseTable | 3s | 1200 | 11 | no failure |", "| fence | FuzzParseKey | 3s | 0 | 0 | FAILED |", "2 targets, 1200 inputs in all."} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in\n%s", want, got)
		}
	}
}

const reportIntro = `What runs (all on this host, as root, against the real binaries and devices):

- **Crash loop** (TestCrashLoop): one volume on a real loop device is staged, written
  (a marker file per round, fsynced) and unstaged, round after round, while vco-agent serve
  is SIGKILLed at a random moment of each round (during stage, the write, unstage, or
  between rounds), restarted, and the cut-off call retried. Checked every round: every
  earlier marker reads back, the filesystem UUID is the one made in round 1 and only one
  stage ever formatted, one mount at the staging path while staged, and after unstage no
  mount, no claim record and no new loop device.
- **A kill at every helper** (TestKillAtEveryHelper): the moments the crash loop meets only
  by chance, each met in turn. A volume's life (stage a blank disk, write, unstage, stage
  again, read, unstage) runs 4 helper programs unfenced (blkid, mkfs.ext4, blkid, fsck) and
  5 on a lease-fenced disk (one more blkid); for each, one life kills the agent's process
  group just before the helper, one right after it, and for mkfs one in its middle (the
  filesystem written without its primary superblock, as a kill inside mke2fs leaves it:
  the case CI's crash loop hit, which the agent then refused forever as foreign data). The
  agent is restarted and the call retried; the second stage must mount the first stage's
  filesystem with the file in it, and nothing may be left after unstage.
- **Cloud API faults** (TestCloudFaults): the CSI controller against the simulator behind a
  fault proxy: 5xx bursts shorter and longer than the client's retries, 429 with
  Retry-After, 403 on create, a create that lands after the client gave up, 502s on attach,
  and a detach answered 504 that happens 300 ms later. Every call succeeds on retry or fails
  with Unavailable / PermissionDenied and a sentence; the simulator then holds one disk per
  name and no attachment.
- **Hostile requests** (TestHostileAgentRequests, TestHostileCSIRequests): missing,
  oversized (1 MiB) and hostile fields (.., symlinks out of the kubelet root, NUL bytes,
  unknown ids, 4 EiB sizes, bad grants, flags with commas) to the agent over its socket and
  to the CSI plugin; each answer's code is checked, and that no mount, state file, loop
  device or simulator disk changed. Cases skipped as known plugin bugs are listed by
  go test -v.
- **Concurrent CSI calls** (TestConcurrentCSICalls): 100 calls fired at once on five
  overlapping volumes (one encrypted), round after round, through the CSI controller and
  node plugin (two servers, each with its own per-volume locks) to the simulator in host
  mode and the agent's volume manager with its claim check running: CreateVolume with the
  same names, publish and unpublish to two nodes, stage, publish, unpublish and unstage on
  the same paths, expand, snapshot, copy, delete, and reads. Every answer is OK or the code right for its
  situation (ABORTED for a busy volume, FAILED_PRECONDITION for a disk attached elsewhere
  or still published, NOT_FOUND only after a delete) with a message naming the volume; no
  two API requests changing one disk are in flight at once. Then every volume is settled
  in the kubelet's and attacher's order, with retries: the simulator holds one disk per
  name, ListVolumes reports exactly its attachments, and the mounts, loop devices and
  agent claim records are those of the volumes in use; after teardown, none.
- **State directory** (TestStateDirSymlinks): symlinks planted as claim records, as a
  record's temporary file and as the claims directory; none is followed or written through.
- **Secrets** (TestPassphraseNeverShown, TestJWTNeverShown, TestVaultTokenNeverShown,
  TestEchoedHeadersKeepNoPieceOfAToken): a passphrase, a JWT and a vault token pushed
  through success and error paths, including answers that echo the request; none appears
  (as is, base64 or hex) in an error, a log line, an event, the metrics text or the state
  directory. Hostile proxies echo every request header in error pages, the JWT starting at
  each byte around the 200th where the client cuts a page, and the request's headers and
  body cut short at each byte of the vault token and the ServiceAccount JWT: no part of a
  JWT (header, payload, signature) nor 8 bytes in a row of any token appears in the
  errors or the plugin's log.
- **TLS** (TestTLSVerifies): the API client and the transit client refuse a self-signed
  server without its CA and accept it with; no shipped code sets InsecureSkipVerify.
- **Fuzzing**: every fuzz target in the repository (make fuzz), with the corpora checked in
  under each package's testdata/fuzz.

`
