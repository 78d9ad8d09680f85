package story

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// k11: a worker with staged volumes reboots. Two StatefulSets of one
// replica pinned to the worker write a numbered record with an fsync each,
// one on a disk of the cluster's kind and one on a virtio-blk disk (the
// on-disk lease), as K12's writers do. The worker is rebooted from inside
// (systemctl reboot), then reset from the hypervisor (QMP system_reset),
// then, on the lease, stopped longer than the lease's fail bound F and
// its expiry before its reset. After each: the agent holds both volumes
// again (by the fences the cluster's kind and the lease give), each pod
// runs again on the same worker with every record it acknowledged before
// the reboot, and the agent fenced, refused or released neither volume
// (a reset longer than F ends with the worker taking its own lease back,
// not refusing its own disk). Each reboot is timed: the worker back, the
// pods Ready again.
func (s *story) k11(ctx context.Context) error {
	const sc = "K11"
	node := s.c.Env.Lab.Guests[0]
	var ws []fsyncPod
	if err := s.step(sc, node.Name, "two StatefulSets of one writer pinned here, an fsync per record: one on the cluster's disk kind, one on a virtio-blk disk (the on-disk lease)", func() (string, error) {
		var err error
		if ws, err = s.fsyncWriters(ctx, node, "k11", statefulWriter); err != nil {
			return "", err
		}
		return s.k12Fencing(ctx, node, ws)
	}); err != nil {
		return err
	}
	reboots := []struct {
		what string
		do   func(*lab.Guest, context.Context) error
	}{
		{"systemctl reboot", (*lab.Guest).Reboot},
		{"a hard reset (QMP system_reset)", (*lab.Guest).Reset},
		{"stopped 60 s (past the lease's fail bound and its expiry), then reset", stoppedThenReset(60 * time.Second)},
	}
	for _, r := range reboots {
		if err := s.step(sc, node.Name, r.what+": the agent holds both volumes again, each pod runs again here with every record it acknowledged, nothing fenced or refused", func() (string, error) {
			return s.k11Reboot(ctx, sc, node, ws, r.what, r.do)
		}); err != nil {
			return err
		}
	}
	return s.step(sc, node.Name, "the writers and their claims go", func() (string, error) {
		for _, w := range ws {
			if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "statefulset", w.name, "--wait=true"); err != nil {
				return "", err
			}
			if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", w.name, "--wait=false"); err != nil {
				return "", err
			}
		}
		return "deleted", nil
	})
}

// stoppedThenReset stops the guest's CPUs for d (the node hangs), then
// resets it and lets it run.
func stoppedThenReset(d time.Duration) func(*lab.Guest, context.Context) error {
	return func(g *lab.Guest, ctx context.Context) error {
		if err := g.Pause(ctx); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
		if err := g.Reset(ctx); err != nil {
			return err
		}
		return g.Resume(ctx)
	}
}

// statefulWriter is a StatefulSet of one fsyncWriter on claim name, pinned
// to node.
func statefulWriter(name, node string) string {
	return pvc(name, "1Gi") + fmt.Sprintf(`---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: %[1]s
spec:
  replicas: 1
  serviceName: %[1]s
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
%[2]s`, name, fsyncWriter(name, "nodeSelector: {kubernetes.io/hostname: "+node+"}\n", "      "))
}

// k11Reboot reboots node by do and checks what K11 promises of it.
func (s *story) k11Reboot(ctx context.Context, sc string, node *lab.Guest, ws []fsyncPod, what string, do func(*lab.Guest, context.Context) error) (string, error) {
	before, err := s.lastRecords(ctx, node, ws)
	if err != nil {
		return "", err
	}
	began := time.Now()
	if err := do(node, ctx); err != nil {
		return "", err
	}
	rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	reason, err := node.WaitReset(rctx)
	cancel()
	if err != nil {
		return "", err
	}
	if _, err := node.WaitBack(ctx, 5*time.Minute); err != nil {
		return "", err
	}
	back := time.Since(began)
	for i, w := range ws {
		p, err := s.waitPods(ctx, "app="+w.name, 10*time.Minute, w.name+" running again on "+node.Name, func(ps []podInfo) bool {
			return allReady(1)(ps) && ps[0].Node == node.Name && ps[0].Started.After(w.pod.Started)
		})
		if err != nil {
			out, _ := node.MustSh(ctx, "journalctl -u kubelet -u containerd --no-pager -n 60 2>&1 | grep -v -e MissingClusterDNS | cut -c1-400")
			return "", fmt.Errorf("%w\nkubelet and containerd on %s:\n%s", err, node.Name, out)
		}
		ws[i].pod = p[0]
	}
	ready := time.Since(began)
	kept, err := s.k11Kept(ctx, sc, node, ws, before)
	if err != nil {
		return "", err
	}
	held, err := s.k12Fencing(ctx, node, ws)
	if err != nil {
		return "", err
	}
	fenced, err := s.fencedOn(ctx, node, ws)
	if err != nil {
		return "", err
	}
	s.check(e2e.P5, sc, fenced == "", "K11 (%s): the agent fenced, refused or released none of the writers' volumes: %q", what, fenced)
	if fenced != "" {
		return "", fmt.Errorf("%s: %s", what, fenced)
	}
	return fmt.Sprintf("reset (%s); back in %.1fs, both pods Ready %.1fs after; %s; %s", reason, back.Seconds(), ready.Seconds(), kept, held), nil
}

// k11Kept checks that each writer's volume holds its records 1..n in
// order, n at least what it acknowledged before the reboot, and that the
// writer goes on.
func (s *story) k11Kept(ctx context.Context, sc string, node *lab.Guest, ws []fsyncPod, before []int) (string, error) {
	var got []string
	for i, w := range ws {
		out, err := node.MustSh(ctx, "cat "+volumeMount(w.pod.UID, w.pv)+"/seq")
		if err != nil {
			return "", err
		}
		rs, bad := records(out)
		ok := bad == "" && len(rs) >= before[i]
		s.check(e2e.P5, sc, ok, "K11: %s's volume holds records 1..%d in order after the reboot, %d acknowledged before it (%s)", w.name, len(rs), before[i], bad)
		if !ok {
			return "", fmt.Errorf("%s's volume %s: %d records (%s), %d acknowledged before the reboot", w.name, w.pv, len(rs), bad, before[i])
		}
		got = append(got, fmt.Sprintf("%s: records 1..%d (%d acknowledged before)", w.name, len(rs), before[i]))
	}
	return strings.Join(got, "; "), k8s.WaitFor(ctx, 2*time.Minute, "both writers writing again", func() (bool, string, error) {
		l, err := s.lastRecords(ctx, node, ws)
		if err != nil {
			return false, err.Error(), nil
		}
		return l[0] > before[0] && l[1] > before[1], fmt.Sprint(before, l), nil
	})
}
