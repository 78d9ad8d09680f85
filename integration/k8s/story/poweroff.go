package story

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// k5: the node of K4's pod is powered off (QMP stop); an operator marks
// it out of service (the node.kubernetes.io/out-of-service taint), so
// Kubernetes deletes its pod and detaches the volume; the pod comes up on
// the other worker with its data through the controller's grant. The old
// node, resumed, fences itself (DiskFenced) and none of its writes land.
//
// On scsi-block the target's reservation refuses the resumed node's
// writes. On virtio-blk a guest frozen while it holds the lease cannot be
// fenced by the lease (docs/fencing.md): the lab's story shows that disk
// kind with a holder that keeps running, and so K5 runs on scsi-block
// only.
func (s *story) k5(ctx context.Context) error {
	const sc = "K5"
	if s.r.Kind != string(lab.SCSIBlock) {
		s.r.NotRun = append(s.r.NotRun, "K5 on "+s.r.Kind+": a guest frozen by its hypervisor while it holds the lease resumes writing before its agent sees the lease taken; only a detach at the hypervisor or reservations (scsi-block) stop it (docs/fencing.md)")
		return nil
	}
	k4, err := s.k4Volume(ctx, sc)
	if err != nil {
		return err
	}
	old, pv, h, diskID := k4.pod, k4.pv, k4.handle, k4.disk
	dead := s.c.Env.Lab.Guest(old.Node)
	live := s.c.Env.Lab.Guest(s.other(old.Node))
	before, err := s.readLog(ctx, old, pv)
	if err != nil {
		return err
	}
	var dev string
	if err := s.step(sc, dead.Name, "power off: QMP stop (the pod's node)", func() (string, error) {
		return s.k5PowerOff(ctx, dead, diskID, &dev)
	}); err != nil {
		return err
	}
	resumed := false
	defer func() {
		if !resumed {
			_ = dead.Resume(context.WithoutCancel(ctx))
		}
		_, _ = s.c.Kubectl(context.WithoutCancel(ctx), "taint", "node", dead.Name, "node.kubernetes.io/out-of-service-")
	}()
	if err := s.step(sc, "cluster", dead.Name+" NotReady; the operator taints it out-of-service", func() (string, error) {
		return s.k5OutOfService(ctx, dead)
	}); err != nil {
		return err
	}
	var grant string
	if err := s.step(sc, live.Name, "the pod back on "+live.Name+" with its data, attached with a grant", func() (string, error) {
		return s.k5Back(ctx, sc, dead, live, pv, before, &grant)
	}); err != nil {
		return err
	}
	mark := "late-from-" + dead.Name
	if err := s.step(sc, dead.Name, "power on (QMP cont); it writes through its old mount and to the raw device", func() (string, error) {
		return s.k5LateWrites(ctx, sc, dead, old, pv, dev, mark, &resumed)
	}); err != nil {
		return err
	}
	if err := s.step(sc, dead.Name, "DiskFenced within 60s", func() (string, error) {
		return s.k5Fenced(ctx, sc, dead, h, dev)
	}); err != nil {
		return err
	}
	if err := s.step(sc, live.Name, "none of "+dead.Name+"'s writes landed", func() (string, error) {
		return s.k5NoneLanded(ctx, sc, dead, live, pv, diskID, mark)
	}); err != nil {
		return err
	}
	return s.step(sc, dead.Name, "its kubelet tears down the deleted pod's volume: nothing of it stays mounted; the taint is lifted", func() (string, error) {
		return s.k5TornDown(ctx, dead, pv)
	})
}

// k5PowerOff finds the disk on dead, sets dev to its device and stops the guest.
func (s *story) k5PowerOff(ctx context.Context, dead *lab.Guest, diskID int64, dev *string) (string, error) {
	d, err := dead.DiskBySerial(ctx, strconv.FormatInt(diskID, 10))
	if err != nil {
		return "", err
	}
	*dev = "/dev/" + d.Name
	return *dev + " held; stopped", dead.Pause(ctx)
}

// k5OutOfService waits for dead to be NotReady and taints it out of service.
func (s *story) k5OutOfService(ctx context.Context, dead *lab.Guest) (string, error) {
	if err := k8s.WaitFor(ctx, 5*time.Minute, dead.Name+" not Ready", func() (bool, string, error) {
		st, err := s.c.Kubectl(ctx, "get", "node", dead.Name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && strings.TrimSpace(st) != "True", st, nil
	}); err != nil {
		return "", err
	}
	out, err := s.c.Kubectl(ctx, "taint", "node", dead.Name, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute")
	return strings.TrimSpace(out), err
}

// k5Back waits for K4's pod on live, checks its data (before, then live's line) and the grant its VolumeAttachment carries, and sets grant.
func (s *story) k5Back(ctx context.Context, sc string, dead, live *lab.Guest, pv, before string, grant *string) (string, error) {
	ps, err := s.waitPods(ctx, "app=k4", 10*time.Minute, "k4 Ready on "+live.Name, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == live.Name
	})
	if err != nil {
		return "", err
	}
	data, err := s.readLog(ctx, ps[0], pv)
	if err != nil {
		return "", err
	}
	want := before + "\nwritten-on-" + live.Name
	s.check(e2e.P5, sc, data == want, "K5: after the takeover from powered-off %s the volume holds %q", dead.Name, data)
	if data != want {
		return "", fmt.Errorf("the volume holds %q, want %q", data, want)
	}
	if *grant, err = s.grantOf(ctx, pv, live.Name); err != nil {
		return "", err
	}
	s.check(e2e.P3, sc, *grant != "", "K5: the VolumeAttachment to %s carries the controller's grant %q", live.Name, *grant)
	if *grant == "" {
		return "", fmt.Errorf("no grant on the VolumeAttachment of %s to %s", pv, live.Name)
	}
	return fmt.Sprintf("%s on %s holds %q; grant %s", ps[0].Name, live.Name, data, *grant), nil
}

// k5LateWrites resumes dead (setting resumed) and has it write mark through its old mount of pv and to dev: both must fail.
func (s *story) k5LateWrites(ctx context.Context, sc string, dead *lab.Guest, old podInfo, pv, dev, mark string, resumed *bool) (string, error) {
	if err := dead.Resume(ctx); err != nil {
		return "", err
	}
	*resumed = true
	script := fmt.Sprintf("printf '%%s' '%s' > /tmp/marker; dd if=/tmp/marker of=%s/late.bin bs=4096 count=1 conv=fsync 2>&1; fs=$?; dd if=/tmp/marker of=%s bs=4096 count=1 seek=768 oflag=direct 2>&1; echo fs=$fs raw=$?",
		mark, volumeMount(old.UID, pv), dev)
	r, err := dead.Sh(ctx, script)
	if err != nil {
		return "", err
	}
	out := strings.TrimSpace(r.Stdout + r.Stderr)
	f := strings.Fields(out[strings.LastIndex(out, "\n")+1:])
	refused := len(f) == 2 && f[0] != "fs=0" && f[1] != "raw=0"
	s.check(e2e.P4, sc, refused, "K5: resumed %s's writes (its old mount, then %s): %s", dead.Name, dev, strings.ReplaceAll(out, "\n", "; "))
	if !refused {
		return out, fmt.Errorf("a write from %s succeeded after the takeover", dead.Name)
	}
	return out, nil
}

// k5Fenced waits for dead's DiskFenced event about volume h or device dev.
func (s *story) k5Fenced(ctx context.Context, sc string, dead *lab.Guest, h, dev string) (string, error) {
	var msg string
	err := k8s.WaitFor(ctx, time.Minute, "DiskFenced on "+dead.Name, func() (bool, string, error) {
		evs, err := nodeEvents(ctx, dead)
		if err != nil {
			return false, err.Error(), nil
		}
		for _, ev := range evs {
			if ev.Name() == "DiskFenced" && (ev.Volume == h || ev.Device == dev) {
				msg = ev.Message
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d events", len(evs)), nil
	})
	s.check(e2e.P4, sc, err == nil, "K5: %s emitted DiskFenced after resuming: %s", dead.Name, msg)
	return msg, err
}

// k5NoneLanded checks live's view of the volume and the disk for dead's mark.
func (s *story) k5NoneLanded(ctx context.Context, sc string, dead, live *lab.Guest, pv string, diskID int64, mark string) (string, error) {
	ps, err := s.pods(ctx, "app=k4")
	if err != nil || len(ps) != 1 {
		return "", fmt.Errorf("k4's pod: %+v %v", ps, err)
	}
	d, err := live.DiskBySerial(ctx, strconv.FormatInt(diskID, 10))
	if err != nil {
		return "", err
	}
	out, err := live.MustSh(ctx, fmt.Sprintf("ls %s; dd if=/dev/%s bs=4096 count=1 skip=768 iflag=direct 2>/dev/null | head -c %d", volumeMount(ps[0].UID, pv), d.Name, len(mark)))
	if err != nil {
		return "", err
	}
	landed := strings.Contains(out, mark) || strings.Contains(out, "late.bin")
	s.check(e2e.P1, sc, !landed, "K5: %s's volume after %s resumed: %q", live.Name, dead.Name, out)
	if landed {
		return "", fmt.Errorf("a write of %s landed: %q", dead.Name, out)
	}
	return strings.ReplaceAll(strings.TrimSpace(out), "\n", " "), nil
}

// k5TornDown waits until nothing of pv is mounted on dead and lifts the taint.
func (s *story) k5TornDown(ctx context.Context, dead *lab.Guest, pv string) (string, error) {
	var left []string
	err := k8s.WaitFor(ctx, 4*time.Minute, "no mount of "+pv+" left on "+dead.Name, func() (bool, string, error) {
		var err error
		if left, err = s.mountsOf(ctx, dead, pv); err != nil {
			return false, err.Error(), nil
		}
		return len(left) == 0, strings.Join(left, "; "), nil
	})
	if err != nil {
		out, _ := dead.MustSh(ctx, "journalctl -u kubelet --no-pager -n 15 2>&1 | cut -c1-300")
		return "", fmt.Errorf("%w\nkubelet on %s:\n%s", err, dead.Name, out)
	}
	if _, err := s.c.Kubectl(ctx, "taint", "node", dead.Name, "node.kubernetes.io/out-of-service-"); err != nil {
		return "", err
	}
	return "nothing of " + pv + " mounted on " + dead.Name, nil
}
