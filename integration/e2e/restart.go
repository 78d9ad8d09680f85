package e2e

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// A killPoint is when the agent is killed during a call: as soon as a
// process of that name (a tool the agent runs for a step) appears, or, for
// "@D", D seconds after the call was made.
type killPoint string

// The stage points are the tools the agent runs (formatting on first use,
// probing the device after) and moments in between by time; the unstage
// points are moments by time (unmount, release and the record). A point
// the call outran is tried again, a timed one sooner, up to killTries times.
var (
	stageKills   = []killPoint{"mkfs.ext4", "blkid", "@0.8", "@0.4", "@0.2"}
	unstageKills = []killPoint{"@0.4", "@0.2", "@0.1", "@0.05", "@0"}
)

const killTries = 4

// sooner is the same kill point, half as long after the call.
func (k killPoint) sooner() killPoint {
	d, ok := strings.CutPrefix(string(k), "@")
	if !ok {
		return k
	}
	var f float64
	fmt.Sscanf(d, "%g", &f)
	return killPoint(fmt.Sprintf("@%g", f/2))
}

const killedMarker = "/run/e9-killed"

// arm starts, in g, a watcher that kills the agent with SIGKILL at k, and
// returns its pid.
func arm(ctx context.Context, g *lab.Guest, k killPoint) (string, error) {
	var body string
	if d, ok := strings.CutPrefix(string(k), "@"); ok {
		body = fmt.Sprintf("sleep %s; kill -9 $(pidof vco-agent) && echo %s >%s", d, k, killedMarker)
	} else {
		body = fmt.Sprintf("i=0; while [ $i -lt 20000 ]; do if pidof %s >/dev/null; then kill -9 $(pidof vco-agent) && echo %s >%s; exit 0; fi; i=$((i+1)); done", k, k, killedMarker)
	}
	out, err := g.MustSh(ctx, fmt.Sprintf("rm -f %s; ( %s ) >/dev/null 2>&1 & echo $!", killedMarker, body))
	return strings.TrimSpace(out), err
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

// e9: node-a's agent is killed with SIGKILL at each step of NodeStage and
// NodeUnstage of a volume of its own. The busybox guests have no systemd,
// so a shell loop restarts the agent on a failed exit as the packaged
// unit's Restart=on-failure does. Each retried call must succeed; the
// filesystem made on first use must be the one mounted every time after
// (same UUID: never formatted again) and the data written must read back.
func (s *story) e9(ctx context.Context) (err error) {
	const sc = "E9"
	c := *s
	c.name, c.pod, c.kind = "pvc-e2e-kill", "pod-kill-", lab.SCSIBlock
	g := s.a
	if err := s.step(sc, g.Name, "restart vco-agent under a restart-on-failure loop (no systemd in the guest)", func() (string, error) {
		if err := simlab.StopNodeStack(ctx, g); err != nil {
			return "", err
		}
		return "a shell loop stands in for systemd's Restart=on-failure",
			simlab.StartNodeStackWith(ctx, g, simlab.StackOptions{Supervise: true})
	}); err != nil {
		return err
	}
	s.r.NotRun = append(s.r.NotRun, "E9 in a systemd guest: the lab's guests run busybox; a shell loop restarts the killed agent as Restart=on-failure would")
	defer func() {
		rerr := s.step(sc, g.Name, "restart vco-agent unsupervised", func() (string, error) {
			if err := simlab.StopNodeStack(ctx, g); err != nil {
				return "", err
			}
			return "", simlab.StartNodeStack(ctx, g)
		})
		if err == nil {
			err = rerr
		}
	}()
	if err := s.step(sc, "controller", "CreateVolume pvc-e2e-kill (1 GiB, "+string(c.kind)+")", func() (string, error) {
		resp, err := s.ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: c.name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
			VolumeCapabilities: []*csi.VolumeCapability{volCap()},
			AccessibilityRequirements: &csi.TopologyRequirement{
				Preferred: []*csi.Topology{{Segments: map[string]string{driver.TopologyKey: simlab.Location}}},
			},
		})
		if err != nil {
			return "", err
		}
		c.volID = resp.Volume.VolumeId
		var id int64
		if _, err := fmt.Sscanf(c.volID[strings.Index(c.volID, "/")+1:], "%d", &id); err != nil {
			return "", fmt.Errorf("volume id %q names no disk id", c.volID)
		}
		c.diskID = id
		s.env.Backend.SetKind(c.diskID, c.kind)
		return "volume " + c.volID, nil
	}); err != nil {
		return err
	}
	pc, err := c.publish(ctx, sc, g)
	if err != nil {
		return err
	}
	if err := c.kubeletDirs(ctx, g, c.pod+g.Name); err != nil {
		return err
	}
	staging := stagingPath(c.name)
	stageReq := &csi.NodeStageVolumeRequest{VolumeId: c.volID, PublishContext: pc, StagingTargetPath: staging, VolumeCapability: volCap()}
	unstageReq := &csi.NodeUnstageVolumeRequest{VolumeId: c.volID, StagingTargetPath: staging}
	mountedDev := func() (string, error) {
		out, err := g.MustSh(ctx, fmt.Sprintf("awk '$2==\"%s\"{print $1}' /proc/mounts", staging))
		return strings.TrimSpace(out), err
	}
	var uuid, sum string
	kills := 0
	// stageAt stages with the agent killed at k, and checks what the
	// retried call left: mounted, the filesystem of first use, the data.
	stageAt := func(k killPoint) (killed bool, err error) {
		err = s.step(sc, g.Name, fmt.Sprintf("NodeStageVolume, agent killed at %s", k), func() (string, error) {
			pid, err := arm(ctx, g, k)
			if err != nil {
				return "", err
			}
			tries, err := retried(ctx, func() error { return simlab.NodeCall(ctx, g, "NodeStageVolume", stageReq, nil) })
			// A kill that lands only after the call answered (first try
			// succeeded) did not interrupt it: the point was outrun.
			killed = disarm(ctx, g, pid) && tries > 1
			if err != nil {
				return "", fmt.Errorf("NodeStageVolume still failing after %d tries (agent killed: %v): %w", tries, killed, err)
			}
			dev, err := mountedDev()
			if err != nil || dev == "" {
				return "", fmt.Errorf("staging path not mounted after NodeStageVolume succeeded (%v)", err)
			}
			out, err := g.MustSh(ctx, "blkid -s UUID -o value "+dev)
			if err != nil {
				return "", err
			}
			got := strings.TrimSpace(out)
			detail := fmt.Sprintf("agent killed mid-call: %v; succeeded on try %d; %s mounted, filesystem UUID %s", killed, tries, dev, got)
			if uuid == "" {
				uuid = got
				if sum, err = g.MustSh(ctx, fmt.Sprintf("dd if=/dev/urandom of=%[1]s/data.bin bs=1M count=4 2>/dev/null && sync && sha256sum %[1]s/data.bin", staging)); err != nil {
					return "", err
				}
				sum = strings.Fields(sum + " x")[0]
				return detail + "; wrote data.bin sha256 " + sum, nil
			}
			s.check(P5, sc, got == uuid, "after the agent was killed during NodeStageVolume (at %s) the filesystem mounted has UUID %s, the one made on first use %s", k, got, uuid)
			if got != uuid {
				return "", fmt.Errorf("filesystem UUID %s, made on first use %s: formatted again", got, uuid)
			}
			r, err := g.MustSh(ctx, "echo 3 >/proc/sys/vm/drop_caches; sha256sum "+staging+"/data.bin")
			if err != nil {
				return "", err
			}
			rs := strings.Fields(r + " x")[0]
			s.check(P5, sc, rs == sum, "after the agent was killed during NodeStageVolume (at %s) data.bin reads sha256 %s (written %s)", k, rs, sum)
			if rs != sum {
				return "", fmt.Errorf("data.bin sha256 %s, written %s", rs, sum)
			}
			return detail + "; data.bin intact", nil
		})
		return killed, err
	}
	unstageAt := func(k killPoint) (killed bool, err error) {
		err = s.step(sc, g.Name, fmt.Sprintf("NodeUnstageVolume, agent killed at %s", k), func() (string, error) {
			pid, err := arm(ctx, g, k)
			if err != nil {
				return "", err
			}
			tries, err := retried(ctx, func() error { return simlab.NodeCall(ctx, g, "NodeUnstageVolume", unstageReq, nil) })
			// A kill that lands only after the call answered (first try
			// succeeded) did not interrupt it: the point was outrun.
			killed = disarm(ctx, g, pid) && tries > 1
			if err != nil {
				return "", fmt.Errorf("NodeUnstageVolume still failing after %d tries (agent killed: %v): %w", tries, killed, err)
			}
			if dev, err := mountedDev(); err != nil || dev != "" {
				return "", fmt.Errorf("staging path still mounted from %q after NodeUnstageVolume succeeded (%v)", dev, err)
			}
			return fmt.Sprintf("agent killed mid-call: %v; succeeded on try %d; staging path unmounted", killed, tries), nil
		})
		return killed, err
	}
	plain := func(method string, req proto.Message) error {
		return s.step(sc, g.Name, method+" (the kill point was outrun; again)", func() (string, error) {
			_, err := retried(ctx, func() error { return simlab.NodeCall(ctx, g, method, req, nil) })
			return "", err
		})
	}
	// at runs one call with the agent killed at k, again with k sooner
	// while the call outruns it, and reports whether a kill landed.
	at := func(k killPoint, call func(killPoint) (bool, error), undo func() error) (bool, error) {
		for try := 1; ; try++ {
			killed, err := call(k)
			if err != nil || killed || try == killTries || !strings.HasPrefix(string(k), "@") {
				return killed, err
			}
			if err := undo(); err != nil {
				return false, err
			}
			k = k.sooner()
		}
	}
	var missed []killPoint
	for i := range stageKills {
		killed, err := at(stageKills[i], stageAt, func() error { return plain("NodeUnstageVolume", unstageReq) })
		if err != nil {
			return err
		}
		if killed {
			kills++
		} else {
			missed = append(missed, stageKills[i])
		}
		killed, err = at(unstageKills[i], unstageAt, func() error { return plain("NodeStageVolume", stageReq) })
		if err != nil {
			return err
		}
		if killed {
			kills++
		} else {
			missed = append(missed, "unstage "+unstageKills[i])
		}
	}
	if err := s.step(sc, g.Name, "the kills reached the agent; it formatted once", func() (string, error) {
		out, err := g.MustSh(ctx, "cat "+simlab.SupervisorExits+" 2>/dev/null; true")
		if err != nil {
			return "", err
		}
		restarts := strings.Count(out, "137")
		if len(missed) > 0 || restarts < kills {
			return "", fmt.Errorf("%d of %d kill points reached the agent mid-call (outrun: %v), %d restarts after SIGKILL", kills, len(stageKills)+len(unstageKills), missed, restarts)
		}
		log, err := g.MustSh(ctx, "grep 'volume staged' /var/log/vco-agent.log | grep -F '"+c.volID+"'")
		if err != nil {
			return "", err
		}
		formats := 0
		for _, l := range strings.Split(log, "\n") {
			if strings.Contains(l, "formatted=true") || strings.Contains(l, `"formatted":true`) {
				formats++
			}
		}
		s.check(P5, sc, formats == 1, "the agent, killed %d times during stage and unstage, reported formatting volume %s %d time(s) over %d stages", kills, c.volID, formats, len(stageKills))
		if formats != 1 {
			return "", fmt.Errorf("the agent logged %d formats of %s, want 1", formats, c.volID)
		}
		return fmt.Sprintf("%d kills, %d restarts after SIGKILL, one format", kills, restarts), nil
	}); err != nil {
		return err
	}
	if err := c.unpublish(ctx, sc, g); err != nil {
		return err
	}
	return s.step(sc, "controller", "DeleteVolume "+c.volID, func() (string, error) {
		_, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: c.volID})
		return "", err
	})
}
