package story

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// k6: the claim of K4's pod grows with kubectl patch. With file-backed
// virtio-blk disks (simlab.FileVirtioBlk) the disk grows under the running
// pod (QEMU's block_resize) and the filesystem the pod sees grows without
// a restart. The lab cannot grow an iSCSI LUN (scsi-block, virtio-blk)
// while a guest is logged in to it (tgtd fixes its size when it opens it),
// so there K6 grows the claim while it is not in use (the Deployment
// scaled to none): the controller grows the disk and the next stage grows
// the filesystem.
func (s *story) k6(ctx context.Context) error {
	const sc = "K6"
	ps, err := s.pods(ctx, "app=k4")
	if err != nil {
		return err
	}
	if len(ps) != 1 || !ps[0].Ready {
		return fmt.Errorf("K6 needs K4's pod running: %+v", ps)
	}
	p := ps[0]
	pv, err := s.pvOf(ctx, "k4")
	if err != nil {
		return err
	}
	before, err := s.k6Size(ctx, p, pv)
	if err != nil {
		return err
	}
	if s.r.Kind != string(simlab.FileVirtioBlk) {
		s.r.NotRun = append(s.r.NotRun, "K6 online on "+s.r.Kind+": the lab's tgtd cannot grow an iSCSI LUN a guest is logged in to; K6 grows the claim while it is not in use here, and under the running pod with file-backed virtio-blk disks (-kind "+string(simlab.FileVirtioBlk)+")")
		return s.step(sc, "cluster", "kubectl patch pvc k4 to 2Gi while it is not in use (scaled to none); the next pod sees the larger filesystem and its data", func() (string, error) {
			return s.k6Offline(ctx, pv, before)
		})
	}
	return s.step(sc, p.Node, "kubectl patch pvc k4 to 2Gi: the running pod's filesystem grows", func() (string, error) {
		return s.k6Online(ctx, p, pv, before)
	})
}

// k6Size is the size of the filesystem of pv in pod p.
func (s *story) k6Size(ctx context.Context, p podInfo, pv string) (int64, error) {
	out, err := s.c.Env.Lab.Guest(p.Node).MustSh(ctx, "df -B1 --output=size "+volumeMount(p.UID, pv)+" | tail -n1")
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(out), 10, 64)
}

// k6Patch asks for 2Gi in claim k4.
func (s *story) k6Patch(ctx context.Context) error {
	_, err := s.c.Kubectl(ctx, "-n", Namespace, "patch", "pvc", "k4", "--type=merge", "-p", `{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}`)
	return err
}

// k6Grown waits until the claim reports 2Gi and the filesystem of pv in
// the pod k4 has (then) more than 1.5 GiB.
func (s *story) k6Grown(ctx context.Context, pv, what string) (podInfo, int64, error) {
	var after int64
	var now podInfo
	err := k8s.WaitFor(ctx, 5*time.Minute, what, func() (bool, string, error) {
		ps, err := s.pods(ctx, "app=k4")
		if err != nil || len(ps) != 1 || !ps[0].Ready {
			return false, fmt.Sprintf("pods %+v %v", ps, err), nil
		}
		now = ps[0]
		if after, err = s.k6Size(ctx, now, pv); err != nil {
			return false, err.Error(), nil
		}
		capacity, _ := s.c.Kubectl(ctx, "-n", Namespace, "get", "pvc", "k4", "-o", "jsonpath={.status.capacity.storage}")
		return after > 3<<29 && strings.TrimSpace(capacity) == "2Gi", fmt.Sprintf("filesystem %d bytes, claim capacity %q", after, capacity), nil
	})
	if err != nil {
		ev, _ := s.c.Kubectl(ctx, "-n", Namespace, "get", "events", "--field-selector", "involvedObject.name=k4")
		return now, 0, fmt.Errorf("%w\nevents of the claim:\n%s", err, lab.LastLines(ev, 10))
	}
	return now, after, nil
}

// k6Offline grows claim k4 while it is not in use: scaled to none, the
// disk grown by the controller, the next pod on the larger filesystem
// with its data; before is the filesystem's size first.
func (s *story) k6Offline(ctx context.Context, pv string, before int64) (string, error) {
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "scale", "deployment", "k4", "--replicas=0"); err != nil {
		return "", err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, "claim k4 detached", func() (bool, string, error) {
		va, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o", "jsonpath={range .items[?(@.spec.source.persistentVolumeName==\""+pv+"\")]}{.spec.nodeName} {end}")
		return err == nil && strings.TrimSpace(va) == "", va, nil
	}); err != nil {
		return "", err
	}
	if err := s.k6Patch(ctx); err != nil {
		return "", err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, "the disk grown by the controller", func() (bool, string, error) {
		st, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={.spec.capacity.storage}")
		return err == nil && strings.TrimSpace(st) == "2Gi", st, nil
	}); err != nil {
		return "", err
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "scale", "deployment", "k4", "--replicas=1"); err != nil {
		return "", err
	}
	now, after, err := s.k6Grown(ctx, pv, "the next k4 pod on a filesystem past 1.5 GiB")
	if err != nil {
		return "", err
	}
	data, err := s.readLog(ctx, now, pv)
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(data, "written-on-") || strings.Count(data, "\n") < 2 {
		return "", fmt.Errorf("after growing, the volume holds %q", data)
	}
	return fmt.Sprintf("filesystem %d -> %d bytes; pod %s on %s holds %q", before, after, now.Name, now.Node, data), nil
}

// k6Online grows claim k4 under its running pod p: the same pod sees the
// larger filesystem; before is the filesystem's size first.
func (s *story) k6Online(ctx context.Context, p podInfo, pv string, before int64) (string, error) {
	if err := s.k6Patch(ctx); err != nil {
		return "", err
	}
	now, after, err := s.k6Grown(ctx, pv, "the filesystem of pod "+p.Name+" grown past 1.5 GiB")
	if err != nil {
		return "", err
	}
	if now.UID != p.UID {
		return "", fmt.Errorf("the pod was replaced during the expansion: %s (was %s)", now.UID, p.UID)
	}
	data, err := s.readLog(ctx, now, pv)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("filesystem %d -> %d bytes in pod %s (not restarted); its data %q", before, after, p.Name, data), nil
}
