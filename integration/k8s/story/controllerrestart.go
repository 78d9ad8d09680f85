package story

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

// k13Replicas is how many claims K13 provisions and attaches at once.
const k13Replicas = 20

// k13: the controller's restarts. A StatefulSet of k13Replicas pods, a
// claim each, spread over both workers; the controller's pod is deleted
// while the claims are being provisioned and attached, and once more
// while one pod moves to the other worker. Every claim ends Bound, every
// pod Running with its data, no disk is attached to two VMs, the platform
// holds no disk that no PV names, and no VolumeAttachment is stuck.
func (s *story) k13(ctx context.Context) error {
	const sc = "K13"
	before := s.simDisks()
	if err := s.step(sc, "cluster", fmt.Sprintf("a StatefulSet of %d replicas, a claim each; the controller's pod deleted while they are provisioned and attached", k13Replicas), func() (string, error) {
		return s.k13Burst(ctx)
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "every claim Bound, every pod Running with its data; one disk per claim, attached to one VM, the VM of its pod's node; no VolumeAttachment stuck", func() (string, error) {
		return s.k13Judge(ctx, sc, before)
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "one pod moved to the other worker (its node cordoned, the pod deleted), the controller's pod deleted during the move", func() (string, error) {
		return s.k13Move(ctx, sc)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the StatefulSet and its claims deleted: the platform keeps none of their disks", func() (string, error) {
		return s.k13Cleanup(ctx, before)
	})
}

// simDisks is the set of disk ids the simulated platform holds.
func (s *story) simDisks() map[int64]bool {
	ids := map[int64]bool{}
	for id := range s.c.Env.Sim.Snapshot().Disks {
		ids[id] = true
	}
	return ids
}

// k13Burst applies the StatefulSet, deletes the controller's pod once the
// first claim is bound, and waits for every pod to be Ready.
func (s *story) k13Burst(ctx context.Context) (string, error) {
	if err := s.apply(ctx, statefulSet("k13", k13Replicas, "", `topologySpreadConstraints:
  - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app: k13}}}
`)); err != nil {
		return "", err
	}
	began := time.Now()
	bound := 0
	if err := k8s.WaitFor(ctx, 10*time.Minute, "a first k13 claim Bound", func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pvc", "-l", "app=k13", "-o", "jsonpath={range .items[*]}{.status.phase}{\" \"}{end}")
		if err != nil {
			return false, err.Error(), nil
		}
		bound = strings.Count(out, "Bound")
		return bound > 0, out, nil
	}); err != nil {
		return "", err
	}
	killed, err := s.deleteController(ctx)
	if err != nil {
		return "", err
	}
	if _, err := s.waitPods(ctx, "app=k13", 20*time.Minute, fmt.Sprintf("%d k13 pods Ready", k13Replicas), allReady(k13Replicas)); err != nil {
		return "", err
	}
	return fmt.Sprintf("controller pod %s deleted with %d of %d claims Bound; every pod Ready %.0fs after the apply", killed, bound, k13Replicas, time.Since(began).Seconds()), nil
}

// deleteController deletes the controller's pod (not waiting) and returns
// its name.
func (s *story) deleteController(ctx context.Context) (string, error) {
	name, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", "app.kubernetes.io/name=vco-csi-controller", "-o", "jsonpath={.items[0].metadata.name}")
	if err != nil {
		return "", err
	}
	name = strings.TrimSpace(name)
	_, err = s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "delete", "pod", name, "--wait=false")
	return name, err
}

// k13Judge checks K13's claims, pods, disks and VolumeAttachments.
func (s *story) k13Judge(ctx context.Context, sc string, before map[int64]bool) (string, error) {
	ps, err := s.pods(ctx, "app=k13")
	if err != nil {
		return "", err
	}
	nodes := map[string]int{}
	handles := map[string]string{}
	for _, p := range ps {
		pv, _, err := s.ownDisk(ctx, p, handles)
		if err != nil {
			return "", err
		}
		data, err := s.readLog(ctx, p, pv)
		if err != nil {
			return "", err
		}
		s.check(e2e.P5, sc, data == "written-on-"+p.Node, "K13: %s's volume holds %q", p.Name, data)
		if data != "written-on-"+p.Node {
			return "", fmt.Errorf("%s's volume holds %q", p.Name, data)
		}
		nodes[p.Node]++
	}
	if err := s.k13Disks(sc, before, handles); err != nil {
		return "", err
	}
	stuck, err := s.stuckAttachments(ctx)
	if err != nil {
		return "", err
	}
	if stuck != "" {
		return "", fmt.Errorf("VolumeAttachments stuck: %s", stuck)
	}
	return fmt.Sprintf("%d pods Running with their data (per node %v); %d disks, each attached to one VM; no VolumeAttachment stuck", len(ps), nodes, len(handles)), nil
}

// k13Disks checks the platform's disks made since before: one per claim
// (handles), none attached to two VMs.
func (s *story) k13Disks(sc string, before map[int64]bool, handles map[string]string) error {
	snap := s.c.Env.Sim.Snapshot()
	var made []int64
	for id, d := range snap.Disks {
		if before[id] {
			continue
		}
		made = append(made, id)
		s.check(e2e.P1, sc, len(d.Attachments) <= 1, "K13: disk %d is attached to %d VMs", id, len(d.Attachments))
		if len(d.Attachments) > 1 {
			return fmt.Errorf("disk %d is attached to %d VMs", id, len(d.Attachments))
		}
	}
	sort.Slice(made, func(i, j int) bool { return made[i] < made[j] })
	if len(made) != len(handles) {
		return fmt.Errorf("the platform made %d disks %v for %d claims (an orphan, or a claim without its disk)", len(made), made, len(handles))
	}
	for h, pod := range handles {
		id, err := diskOf(h)
		if err != nil {
			return err
		}
		if snap.Disks[id] == nil {
			return fmt.Errorf("%s's disk %s is not on the platform", pod, h)
		}
	}
	return nil
}

// stuckAttachments lists the VolumeAttachments not attached or being
// deleted, empty when none.
func (s *story) stuckAttachments(ctx context.Context) (string, error) {
	out, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o",
		`jsonpath={range .items[*]}{.metadata.name}|{.status.attached}|{.metadata.deletionTimestamp}{"\n"}{end}`)
	if err != nil {
		return "", err
	}
	var stuck []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Split(l, "|")
		if len(f) == 3 && (f[1] != "true" || f[2] != "") {
			stuck = append(stuck, l)
		}
	}
	return strings.Join(stuck, "; "), nil
}

// k13Move moves k13-0 to the other worker and deletes the controller's
// pod while its volume moves.
func (s *story) k13Move(ctx context.Context, sc string) (string, error) {
	ps, err := s.pods(ctx, "statefulset.kubernetes.io/pod-name=k13-0")
	if err != nil || len(ps) != 1 {
		return "", fmt.Errorf("k13-0: %+v %v", ps, err)
	}
	p := ps[0]
	pv, err := s.pvOf(ctx, "data-k13-0")
	if err != nil {
		return "", err
	}
	to := s.other(p.Node)
	if _, err := s.c.Kubectl(ctx, "cordon", p.Node); err != nil {
		return "", err
	}
	defer func() { _, _ = s.c.Kubectl(context.WithoutCancel(ctx), "uncordon", p.Node) }()
	began := time.Now()
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pod", "k13-0", "--wait=false"); err != nil {
		return "", err
	}
	killed, err := s.deleteController(ctx)
	if err != nil {
		return "", err
	}
	moved, err := s.waitPods(ctx, "statefulset.kubernetes.io/pod-name=k13-0", 10*time.Minute, "k13-0 Ready on "+to, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == to
	})
	if err != nil {
		return "", err
	}
	data, err := s.readLog(ctx, moved[0], pv)
	if err != nil {
		return "", err
	}
	want := "written-on-" + p.Node + "\nwritten-on-" + to
	s.check(e2e.P5, sc, data == want, "K13: k13-0 moved with the controller restarted holds %q", data)
	if data != want {
		return "", fmt.Errorf("k13-0's volume holds %q, want %q", data, want)
	}
	old, err := s.mountsOf(ctx, s.c.Env.Lab.Guest(p.Node), pv)
	if err != nil {
		return "", err
	}
	s.check(e2e.P1, sc, len(old) == 0, "K13: %s left %s (mounts there: %d) when k13-0 moved", pv, p.Node, len(old))
	if len(old) > 0 {
		return "", fmt.Errorf("%s still mounted on %s: %v", pv, p.Node, old)
	}
	return fmt.Sprintf("k13-0 from %s to %s in %.0fs, controller pod %s deleted during the move; its data intact", p.Node, to, time.Since(began).Seconds(), killed), nil
}

// k13Cleanup deletes the StatefulSet and its claims and waits until the
// platform holds none of the disks made since before.
func (s *story) k13Cleanup(ctx context.Context, before map[int64]bool) (string, error) {
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "statefulset", "k13", "--wait=true"); err != nil {
		return "", err
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "-l", "app=k13", "--wait=false"); err != nil {
		return "", err
	}
	var left []int64
	err := k8s.WaitFor(ctx, 10*time.Minute, "the platform without K13's disks", func() (bool, string, error) {
		left = left[:0]
		for id := range s.c.Env.Sim.Snapshot().Disks {
			if !before[id] {
				left = append(left, id)
			}
		}
		return len(left) == 0, fmt.Sprint(left), nil
	})
	if err != nil {
		return "", err
	}
	stuck, err := s.stuckAttachments(ctx)
	if err != nil {
		return "", err
	}
	if stuck != "" {
		return "", fmt.Errorf("VolumeAttachments stuck after the clean-up: %s", stuck)
	}
	return "every K13 disk deleted from the platform; no VolumeAttachment left stuck", nil
}
