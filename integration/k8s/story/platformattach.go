package story

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// k8: the platform attaches K4's disk to the other worker's VM as well (a
// fault the real platform must never make). That worker's agent refuses
// the disk (read-only, nothing mounted, DiskRefused naming the holder),
// and the refusal reaches Kubernetes as an Event on its Node and on the
// claim.
func (s *story) k8(ctx context.Context) error {
	const sc = "K8"
	k4, err := s.k4Volume(ctx, sc)
	if err != nil {
		return err
	}
	holder, pv, h, diskID := k4.pod.Node, k4.pv, k4.handle, k4.disk
	intruder := s.c.Env.Lab.Guest(s.other(holder))
	cs := "cs-" + simlab.Location
	vm := s.c.Env.VMs[intruder.Name]
	if err := s.step(sc, "platform", fmt.Sprintf("fault allow_multi_attach; attach disk %d to %s's VM too", diskID, intruder.Name), func() (string, error) {
		s.c.Env.Sim.SetFaults(sim.Faults{AllowMultiAttach: true})
		return "", s.c.Env.Cloud.AttachDisk(ctx, cs, vm, diskID)
	}); err != nil {
		return err
	}
	defer func() {
		_ = s.c.Env.Cloud.DetachDisk(context.WithoutCancel(ctx), cs, vm, diskID)
		s.c.Env.Sim.SetFaults(sim.Faults{})
	}()
	serial := strconv.FormatInt(diskID, 10)
	var dev, holderKey string
	if err := s.step(sc, intruder.Name, "the agent refuses it: DiskRefused naming "+holder+", device read-only, nothing mounted", func() (string, error) {
		return s.k8Refused(ctx, sc, intruder, holder, pv, h, serial, &dev, &holderKey)
	}); err != nil {
		return err
	}
	about := func(it eventItem) bool {
		return (strings.Contains(it.Message, holder) || strings.Contains(it.Message, holderKey)) && (strings.Contains(it.Message, dev) || strings.Contains(it.Message, serial))
	}
	if err := s.step(sc, "cluster", "the refusal is an Event on Node "+intruder.Name+" naming the holder", func() (string, error) {
		return s.waitEvent(ctx, []string{"-A"}, "involvedObject.kind=Node,involvedObject.name="+intruder.Name+",reason=DiskRefused", about)
	}); err != nil {
		return err
	}
	// The intruder staged the claim's volume before (K4 moved its pod from
	// one worker to the other), so its node plugin knows the disk's claim:
	// the refusal is on the claim too, where `kubectl describe pvc` finds
	// it (by the claim's kind, name, namespace and uid).
	return s.step(sc, "cluster", "the refusal is an Event on claim k4: kubectl describe pvc shows it", func() (string, error) {
		uid, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pvc", "k4", "-o", "jsonpath={.metadata.uid}")
		if err != nil {
			return "", err
		}
		msg, err := s.waitEvent(ctx, []string{"-n", Namespace}, "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=k4,involvedObject.uid="+strings.TrimSpace(uid)+",reason=DiskRefused", about)
		if err != nil {
			return "", err
		}
		out, err := s.c.Kubectl(ctx, "-n", Namespace, "describe", "pvc", "k4")
		if err != nil {
			return "", err
		}
		i := strings.Index(out, "\nEvents:")
		if i < 0 || !strings.Contains(out[i:], "DiskRefused") || !strings.Contains(out[i:], "vco-csi") ||
			!(strings.Contains(out[i:], holder) || strings.Contains(out[i:], holderKey)) {
			return "", fmt.Errorf("kubectl describe pvc k4 does not show the refusal naming %s (%s):\n%s", holder, holderKey, lab.LastLines(out, 15))
		}
		return msg, nil
	})
}

// k8Refused waits for the disk (serial) on intruder and its refusal there, naming the holder by the key its agent claimed volume h with, and checks the device read-only and nothing of pv mounted; it sets dev and holderKey.
func (s *story) k8Refused(ctx context.Context, sc string, intruder *lab.Guest, holder, pv, h, serial string, dev, holderKey *string) (string, error) {
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	d, err := intruder.WaitDiskBySerial(wctx, serial)
	cancel()
	if err != nil {
		return "", err
	}
	*dev = "/dev/" + d.Name
	var refused *simlab.Event
	if err := k8s.WaitFor(ctx, 2*time.Minute, "DiskRefused for "+*dev+" on "+intruder.Name, func() (bool, string, error) {
		evs, err := nodeEvents(ctx, intruder)
		if err != nil {
			return false, err.Error(), nil
		}
		for i, ev := range evs {
			if ev.Name() == "DiskRefused" && (ev.Device == *dev || ev.Serial == serial) {
				refused = &evs[i]
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d events, none a refusal of %s", len(evs), *dev), nil
	}); err != nil {
		return "", err
	}
	ro, err := intruder.MustSh(ctx, "blockdev --getro "+*dev)
	if err != nil {
		return "", err
	}
	mounts, err := s.mountsOf(ctx, intruder, pv)
	if err != nil {
		return "", err
	}
	// The refusal names the holder by its fence key (and by node name
	// where the agent knows it): the key must be the one the holder's
	// agent claimed the volume with.
	if *holderKey, err = claimKey(ctx, s.c.Env.Lab.Guest(holder), h); err != nil {
		return "", err
	}
	named := refused.HolderKey == *holderKey && (refused.HolderNode == "" || refused.HolderNode == holder)
	held := named && strings.TrimSpace(ro) == "1" && len(mounts) == 0
	s.check(e2e.P2, sc, held, "K8: %s refused disk %s attached by the platform while %s (key %s) holds it: holder key %s node %q, %s read-only=%s, mounts %d: %s",
		intruder.Name, serial, holder, *holderKey, refused.HolderKey, refused.HolderNode, *dev, strings.TrimSpace(ro), len(mounts), refused.Message)
	if !held {
		return "", fmt.Errorf("refusal incomplete: holder key %q (the holder's is %q) node %q, read-only %q, mounts %v", refused.HolderKey, *holderKey, refused.HolderNode, ro, mounts)
	}
	return refused.Message, nil
}
