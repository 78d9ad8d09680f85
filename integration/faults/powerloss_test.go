package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// powerLossRounds is how many times each operation is interrupted;
// VCO_FAULTS_ROUNDS raises it for a soak run (each round boots a guest
// twice, about a minute and a half under TCG).
func powerLossRounds(t *testing.T) int {
	n := 1
	if s := os.Getenv("VCO_FAULTS_ROUNDS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("VCO_FAULTS_ROUNDS=%q: want a positive number", s)
		}
		n = v
	}
	return n
}

const (
	plPass    = "power-loss-passphrase-0123456789"
	plStaging = "/var/lib/kubelet/plugins/kubernetes.io/csi/cloud.whitesky.csi/pl/globalmount"
	// A cheap KDF: the rounds are about the writes, not the key derivation.
	plKDF = "--pbkdf pbkdf2 --pbkdf-iterations 1000"
)

// plAgentConfig runs the agent with no D-Bus and unfenced virtio-blk
// disks allowed (the request opts in too); the guests load no watchdog
// driver, so leases are held without one.
const plAgentConfig = `dbus:
  enabled: false
volumes:
  check_interval: 1s
  allow_unfenced: true
  lease:
    watchdog_device: none-unsafe
`

func startAgent(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	script := fmt.Sprintf(`mkdir -p /etc/vco-agent /var/lib/kubelet /run/vco-agent
cat > /etc/vco-agent/config.yaml <<'EOF'
%sEOF
setsid /bin/vco-agent serve --config /etc/vco-agent/config.yaml >>/run/agent.log 2>&1 </dev/null &
for i in $(seq 150); do /bin/vco-agent status >/dev/null 2>&1 && exit 0; sleep 0.2; done
echo "the agent did not come up:" >&2; tail -n 30 /run/agent.log >&2; exit 1`, plAgentConfig)
	if _, err := g.MustSh(ctx, script); err != nil {
		t.Fatal(err)
	}
}

// plOp is one operation interrupted by power loss: the guest command that
// performs it on the disk with the given serial, and how the host judges
// the disk's backing file afterwards.
type plOp struct {
	name string
	// agent: the operation goes through the agent daemon.
	agent bool
	// prep, when set, readies a disk before the operation.
	prep func(serial string) string
	run  func(serial string) string
	// window, when set, is the span the cut is drawn from (an operation
	// that runs until stopped); otherwise the operation is timed on a
	// scratch disk first.
	window time.Duration
	// next, when set, is the command that must succeed on the disk after
	// the restart; otherwise run again (or, for a complete LUKS2 format,
	// opening the keyslot).
	next func(serial string) string
	// judge classifies the backing file: "untouched", "complete" or a
	// description of a half-done state.
	judge func(t *testing.T, file string) string
}

// hostProbe runs blkid -p on a host file: the signature type, "" for none.
func hostProbe(t *testing.T, file string) string {
	t.Helper()
	out, err := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", file).Output()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
		return ""
	}
	if err != nil {
		t.Fatalf("blkid -p %s: %v", file, err)
	}
	return strings.TrimSpace(string(out))
}

var plOps = []plOp{
	{
		name: "luksFormat",
		run: func(serial string) string {
			return fmt.Sprintf(`d=$(for b in /sys/block/vd*; do [ "$(cat $b/serial)" = %s ] && echo /dev/${b##*/}; done)
printf %%s %s > /run/pw
/bin/vco-agent luks format $d --passphrase-file /run/pw %s`, serial, plPass, plKDF)
		},
		judge: func(t *testing.T, file string) string {
			sig := hostProbe(t, file)
			dump := exec.Command("cryptsetup", "luksDump", file).Run()
			switch {
			case sig == "" && dump != nil:
				return "untouched"
			case sig == "crypto_LUKS" && dump == nil:
				cmd := exec.Command("cryptsetup", "open", "--test-passphrase", "--key-file", "-", file)
				cmd.Stdin = strings.NewReader(plPass)
				if out, err := cmd.CombinedOutput(); err != nil {
					return fmt.Sprintf("a LUKS2 header whose keyslot does not open with the passphrase (%v: %s)", err, out)
				}
				return "complete"
			}
			return fmt.Sprintf("blkid finds %q, cryptsetup luksDump: %v", sig, dump)
		},
	},
	{
		name:  "stage-mkfs",
		agent: true,
		run: func(serial string) string {
			return fmt.Sprintf(`/bin/vco-agent volume stage pl-%s --serial %s --staging %s --fs ext4 --allow-unfenced --json`, serial, serial, plStaging)
		},
		judge: func(t *testing.T, file string) string {
			// The agent puts a lease area in front of a virtio-blk disk's
			// data (1 MiB, as 'vco-agent lease format' reports); the
			// filesystem is judged in the data area.
			out, err := exec.Command(os.Getenv("VCO_LAB_BIN")+"/vco-agent", "lease", "show", file, "--uuid", plNode, "--json").CombinedOutput()
			switch {
			case err == nil:
				data := filepath.Join(t.TempDir(), "data.img")
				if b, err := exec.Command("dd", "if="+file, "of="+data, "bs=1M", "skip=1").CombinedOutput(); err != nil {
					t.Fatalf("copying the data area of %s: %v: %s", file, err, b)
				}
				file = data
			case !strings.Contains(string(out), "no lease area"):
				return fmt.Sprintf("the lease area does not read back: %v: %s", err, lastLines(string(out), 8))
			}
			switch sig := hostProbe(t, file); sig {
			case "":
				// No signature: the next stage formats it (what the agent
				// does with a blank device); nothing to lose on it.
				return "untouched"
			case "ext4":
				out, err := exec.Command("e2fsck", "-fn", file).CombinedOutput()
				if err != nil {
					return fmt.Sprintf("an ext4 signature over a filesystem e2fsck rejects: %v: %s", err, lastLines(string(out), 8))
				}
				return "complete"
			default:
				return fmt.Sprintf("blkid finds %q", sig)
			}
		},
	},
}

// plNode is the identity every guest of TestPowerLoss boots with: the
// same node coming back after its power was cut.
var plNode = lab.NodeUUID("power-loss-node")

// findDisk is a guest shell line setting $d to the virtio disk with serial.
func findDisk(serial string) string {
	return fmt.Sprintf(`d=$(for b in /sys/block/vd*; do [ "$(cat $b/serial)" = %s ] && echo /dev/${b##*/}; done)`, serial)
}

func init() {
	plOps = append(plOps, plOp{
		name: "lease-renewal",
		prep: func(serial string) string {
			return findDisk(serial) + "\n/bin/vco-agent lease format $d"
		},
		// The default timing renews every 10 s; a shorter one puts
		// several renewals inside the window.
		run: func(serial string) string {
			return findDisk(serial) + "\n/bin/vco-agent lease acquire $d --renew 1s --fail 4s --io-timeout 1s --watchdog 6s --hold-for 10m"
		},
		window: 8 * time.Second,
		next: func(serial string) string {
			return findDisk(serial) + "\n/bin/vco-agent lease acquire $d --renew 1s --fail 4s --io-timeout 1s --watchdog 6s --hold-for 3s"
		},
		judge: func(t *testing.T, file string) string {
			out, err := exec.Command(os.Getenv("VCO_LAB_BIN")+"/vco-agent", "lease", "show", file, "--uuid", plNode, "--json").CombinedOutput()
			// Exit 0 with "ok": the area's header and every slot check out.
			if err != nil || !strings.Contains(string(out), `"ok": true`) {
				return fmt.Sprintf("the lease area does not read back: %v: %s", err, lastLines(string(out), 8))
			}
			return "complete"
		},
	})
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// TestPowerLoss cuts a guest's power (SIGKILL of QEMU: no flush, no
// shutdown) at a random point of a LUKS2 format and of the agent's first
// stage of a blank volume (mkfs), boots a guest on the same disk, and
// checks that the disk is either untouched or fully formatted -- never
// half -- and that the next format or stage succeeds.
func TestPowerLoss(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	p := &powerLoss{t: t, ctx: ctx, l: newLab(t, ctx), outcomes: map[string]int{}}
	rounds := powerLossRounds(t)
	for _, op := range plOps {
		for r := 0; r < rounds; r++ {
			p.round(op, r)
		}
	}
	figure(t, "power_loss_faults", p.faults)
	figure(t, "power_loss_rounds_per_op", rounds)
	for k, v := range p.outcomes {
		if strings.HasSuffix(k, "_untouched") || strings.HasSuffix(k, "_complete") {
			figure(t, "power_loss_"+k, v)
		}
	}
	half := 0
	for k, v := range p.outcomes {
		if !strings.HasSuffix(k, "_untouched") && !strings.HasSuffix(k, "_complete") {
			half += v
		}
	}
	figure(t, "power_loss_half_formatted", half)
}

// powerLoss is TestPowerLoss's lab and tallies.
type powerLoss struct {
	t        *testing.T
	ctx      context.Context
	l        *lab.Lab
	boot     int // guests booted
	faults   int // power cuts
	outcomes map[string]int
}

// round cuts the power once during op on a disk of its own, judges the
// disk, and has the next boot's operation succeed on it.
func (p *powerLoss) round(op plOp, r int) {
	t := p.t
	serial := fmt.Sprintf("pl%d%s", r, strings.ToLower(strings.ReplaceAll(op.name, "-", "")))
	if len(serial) > 20 {
		serial = serial[:20]
	}
	file := filepath.Join(p.l.Dir(), serial+".img")
	scratch := filepath.Join(p.l.Dir(), serial+"-t.img")
	for _, f := range []string{file, scratch} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(f, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	disks := []lab.Disk{
		{ID: serial, Kind: lab.VirtioBlk, File: file, Serial: serial},
		{ID: serial + "t", Kind: lab.VirtioBlk, File: scratch, Serial: serial + "t"},
	}
	cut, took := p.cutPowerDuring(op, serial, disks)
	verdict := op.judge(t, file)
	t.Logf("%s round %d: power cut %v into an operation of about %v: %s", op.name, r, cut.Round(time.Millisecond), took.Round(time.Millisecond), verdict)
	p.outcomes[strings.ReplaceAll(strings.ToLower(op.name), "-", "_")+"_"+verdict]++
	if verdict != "untouched" && verdict != "complete" {
		t.Errorf("%s round %d: after a power cut %v in, the disk is half done: %s", op.name, r, cut, verdict)
		return
	}
	p.nextOperationSucceeds(op, r, serial, verdict, disks[:1])
	if v := op.judge(t, file); v != "complete" {
		t.Errorf("%s round %d: after the next operation the disk is %s, want complete", op.name, r, v)
	}
}

// bootGuest boots the round's next guest, with the node's identity, on disks.
func (p *powerLoss) bootGuest(disks []lab.Disk) *lab.Guest {
	p.t.Helper()
	p.boot++
	gs, err := p.l.StartGuests(p.ctx, lab.GuestConfig{Name: fmt.Sprintf("pl-%d", p.boot), UUID: plNode, MemMB: 384, Disks: disks})
	if err != nil {
		p.t.Fatal(err)
	}
	return gs[0]
}

// cutPowerDuring boots a guest with the round's disk and a scratch disk,
// readies both, and cuts the guest's power at a random point of op on the
// disk; it returns how far in the cut came and about how long op takes.
func (p *powerLoss) cutPowerDuring(op plOp, serial string, disks []lab.Disk) (cut, took time.Duration) {
	t, ctx := p.t, p.ctx
	g := p.bootGuest(disks)
	if op.agent {
		startAgent(t, ctx, g)
	}
	if op.prep != nil {
		for _, sr := range []string{serial, serial + "t"} {
			if out, err := g.MustSh(ctx, op.prep(sr)); err != nil {
				t.Fatalf("%s: readying disk %s: %v\n%s", op.name, sr, err, out)
			}
		}
	}
	if op.window > 0 {
		took = op.window
	} else {
		// How long the operation takes here, on the scratch disk,
		// so the cut lands inside it.
		start := time.Now()
		if out, err := g.MustSh(ctx, op.run(serial+"t")); err != nil {
			t.Fatalf("%s on a scratch disk: %v\n%s", op.name, err, out)
		}
		took = time.Since(start)
	}
	cut = time.Duration(rand.Int64N(int64(took)))
	// The operation in the background, the exec channel's own
	// latency taken into account by starting the clock once the
	// command is on its way.
	go func() { _, _ = g.Sh(ctx, op.run(serial)+" >/run/op.log 2>&1") }()
	time.Sleep(cut)
	if err := g.Proc.Kill(); err != nil {
		t.Fatalf("cutting the power of %s: %v", g.Name, err)
	}
	p.faults++
	return cut, took
}

// nextOperationSucceeds boots a new guest on the same disk: the next
// operation succeeds (a stage formats a blank disk and never a complete
// filesystem; a formatted volume opens).
func (p *powerLoss) nextOperationSucceeds(op plOp, r int, serial, verdict string, disks []lab.Disk) {
	t, ctx := p.t, p.ctx
	g := p.bootGuest(disks)
	switch {
	case op.next != nil:
		if out, err := g.MustSh(ctx, op.next(serial)); err != nil {
			t.Errorf("%s round %d: the same node after the power cut: %v\n%s", op.name, r, err, out)
		}
	case op.agent:
		startAgent(t, ctx, g)
		out, err := g.MustSh(ctx, op.run(serial))
		if err != nil {
			t.Errorf("%s round %d: the stage after the power cut (disk %s) failed: %v", op.name, r, verdict, err)
		} else if formatted := strings.Contains(out, `"formatted":true`); formatted != (verdict == "untouched") {
			// A blank disk is formatted; a complete filesystem never
			// again.
			t.Errorf("%s round %d: the disk was %s after the cut, but the next stage says formatted=%v: %s", op.name, r, verdict, formatted, out)
		}
		if _, err := g.MustSh(ctx, "grep -q ' "+plStaging+" ext4 ' /proc/mounts && echo ok > "+plStaging+"/after && sync"); err != nil {
			t.Errorf("%s round %d: the volume is not mounted as ext4 after the stage: %v", op.name, r, err)
		}
	case verdict == "untouched":
		if out, err := g.MustSh(ctx, op.run(serial)); err != nil {
			t.Errorf("%s round %d: formatting the untouched disk after the power cut failed: %v\n%s", op.name, r, err, out)
		}
	default:
		if _, err := g.MustSh(ctx, fmt.Sprintf(`d=$(for b in /sys/block/vd*; do [ "$(cat $b/serial)" = %s ] && echo /dev/${b##*/}; done)
printf %%s %s > /run/pw && /bin/vco-agent luks test-passphrase $d --passphrase-file /run/pw`, serial, plPass)); err != nil {
			t.Errorf("%s round %d: the formatted volume does not open in the next boot: %v", op.name, r, err)
		}
	}
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
}
