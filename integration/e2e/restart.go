package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// A killPoint is when the agent is killed during a call: as soon as it
// runs a tool of that name for a step, or, for "@D", D seconds after the
// call was made.
type killPoint string

// The stage points are the tools the agent runs (formatting on first use,
// probing the device after) and moments in between by time; the unstage
// points are moments by time (unmount, release and the record). A point
// the call outran is tried again, a timed one sooner, up to killTries times.
var (
	stageKills   = []killPoint{"mkfs.ext4", "blkid", "@0.8", "@0.4", "@0.2"}
	unstageKills = []killPoint{"@0.4", "@0.2", "@0.1", "@0.05", "@0"}
)

const killTries = 5

// timed reports whether k is a time after the start of the call. A timed
// kill happens only while the call is in flight, so it always interrupts
// the call: under systemd, when it reaches the agent before the call does,
// the call waits on the socket and is answered, on its first try, by the
// agent systemd starts again. A kill at a tool the agent runs interrupts
// the call (it fails and is tried again) unless the agent ran the tool
// outside any call.
func (k killPoint) timed() bool { return strings.HasPrefix(string(k), "@") }

// sooner is the same kill point, half as long after the start of the
// call, or at its start once that is under 40 ms.
func (k killPoint) sooner() killPoint {
	d, ok := strings.CutPrefix(string(k), "@")
	if !ok {
		return k
	}
	var f float64
	fmt.Sscanf(d, "%g", &f)
	if f/2 < 0.04 {
		return "@0"
	}
	return killPoint(fmt.Sprintf("@%g", f/2))
}

const killedMarker = "/run/e9-killed"

// arm starts, in n's guest, a watcher that kills the agent with SIGKILL
// at k, and returns its pid. It first waits for the agent a kill before
// left restarting: under systemd a call made meanwhile waits on the
// socket, so a timed kill would land before the call reached the agent,
// and a watcher would have no agent to watch.
func (n *e9Node) arm(ctx context.Context, k killPoint) (string, error) {
	if _, err := n.g.MustSh(ctx, n.ready); err != nil {
		return "", fmt.Errorf("vco-agent did not come back before the kill at %s: %w", k, err)
	}
	// The agent's pid is looked up now: a pidof at the kill would take
	// longer under TCG than a quick call does.
	kill := fmt.Sprintf("kill -9 $a && echo %s >%s", k, killedMarker)
	var watch string
	if d, ok := strings.CutPrefix(string(k), "@"); ok {
		// The clock starts when the exec server starts the call (its
		// csi-call child $c), and the kill happens only while that call
		// is still waiting for its answer: a kill after the answer
		// would interrupt nothing.
		wait := ""
		if d != "0" {
			wait = "sleep " + d + "; "
		}
		watch = childWatch("vco-lab", `"/bin/vco-lab"cs[i]-call*`, wait+"running $c && "+kill)
	} else {
		// Only the agent's own children count: the test runs blkid too.
		watch = childWatch("vco-agent", `*"`+string(k)+`"*`, kill)
	}
	out, err := n.g.MustSh(ctx, "rm -f "+killedMarker+"; a=$(pidof vco-agent); "+watch)
	return strings.TrimSpace(out), err
}

// childWatch is a shell script that starts, in the background, a loop
// that runs then as soon as a process named parent has a child $c whose
// command line (its arguments run together) matches the case pattern
// match, and prints the loop's pid. The parents are found before the loop
// starts, so it watches from the moment the script returns; it forks
// nothing while it watches (a tool that runs for a few milliseconds under
// TCG is gone before a pidof per turn would see it), and gives up after
// two minutes. Every process named parent is watched: one may be the
// other's child between fork and exec. The pattern is written so that it
// does not match itself in the watching shell's command line. then may
// ask "running $c": is the child still running?
func childWatch(parent, match, then string) string {
	return fmt.Sprintf(`ps=$(pidof %s)
( running() { read -r st 2>/dev/null </proc/$1/stat || return 1; case "$st" in *") Z "*|*") X "*) return 1 ;; esac; }
read -r up _ </proc/uptime; end=$((${up%%.*}+120))
while read -r up _ </proc/uptime && [ ${up%%.*} -lt $end ]; do
	for p in $ps; do
		for t in /proc/$p/task/*/children; do
			ch=; read -r ch 2>/dev/null <"$t"
			for c in $ch; do
				l=; read -r l 2>/dev/null </proc/$c/cmdline
				case "$l" in %s) %s; exit 0 ;; esac
			done
		done
	done
done ) >/dev/null 2>&1 &
echo $!`, parent, match, then)
}

// disarm stops the watcher and reports whether it killed the agent.
func disarm(ctx context.Context, g *lab.Guest, pid string) bool {
	r, _ := g.Sh(ctx, "kill "+pid+" 2>/dev/null; cat "+killedMarker+" 2>/dev/null")
	return r != nil && strings.TrimSpace(r.Stdout) != ""
}

// retried makes the call the way the kubelet does after a failure: again,
// with a pause, until it succeeds or a deadline passes.
func retried(ctx context.Context, call func() error) (tries int, err error) {
	deadline := time.Now().Add(2 * time.Minute)
	for tries = 1; ; tries++ {
		if err = call(); err == nil || time.Now().After(deadline) {
			return tries, err
		}
		time.Sleep(time.Second)
	}
}

// e9Node is the guest E9 kills the agent in and what restarts it there.
type e9Node struct {
	// repo, in the systemd guest, is the repository its package is
	// upgraded from (e9Upgrade).
	repo *upgradeRepo
	g    *lab.Guest
	// restarts is how many times the agent was started again after it
	// died since E9 began.
	restarts func(ctx context.Context) (int, error)
	// agentLog is what the agent logged since E9 began.
	agentLog func(ctx context.Context) (string, error)
	// how says what restarted the agent, for the report.
	how string
	// ready is a script that waits until the agent runs again.
	ready string
	// burst, where set, kills the agent burstKills times in a row, each
	// time as soon as it is back, and says how it came back.
	burst func(ctx context.Context) (string, error)
}

// formats counts the agent's logged stages of volume vol that made its
// filesystem. A stage killed after mkfs finished logs none: its retry
// finds the filesystem and mounts it.
func (n *e9Node) formats(ctx context.Context, vol string) (int, error) {
	log, err := n.agentLog(ctx)
	if err != nil {
		return 0, err
	}
	formats := 0
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "volume staged") && strings.Contains(l, vol) &&
			(strings.Contains(l, "formatted=true") || strings.Contains(l, `"formatted":true`)) {
			formats++
		}
	}
	return formats, nil
}

// adopted says who made the filesystem, from the formats the agent
// logged by its first successful stage.
func adopted(first int) string {
	if first == 0 {
		return "the killed agent's mkfs had finished; the retry found the filesystem and mounted it"
	}
	return "made by a stage that completed"
}

// SystemGuest is the name of the Debian guest E9 boots when it can.
const SystemGuest = "node-c"

// e9: the agent is killed with SIGKILL at each step of NodeStage and
// NodeUnstage of a volume of its own, in a Debian 12 guest where systemd
// runs the packaged vco-agent and restarts it (its unit's
// Restart=on-failure), or, without the Debian root or the package, on
// node-a with a shell loop standing in for systemd. Each retried call must
// succeed; the filesystem made on first use must be the one mounted every
// time after (same UUID: never formatted again) and the data written must
// read back; every kill must have been followed by exactly one restart.
// In the systemd guest the agent is then killed burstKills times in a row,
// and a lease-fenced virtio-blk disk is staged (e9Lease).
func (s *story) e9(ctx context.Context) (err error) {
	const sc = "E9"
	c := *s
	c.name, c.pod, c.kind = "pvc-e2e-kill", "pod-kill-", lab.SCSIBlock
	var n *e9Node
	if root, why := lab.FindDebianRoot(); why != nil {
		s.r.NotRun = append(s.r.NotRun, "E9 in a systemd guest: "+why.Error()+"; E9 ran on node-a (busybox) with a shell loop restarting the agent as Restart=on-failure would")
		var done func() error
		n, done, err = s.e9Supervised(ctx, sc)
		if err != nil {
			return err
		}
		defer func() {
			if rerr := done(); err == nil {
				err = rerr
			}
		}()
	} else if n, err = s.e9Systemd(ctx, sc, root); err != nil {
		return err
	}
	if n.repo != nil {
		defer n.repo.close()
	}
	g := n.g
	r, err := s.e9Start(ctx, sc, &c, n)
	if err != nil {
		return err
	}
	if err := r.killEachStep(ctx); err != nil {
		return err
	}
	if n.burst != nil {
		if err := s.step(sc, g.Name, fmt.Sprintf("kill the agent %d times, each time as soon as it is back", burstKills), func() (string, error) {
			return n.burst(ctx)
		}); err != nil {
			return err
		}
		r.landed += burstKills
	}
	if err := s.step(sc, g.Name, "the kills reached the agent; "+n.how+" restarted it after each; it formatted once", func() (string, error) {
		return r.restartedAndFormattedOnce(ctx)
	}); err != nil {
		return err
	}
	if err := c.unpublish(ctx, sc, g); err != nil {
		return err
	}
	if err := s.step(sc, "controller", "DeleteVolume "+c.volID, func() (string, error) {
		_, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: c.volID})
		return "", err
	}); err != nil || n.burst == nil {
		return err
	}
	return s.e9Lease(ctx, sc, g, n.repo)
}

// e9Run is E9's volume on its node and what the kills found so far.
type e9Run struct {
	// s reports; c is the volume's story.
	s, c       *story
	sc         string
	n          *e9Node
	g          *lab.Guest
	staging    string
	stageReq   *csi.NodeStageVolumeRequest
	unstageReq *csi.NodeUnstageVolumeRequest
	// uuid is the filesystem made on first use, sum the sha256 of the
	// data written then.
	uuid, sum string
	// firstFormats is how many formats the agent had logged when the
	// first stage succeeded.
	firstFormats int
	// kills counts the calls a kill interrupted, landed every SIGKILL the
	// agent got (one that came after the call answered too).
	kills, landed int
	// missed are the kill points every call outran.
	missed []killPoint
}

// e9Start creates c's volume and publishes it to n's guest.
func (s *story) e9Start(ctx context.Context, sc string, c *story, n *e9Node) (*e9Run, error) {
	g := n.g
	if err := c.createOwn(ctx, sc); err != nil {
		return nil, err
	}
	pc, err := c.publish(ctx, sc, g)
	if err != nil {
		return nil, err
	}
	if err := c.kubeletDirs(ctx, g, c.pod+g.Name); err != nil {
		return nil, err
	}
	staging := stagingPath(c.name)
	return &e9Run{s: s, c: c, sc: sc, n: n, g: g, staging: staging,
		stageReq:   &csi.NodeStageVolumeRequest{VolumeId: c.volID, PublishContext: pc, StagingTargetPath: staging, VolumeCapability: VolumeCapability()},
		unstageReq: &csi.NodeUnstageVolumeRequest{VolumeId: c.volID, StagingTargetPath: staging}}, nil
}

// killEachStep stages and unstages with the agent killed at each kill
// point in turn.
func (r *e9Run) killEachStep(ctx context.Context) error {
	stageAt := func(k killPoint) (bool, error) { return r.stageAt(ctx, k) }
	unstageAt := func(k killPoint) (bool, error) { return r.unstageAt(ctx, k) }
	for i := range stageKills {
		killed, err := r.at(stageKills[i], stageAt, func() error { return r.plain(ctx, "NodeUnstageVolume", r.unstageReq) })
		if err != nil {
			return err
		}
		r.count(killed, stageKills[i])
		killed, err = r.at(unstageKills[i], unstageAt, func() error { return r.plain(ctx, "NodeStageVolume", r.stageReq) })
		if err != nil {
			return err
		}
		r.count(killed, "unstage "+unstageKills[i])
	}
	return nil
}

// count records whether a kill at k landed mid-call.
func (r *e9Run) count(killed bool, k killPoint) {
	if killed {
		r.kills++
	} else {
		r.missed = append(r.missed, k)
	}
}

// at runs one call with the agent killed at k, again with k sooner
// while the call outruns it, and reports whether a kill landed.
func (r *e9Run) at(k killPoint, call func(killPoint) (bool, error), undo func() error) (bool, error) {
	for try := 1; ; try++ {
		killed, err := call(k)
		if err != nil || killed || try == killTries || !k.timed() {
			return killed, err
		}
		if err := undo(); err != nil {
			return false, err
		}
		k = k.sooner()
	}
}

// plain makes a call without a kill, to undo one that outran its kill
// point.
func (r *e9Run) plain(ctx context.Context, method string, req proto.Message) error {
	return r.s.step(r.sc, r.g.Name, method+" (the kill point was outrun; again)", func() (string, error) {
		_, err := retried(ctx, func() error { return simlab.NodeCall(ctx, r.g, method, req, nil) })
		return "", err
	})
}

// killedCall makes call with the agent killed at k, retried as the
// kubelet would, and reports whether a kill landed mid-call.
func (r *e9Run) killedCall(ctx context.Context, k killPoint, method string, req proto.Message) (killed bool, tries int, err error) {
	pid, err := r.n.arm(ctx, k)
	if err != nil {
		return false, 0, err
	}
	tries, err = retried(ctx, func() error { return simlab.NodeCall(ctx, r.g, method, req, nil) })
	hit := disarm(ctx, r.g, pid)
	if hit {
		r.landed++
	}
	killed = hit && (k.timed() || tries > 1)
	if err != nil {
		return killed, tries, fmt.Errorf("%s still failing after %d tries (agent killed: %v): %w\nend of %s's console:\n%s", method, tries, killed, err, r.g.Name, r.g.ConsoleTail(15))
	}
	return killed, tries, nil
}

// mountedDev is the device mounted at the staging path, or "".
func (r *e9Run) mountedDev(ctx context.Context) (string, error) {
	out, err := r.g.MustSh(ctx, fmt.Sprintf("awk '$2==\"%s\"{print $1}' /proc/mounts", r.staging))
	return strings.TrimSpace(out), err
}

// stageAt stages with the agent killed at k, and checks what the
// retried call left: mounted, the filesystem of first use, the data.
func (r *e9Run) stageAt(ctx context.Context, k killPoint) (killed bool, err error) {
	err = r.s.step(r.sc, r.g.Name, fmt.Sprintf("NodeStageVolume, agent killed at %s", k), func() (string, error) {
		var tries int
		var err error
		killed, tries, err = r.killedCall(ctx, k, "NodeStageVolume", r.stageReq)
		if err != nil {
			return "", err
		}
		dev, err := r.mountedDev(ctx)
		if err != nil || dev == "" {
			return "", fmt.Errorf("staging path not mounted after NodeStageVolume succeeded (%v)", err)
		}
		out, err := r.g.MustSh(ctx, "blkid -s UUID -o value "+dev)
		if err != nil {
			return "", err
		}
		got := strings.TrimSpace(out)
		detail := fmt.Sprintf("agent killed mid-call: %v; succeeded on try %d; %s mounted, filesystem UUID %s", killed, tries, dev, got)
		if r.uuid == "" {
			return r.firstUse(ctx, got, detail)
		}
		return r.sameAsFirstUse(ctx, k, got, detail)
	})
	return killed, err
}

// firstUse records the filesystem uuid made by the first stage and
// writes the data later stages must find.
func (r *e9Run) firstUse(ctx context.Context, uuid, detail string) (string, error) {
	r.uuid = uuid
	var err error
	if r.firstFormats, err = r.n.formats(ctx, r.c.volID); err != nil {
		return "", err
	}
	sum, err := r.g.MustSh(ctx, fmt.Sprintf("dd if=/dev/urandom of=%[1]s/data.bin bs=1M count=4 2>/dev/null && sync && sha256sum %[1]s/data.bin", r.staging))
	if err != nil {
		return "", err
	}
	r.sum = strings.Fields(sum + " x")[0]
	return detail + "; wrote data.bin sha256 " + r.sum, nil
}

// sameAsFirstUse checks that a stage after a kill at k mounted the
// filesystem of first use (uuid got) with its data.
func (r *e9Run) sameAsFirstUse(ctx context.Context, k killPoint, got, detail string) (string, error) {
	r.s.check(P5, r.sc, got == r.uuid, "after the agent was killed during NodeStageVolume (at %s) the filesystem mounted has UUID %s, the one made on first use %s", k, got, r.uuid)
	if got != r.uuid {
		return "", fmt.Errorf("filesystem UUID %s, made on first use %s: formatted again", got, r.uuid)
	}
	out, err := r.g.MustSh(ctx, "echo 3 >/proc/sys/vm/drop_caches; sha256sum "+r.staging+"/data.bin")
	if err != nil {
		return "", err
	}
	rs := strings.Fields(out + " x")[0]
	r.s.check(P5, r.sc, rs == r.sum, "after the agent was killed during NodeStageVolume (at %s) data.bin reads sha256 %s (written %s)", k, rs, r.sum)
	if rs != r.sum {
		return "", fmt.Errorf("data.bin sha256 %s, written %s", rs, r.sum)
	}
	return detail + "; data.bin intact", nil
}

// unstageAt unstages with the agent killed at k, and checks that the
// retried call left the staging path unmounted.
func (r *e9Run) unstageAt(ctx context.Context, k killPoint) (killed bool, err error) {
	err = r.s.step(r.sc, r.g.Name, fmt.Sprintf("NodeUnstageVolume, agent killed at %s", k), func() (string, error) {
		var tries int
		var err error
		killed, tries, err = r.killedCall(ctx, k, "NodeUnstageVolume", r.unstageReq)
		if err != nil {
			return "", err
		}
		if dev, err := r.mountedDev(ctx); err != nil || dev != "" {
			return "", fmt.Errorf("staging path still mounted from %q after NodeUnstageVolume succeeded (%v)", dev, err)
		}
		return fmt.Sprintf("agent killed mid-call: %v; succeeded on try %d; staging path unmounted", killed, tries), nil
	})
	return killed, err
}

// restartedAndFormattedOnce checks that every kill reached the agent
// mid-call, that each SIGKILL was followed by one restart, and that the
// agent formatted the volume once, on its first stage.
func (r *e9Run) restartedAndFormattedOnce(ctx context.Context) (string, error) {
	n, g, c := r.n, r.g, r.c
	// A kill that landed after the last call answered may still be
	// waiting for its restart.
	if _, err := g.MustSh(ctx, n.ready); err != nil {
		return "", fmt.Errorf("vco-agent did not come back: %w", err)
	}
	restarts, err := n.restarts(ctx)
	if err != nil {
		return "", err
	}
	if len(r.missed) > 0 || restarts != r.landed {
		return "", fmt.Errorf("%d of %d kill points reached the agent mid-call (outrun: %v); %d SIGKILLs, %d restarts by %s", r.kills, len(stageKills)+len(unstageKills), r.missed, r.landed, restarts, n.how)
	}
	formats, err := n.formats(ctx, c.volID)
	if err != nil {
		return "", err
	}
	once := formats == r.firstFormats && r.firstFormats <= 1
	r.s.check(P5, r.sc, once, "the agent on %s, killed %d times during stage and unstage and restarted by %s, reported %d format(s) of volume %s over %d stages, %d of them by the first stage (%s)",
		g.Name, r.landed, n.how, formats, c.volID, len(stageKills), r.firstFormats, adopted(r.firstFormats))
	if !once {
		return "", fmt.Errorf("the agent logged %d formats of %s, %d of them by the first stage; want at most one, made by the first stage", formats, c.volID, r.firstFormats)
	}
	return fmt.Sprintf("%d kills mid-call, %d SIGKILLs in all, %d restarts by %s; formatted once (%s)", r.kills, r.landed, restarts, n.how, adopted(r.firstFormats)), nil
}

// createOwn creates c's volume (1 GiB in the lab's location) and has the
// simulator show its disk as c.kind.
func (c *story) createOwn(ctx context.Context, sc string) error {
	return c.step(sc, "controller", "CreateVolume "+c.name+" (1 GiB, "+string(c.kind)+")", func() (string, error) {
		if _, err := c.createVolume(ctx, VolumeRequest(c.name)); err != nil {
			return "", err
		}
		return "volume " + c.volID, nil
	})
}

// createInUse creates c's volume and has g use it: published to g,
// staged and published into c's pod there.
func (c *story) createInUse(ctx context.Context, sc string, g *lab.Guest) error {
	if err := c.createOwn(ctx, sc); err != nil {
		return err
	}
	pc, err := c.publish(ctx, sc, g)
	if err != nil {
		return err
	}
	return c.stageAndPublish(ctx, sc, g, pc)
}

// e9Lease stages a blank virtio-blk disk in the systemd guest. It has no
// reservations, so the agent fences it with its on-disk lease and mounts
// the data area past the lease through a loop device: work that the
// unit's DeviceAllow= and syscall filter must let it do.
func (s *story) e9Lease(ctx context.Context, sc string, g *lab.Guest, repo *upgradeRepo) error {
	c := *s
	c.name, c.pod, c.kind = "pvc-e2e-kill-lease", "pod-lease-", simlab.FileVirtioBlk
	if err := c.createInUse(ctx, sc, g); err != nil {
		return err
	}
	if err := s.step(sc, g.Name, "the lease's data area is mounted through a loop device; data reads back", func() (string, error) {
		out, err := g.MustSh(ctx, fmt.Sprintf("awk '$2==\"%s\"{print $1}' /proc/mounts", stagingPath(c.name)))
		if err != nil {
			return "", err
		}
		dev := strings.TrimSpace(out)
		if !strings.HasPrefix(dev, "/dev/loop") {
			return "", fmt.Errorf("staging path mounted from %q, not the lease's loop mapping", dev)
		}
		sum, err := writeFile(ctx, g, c.pod+g.Name, "data.bin", 4)
		if err != nil {
			return "", err
		}
		back, err := readSum(ctx, g, c.pod+g.Name, "data.bin")
		if err != nil {
			return "", err
		}
		if back != sum {
			return "", fmt.Errorf("data.bin reads sha256 %s, written %s", back, sum)
		}
		return fmt.Sprintf("staged from %s; data.bin sha256 %s reads back", dev, sum), nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, g.Name, "add the repository the package is upgraded from: its source with its key, no other source", func() (string, error) {
		return addUpgradeSource(ctx, g, repo)
	}); err != nil {
		return err
	}
	for round := 1; round <= upgradeRounds(); round++ {
		if err := s.e9Upgrade(ctx, sc, g, repo, stagingPath(c.name), round); err != nil {
			return err
		}
	}
	return c.takeDown(ctx, sc, g)
}

// upgradeRounds is how many times E9 upgrades the package under load:
// once in make test, more with VCO_E2E_UPGRADE_ROUNDS (make soak).
func upgradeRounds() int {
	if n, err := strconv.Atoi(os.Getenv("VCO_E2E_UPGRADE_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return 1
}

// e9Upgrade upgrades the vco-agent package in the systemd guest to a newer
// version from the repository (apt-get update, then apt-get install
// --only-upgrade) while a writer keeps writing, O_DSYNC, to the
// lease-fenced volume staged at staging: dpkg restarts the agent
// (postinst), which must resume its lease within the bound
// docs/upgrade.md states, so that nothing is fenced and no write fails.
// The newer package, published to the repository first, is the booted one
// repacked with the version 99.0.0-ROUND, so that dpkg runs the
// maintainer scripts' upgrade path with the same files.
func (s *story) e9Upgrade(ctx context.Context, sc string, g *lab.Guest, repo *upgradeRepo, staging string, round int) error {
	what := "upgrade the vco-agent package under write load with the lease volume staged: nothing fenced, no write fails"
	if round > 1 {
		what = fmt.Sprintf("upgrade the vco-agent package again (round %d) under write load: nothing fenced, no write fails", round)
	}
	version := fmt.Sprintf("99.0.0-%d", round)
	return s.step(sc, g.Name, what, func() (string, error) {
		if err := repo.publish(ctx, version); err != nil {
			return "", err
		}
		script := fmt.Sprintf(`set -e
d=$(mktemp -d)
old=$(dpkg-query -W -f='${Version}' vco-agent)
apt-get update >$d/update.log 2>&1 || { cat $d/update.log; exit 1; }
cand=$(apt-cache policy vco-agent | awk '$1 == "Candidate:" {print $2}')
pid0=$(systemctl show -p MainPID --value vco-agent.service)
since=$(date '+%%Y-%%m-%%d %%H:%%M:%%S')
rm -f $d/stop $d/failed
( n=0; while [ ! -e $d/stop ]; do
	dd if=/dev/urandom of=%[2]s/load.bin bs=4k count=1 seek=$((n %% 1024)) conv=notrunc oflag=dsync 2>>$d/dd.err || echo $n >>$d/failed
	n=$((n+1)); done; echo $n >$d/writes ) &
w=$!
sleep 3
t0=$(date +%%s%%N)
DEBIAN_FRONTEND=noninteractive apt-get install --only-upgrade -y -o Dpkg::Options::=--force-confold vco-agent >$d/apt.log 2>&1 || { cat $d/apt.log; exit 1; }
i=0; until [ "$(systemctl show -p MainPID --value vco-agent.service)" != "$pid0" ] && systemctl is-active --quiet vco-agent.service; do
	i=$((i+1)); [ $i -lt 600 ] || { systemctl status --no-pager vco-agent.service; exit 1; }; sleep 0.05; done
t1=$(date +%%s%%N)
# Keep writing across the resumed lease's next renewals.
sleep 15
touch $d/stop; wait $w
echo "candidate=$cand from=$(grep -c '^Get:.* http://%[1]s/apt stable/main amd64 vco-agent amd64 ' $d/apt.log)"
echo "old=$old new=$(dpkg-query -W -f='${Version}' vco-agent) pid0=$pid0 pid1=$(systemctl show -p MainPID --value vco-agent.service)"
echo "restart_ms=$(( (t1 - t0) / 1000000 )) writes=$(cat $d/writes) failed=$(cat $d/failed 2>/dev/null | wc -l)"
echo "down_ms=$(journalctl -u vco-agent.service --since "$since" --no-pager -o short-unix | awk '/vco-agent stopping/ && !s {s=$1} /vco-agent serving/ && s {print int(($1-s)*1000); exit}')"
echo "wd_ms=$(journalctl -u vco-agent.service --since "$since" --no-pager -o short-unix | awk '/vco-agent stopping/ && !s {s=$1} /host watchdog armed/ && s {print int(($1-s)*1000); exit}')"
echo "resumed=$(journalctl -u vco-agent.service --since "$since" --no-pager -o cat | grep -c 'lease resumed from an earlier run' || true)"
echo "age=$(journalctl -u vco-agent.service --since "$since" --no-pager -o json MESSAGE='lease resumed from an earlier run' | sed -n 's/.*"AGE":"\([^"]*\)".*/\1/p' | tail -n 1)"
echo "fenced=$(journalctl -u vco-agent.service --since "$since" --no-pager -o cat | grep -c 'DiskFenced' || true)"
echo "disks=$(vco-agent disks --json | tr -d '\n')"
cat $d/dd.err | head -n 5`, strings.TrimSuffix(upgradeRepoAddr, ":80"), staging)
		out, err := g.MustSh(ctx, script)
		if err != nil {
			return "", fmt.Errorf("%w\n%s", err, out)
		}
		field := func(k string) string {
			for _, f := range strings.Fields(out) {
				if v, ok := strings.CutPrefix(f, k+"="); ok {
					return v
				}
			}
			return ""
		}
		disks := out[strings.Index(out, "disks=")+len("disks="):]
		held := strings.Contains(disks, `"CLAIM_STATE_HELD"`) && !strings.Contains(disks, `"CLAIM_STATE_LOST"`)
		ok := field("candidate") == version && field("from") == "1" && field("new") == version && field("pid0") != field("pid1") && field("failed") == "0" && field("fenced") == "0" && field("resumed") != "0" && held
		s.check(P4, sc, ok, "upgrading vco-agent %s to %s (apt-get install --only-upgrade from the repository, %s ms) restarted the agent (pid %s to %s; %s ms from stopping to serving, %s ms to the host watchdog's takeover, within W/2) under %s O_DSYNC writes: %s failed, leases resumed %s (the record %s old, handed off by the stopping agent), DiskFenced %s, claim held after: %v",
			field("old"), field("new"), field("restart_ms"), field("pid0"), field("pid1"), field("down_ms"), field("wd_ms"), field("writes"), field("failed"), field("resumed"), field("age"), field("fenced"), held)
		if !ok {
			// What the agent and the kernel said is what explains it.
			// The agent's lease lines come last, where a
			// shortened log still shows them.
			logs, _ := g.MustSh(ctx, "journalctl -u vco-agent.service --no-pager -o short-monotonic -n 80; dmesg | tail -n 40; cat /proc/mounts | grep -e /dev/loop -e /dev/vd; losetup -a; "+
				"echo '-- the agent on the lease, stop and start:'; journalctl -u vco-agent.service --no-pager -o short-monotonic | grep -i -e lease -e fenc -e lost -e renew -e stopping -e serving -e watchdog | tail -n 40; true")
			return "", fmt.Errorf("the upgrade under load did not keep the volume: %s\nthe agent's journal and the kernel's log:\n%s", out, logs)
		}
		return fmt.Sprintf("%s -> %s (apt-get install --only-upgrade from the repository, %s ms), agent down %s ms, host watchdog taken over %s ms after the stop, %s writes, none failed; lease resumed (record %s old), nothing fenced", field("old"), field("new"), field("restart_ms"), field("down_ms"), field("wd_ms"), field("writes"), field("age")), nil
	})
}

// burstKills is how many times E9 kills the agent in the systemd guest
// the moment systemd has it back: more than the default StartLimitBurst
// (5 starts within StartLimitIntervalSec=10s). The unit's RestartSec=2s
// spaces the restarts so that they cannot reach that limit, and a socket
// activation while a restart is pending waits for it, so systemd does not
// give up on the agent; this shows it.
const burstKills = 6

// e9Supervised runs node-a's agent under a shell loop that restarts it on
// a failed exit, as the packaged unit's Restart=on-failure has systemd do
// (the busybox guests have no systemd). done starts it unsupervised again.
func (s *story) e9Supervised(ctx context.Context, sc string) (n *e9Node, done func() error, err error) {
	g := s.a
	err = s.step(sc, g.Name, "restart vco-agent under a restart-on-failure loop (no systemd in the guest)", func() (string, error) {
		if err := simlab.StopNodeStack(ctx, g); err != nil {
			return "", err
		}
		return "a shell loop stands in for systemd's Restart=on-failure",
			simlab.StartNodeStackWith(ctx, g, simlab.StackOptions{Supervise: true})
	})
	if err != nil {
		return nil, nil, err
	}
	n = &e9Node{g: g, how: "the shell loop",
		ready: "i=0; until pidof vco-agent >/dev/null; do i=$((i+1)); [ $i -lt 300 ] || exit 1; sleep 0.1; done",
		restarts: func(ctx context.Context) (int, error) {
			out, err := g.MustSh(ctx, "cat "+simlab.SupervisorExits+" 2>/dev/null; true")
			return strings.Count(out, "137"), err
		},
		agentLog: func(ctx context.Context) (string, error) {
			return g.MustSh(ctx, "grep 'volume staged' /var/log/vco-agent.log; true")
		},
	}
	done = func() error {
		return s.step(sc, g.Name, "restart vco-agent unsupervised", func() (string, error) {
			if err := simlab.StopNodeStack(ctx, g); err != nil {
				return "", err
			}
			return "", simlab.StartNodeStack(ctx, g)
		})
	}
	return n, done, nil
}

// systemGuestConfig is the agent's configuration in the systemd guest:
// the packaged settings, with the lab's location. The node name is the
// host name, which the lab gives the guest on its kernel command line.
const systemGuestConfig = `socket:
  path: /run/vco-agent/agent.sock
  group: vco-agent
node:
  location: ` + simlab.Location + `
`

// e9Systemd boots SystemGuest from the Debian root with the vco-agent
// package installed, so systemd runs the agent under the packaged unit
// and socket, registers it as a VM with the simulator, and starts the
// vco-csi node plugin beside the agent (as a transient unit).
func (s *story) e9Systemd(ctx context.Context, sc string, root *lab.DebianRoot) (_ *e9Node, err error) {
	var g *lab.Guest
	var repo *upgradeRepo
	defer func() {
		if err != nil && repo != nil {
			repo.close()
		}
	}()
	if err := s.step(sc, SystemGuest, "boot Debian 12 with the vco-agent package (its unit, socket, sandbox and syscall filter) under systemd", func() (string, error) {
		var err error
		if repo, err = newUpgradeRepo(ctx, root.Deb); err != nil {
			return "", err
		}
		sb, err := s.env.Lab.DebianImage(ctx, root, map[string]string{"/etc/vco-agent/config.yaml": systemGuestConfig})
		if err != nil {
			return "", err
		}
		gs, err := s.env.Lab.StartSystemGuests(ctx, sb, lab.GuestConfig{Name: SystemGuest, MemMB: 768, Forwards: []lab.Forward{repo.forward()}})
		if err != nil {
			return "", err
		}
		g = gs[0]
		id, err := s.env.Sim.AddVM("cs-"+simlab.Location, g.Name, g.UUID, false)
		if err != nil {
			return "", err
		}
		s.env.VMs[g.Name] = id
		script := fmt.Sprintf(`set -e
systemctl is-active vco-agent.service vco-agent.socket
mkdir -p %[1]s
systemd-run --unit=vco-csi-node --quiet /usr/bin/vco-csi --mode=node --driver-name %[2]s --endpoint unix://%[3]s --agent-socket %[4]s --kubelet-root %[1]s
i=0; while [ ! -S %[3]s ]; do i=$((i+1)); [ $i -lt 600 ] || { journalctl -u vco-csi-node --no-pager; exit 1; }; sleep 0.1; done
dpkg-query -W -f='${Package} ${Version}' vco-agent`, simlab.KubeletRoot, simlab.DriverName, simlab.CSISocket, simlab.AgentSocket)
		out, err := g.MustSh(ctx, script)
		if err != nil {
			return "", err
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		return fmt.Sprintf("booted in %s; %s installed, agent and socket active; vco-csi node plugin running (VM %d)",
			g.BootTime.Round(time.Second), lines[len(lines)-1], id), nil
	}); err != nil {
		return nil, err
	}
	if err := s.step(sc, g.Name, "NodeGetInfo", func() (string, error) {
		var resp csi.NodeGetInfoResponse
		if err := simlab.NodeCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &resp); err != nil {
			return "", err
		}
		if !strings.EqualFold(resp.NodeId, g.UUID) {
			return "", fmt.Errorf("node id %s is not the guest's SMBIOS UUID %s", resp.NodeId, g.UUID)
		}
		s.ids[g.Name] = resp.NodeId
		return "node id " + resp.NodeId, nil
	}); err != nil {
		return nil, err
	}
	nrestarts := func(ctx context.Context) (int, error) {
		out, err := g.MustSh(ctx, "systemctl show -p NRestarts --value vco-agent.service")
		if err != nil {
			return 0, err
		}
		return strconv.Atoi(strings.TrimSpace(out))
	}
	base, err := nrestarts(ctx)
	if err != nil {
		return nil, err
	}
	return &e9Node{g: g, how: "systemd", repo: repo,
		burst: func(ctx context.Context) (string, error) {
			// Each kill waits for a new main process that systemd reports
			// active (READY=1), so no two kills hit the same agent.
			script := fmt.Sprintf(`pid() { systemctl show -p MainPID --value vco-agent.service; }
back() { j=0; until [ "$(pid)" != "$1" ] && [ "$(pid)" != 0 ] && systemctl is-active --quiet vco-agent.service; do
	j=$((j+1)); [ $j -lt 600 ] || { systemctl status --no-pager vco-agent.service vco-agent.socket; exit 1; }; sleep 0.05; done; }
last=0
for i in $(seq %d); do back $last; last=$(pid); kill -9 $last; done
back $last
systemctl is-active vco-agent.service vco-agent.socket >/dev/null
systemctl show -p StartLimitBurst -p StartLimitIntervalUSec vco-agent.service | tr '\n' ' '`, burstKills)
			start := time.Now()
			out, err := g.MustSh(ctx, script)
			if err != nil {
				return "", fmt.Errorf("systemd did not bring vco-agent back: %w", err)
			}
			return fmt.Sprintf("%d kills in %s, the agent back after each; agent and socket active (unit: %s)",
				burstKills, time.Since(start).Round(100*time.Millisecond), strings.TrimSpace(out)), nil
		},
		ready: "i=0; until systemctl is-active --quiet vco-agent.service; do i=$((i+1)); [ $i -lt 300 ] || exit 1; sleep 0.1; done",
		restarts: func(ctx context.Context) (int, error) {
			n, err := nrestarts(ctx)
			return n - base, err
		},
		agentLog: func(ctx context.Context) (string, error) {
			// The agent logs to the journal natively: its attributes are
			// fields (VOLUME, FORMATTED), not text.
			out, err := g.MustSh(ctx, "journalctl -u vco-agent.service -o json --output-fields=MESSAGE,VOLUME,FORMATTED --no-pager MESSAGE='volume staged'")
			if err != nil {
				return "", err
			}
			var b strings.Builder
			for _, l := range strings.Split(out, "\n") {
				var f struct{ MESSAGE, VOLUME, FORMATTED string }
				if json.Unmarshal([]byte(l), &f) == nil && f.MESSAGE != "" {
					fmt.Fprintf(&b, "%s volume=%s formatted=%s\n", f.MESSAGE, f.VOLUME, f.FORMATTED)
				}
			}
			return b.String(), nil
		},
	}, nil
}
