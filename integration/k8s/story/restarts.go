package story

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// k12: the node's own parts restart under write load. Two pods on one
// worker write a numbered record with an fsync each, one on a disk of the
// cluster's kind and one on a virtio-blk disk (the on-disk lease), so a
// scsi-block cluster tries reservations and the lease at once. The kubelet
// is restarted (systemctl restart kubelet), then the agent (systemctl
// restart vco-agent), then the node plugin's pod is deleted. After each:
// no write failed, the records go on, nothing was fenced; the kubelet's
// repeated NodeStageVolume calls are answered as already done (the path
// where a repeated stage must never release a fence); the agent's and the
// plugin's metrics count no error.
func (s *story) k12(ctx context.Context) error {
	const sc = "K12"
	node := s.c.Env.Lab.Guests[0]
	var ws []fsyncPod
	if err := s.step(sc, node.Name, "two writers with an fsync per record: one on the cluster's disk kind, one on a virtio-blk disk (the on-disk lease)", func() (string, error) {
		var err error
		ws, err = s.k12Writers(ctx, node)
		if err != nil {
			return "", err
		}
		return s.k12Fencing(ctx, node, ws)
	}); err != nil {
		return err
	}
	restarts := []struct {
		what string
		do   func(context.Context, *lab.Guest) (string, error)
	}{
		{"systemctl restart kubelet", s.restartKubelet},
		{"systemctl restart vco-agent", s.restartAgent},
		{"the node plugin's pod deleted", s.restartNodePlugin},
	}
	// What the node counted before K12 (another scenario's refusals,
	// say) is not K12's.
	base, err := s.nodeMetrics(ctx, node)
	if err != nil {
		return err
	}
	for _, r := range restarts {
		if err := s.step(sc, node.Name, r.what+" while both write: no write fails, the records go on, nothing fenced, no error counted", func() (string, error) {
			return s.k12Restart(ctx, sc, node, ws, base, r.do)
		}); err != nil {
			return err
		}
	}
	return s.step(sc, node.Name, "each volume holds every record in order; the writers and their claims go", func() (string, error) {
		return s.k12Records(ctx, sc, node, ws)
	})
}

// fsyncPod is a pod running fsyncWriter (K12's two, K10's) and its claim.
type fsyncPod struct {
	name string // the claim's, the pod's and its app label's
	pod  podInfo
	pv   string
	h    string // the volume handle
}

// k12Pod is a claim and a writer pod (fsyncWriter) pinned to node.
func k12Pod(name, node string) string {
	return pvc(name, "1Gi") + fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata:
  name: %[1]s
  labels: {app: %[1]s}
spec:
%[2]s`, name, fsyncWriter(name, "nodeSelector: {kubernetes.io/hostname: "+node+"}\n", "  "))
}

// k12Writers starts K12's two writers on node (fsyncWriters, bare pods).
func (s *story) k12Writers(ctx context.Context, node *lab.Guest) ([]fsyncPod, error) {
	return s.fsyncWriters(ctx, node, "k12", k12Pod)
}

// fsyncWriters starts two writers on node, each with its claim, made by
// spec (name, node): prefix-a on the cluster's disk kind, then prefix-b
// with the lab showing new disks as virtio-blk while it is provisioned
// and attached.
func (s *story) fsyncWriters(ctx context.Context, node *lab.Guest, prefix string, spec func(name, node string) string) ([]fsyncPod, error) {
	var ws []fsyncPod
	for _, name := range []string{prefix + "-a", prefix + "-b"} {
		if name == prefix+"-b" {
			prev := s.c.Env.Backend.SetDefaultKind(lab.VirtioBlk)
			defer s.c.Env.Backend.SetDefaultKind(prev)
		}
		if err := s.apply(ctx, spec(name, node.Name)); err != nil {
			return nil, err
		}
		ps, err := s.waitPods(ctx, "app="+name, 10*time.Minute, name+" Ready on "+node.Name, allReady(1))
		if err != nil {
			return nil, err
		}
		w := fsyncPod{name: name, pod: ps[0]}
		if w.pv, err = s.pvOf(ctx, name); err != nil {
			return nil, err
		}
		if w.h, err = s.handle(ctx, w.pv); err != nil {
			return nil, err
		}
		ws = append(ws, w)
	}
	return ws, nil
}

// k12Fencing checks with `vco-agent disks` that the two volumes are held,
// the second by the on-disk lease, and says by what.
func (s *story) k12Fencing(ctx context.Context, node *lab.Guest, ws []fsyncPod) (string, error) {
	out, err := node.MustSh(ctx, "vco-agent disks --json")
	if err != nil {
		return "", err
	}
	var resp struct {
		Disks []struct {
			Volume  string `json:"volume_id"`
			Fencing string `json:"fencing"`
			State   string `json:"state"`
		} `json:"disks"`
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil {
		return "", fmt.Errorf("vco-agent disks --json printed %q: %w", lab.LastLines(out, 5), err)
	}
	var got []string
	for i, w := range ws {
		found := ""
		for _, d := range resp.Disks {
			if d.Volume == w.h {
				found = d.Fencing + " " + d.State
			}
		}
		if found == "" {
			return "", fmt.Errorf("vco-agent disks on %s does not list %s's volume %s: %s", node.Name, w.name, w.h, out)
		}
		if !strings.HasSuffix(found, " CLAIM_STATE_HELD") || i == 1 && !strings.HasPrefix(found, "FENCING_METHOD_DISK_LEASE ") {
			return "", fmt.Errorf("%s's volume %s is %q on %s, not held (the second by the on-disk lease)", w.name, w.h, found, node.Name)
		}
		got = append(got, fmt.Sprintf("%s: %s (%s)", w.name, w.h, found))
	}
	return strings.Join(got, "; "), nil
}

// k12Restart does one restart on node and checks what K12 promises of it.
func (s *story) k12Restart(ctx context.Context, sc string, node *lab.Guest, ws []fsyncPod, base map[string]float64, do func(context.Context, *lab.Guest) (string, error)) (string, error) {
	before, err := s.lastRecords(ctx, node, ws)
	if err != nil {
		return "", err
	}
	stagesBefore, _ := s.nodeStages(ctx, node)
	since := time.Now().Add(-2 * time.Second).Unix()
	began := time.Now()
	what, err := do(ctx, node)
	if err != nil {
		return "", err
	}
	back := time.Since(began)
	// The records must go on past the restart: 20 more each (about 4 s
	// of writing at the writers' pace, longer on a slow worker).
	var after []int
	if err := k8s.WaitFor(ctx, 3*time.Minute, "both writers 20 records on", func() (bool, string, error) {
		after, err = s.lastRecords(ctx, node, ws)
		if err != nil {
			return false, err.Error(), nil
		}
		return after[0] >= before[0]+20 && after[1] >= before[1]+20, fmt.Sprint(before, after), nil
	}); err != nil {
		return "", err
	}
	failed, err := s.failedWrites(ctx, node, ws)
	if err != nil {
		return "", err
	}
	s.check(e2e.P5, sc, failed == "", "K12: writes failed while %s: %q", what, failed)
	if failed != "" {
		return "", fmt.Errorf("writes failed while %s: %s", what, failed)
	}
	fenced, err := s.fencedOn(ctx, node, ws)
	if err != nil {
		return "", err
	}
	if fenced != "" {
		return "", fmt.Errorf("%s: %s", what, fenced)
	}
	errs, err := s.nodeErrors(ctx, node, base)
	if err != nil {
		return "", err
	}
	if errs != "" {
		return "", fmt.Errorf("after %s the metrics count errors: %s", what, errs)
	}
	again := ""
	if strings.Contains(what, "kubelet") {
		if again, err = s.k12StagedAgain(ctx, node, ws, since, stagesBefore); err != nil {
			return "", err
		}
	}
	return fmt.Sprintf("%s; back in %.1fs; records %v -> %v, no write failed, nothing fenced, no error counted%s", what, back.Seconds(), before, after, again), nil
}

// k12StagedAgain checks that the kubelet staged both volumes again after
// its restart and that the agent answered each as already staged.
func (s *story) k12StagedAgain(ctx context.Context, node *lab.Guest, ws []fsyncPod, since int64, stagesBefore float64) (string, error) {
	var logged []int
	err := k8s.WaitFor(ctx, 2*time.Minute, "the agent's 'volume already staged' for both volumes", func() (bool, string, error) {
		logged = logged[:0]
		for _, w := range ws {
			// The agent logs to the journal natively: the volume is
			// the record's VOLUME field (agent/logging).
			out, err := node.MustSh(ctx, fmt.Sprintf("journalctl -t vco-agent VOLUME=%s --since @%d --no-pager -o cat | grep -c '^volume already staged$' || true", w.h, since))
			if err != nil {
				return false, err.Error(), nil
			}
			n, _ := strconv.Atoi(strings.TrimSpace(out))
			logged = append(logged, n)
		}
		return !slices.Contains(logged, 0), fmt.Sprint(logged), nil
	})
	stages, serr := s.nodeStages(ctx, node)
	if err != nil {
		return "", fmt.Errorf("%w (NodeStageVolume answered OK by the node plugin: %v before the restart, %v now)", err, stagesBefore, stages)
	}
	if serr != nil {
		return "", serr
	}
	return fmt.Sprintf("; the kubelet staged again (NodeStageVolume OK %v -> %v), the agent answered %v times 'volume already staged'", stagesBefore, stages, logged), nil
}

// lastRecords is the last record number each writer wrote.
func (s *story) lastRecords(ctx context.Context, node *lab.Guest, ws []fsyncPod) ([]int, error) {
	var l []int
	for _, w := range ws {
		out, err := node.MustSh(ctx, "cat "+emptyDir(w.pod.UID, "status")+"/last")
		if err != nil {
			return nil, err
		}
		n, err := strconv.Atoi(strings.TrimSpace(out))
		if err != nil {
			return nil, fmt.Errorf("%s's last record: %q", w.name, out)
		}
		l = append(l, n)
	}
	return l, nil
}

// failedWrites is what the writers noted of failed writes, empty if none.
func (s *story) failedWrites(ctx context.Context, node *lab.Guest, ws []fsyncPod) (string, error) {
	var b strings.Builder
	for _, w := range ws {
		dir := emptyDir(w.pod.UID, "status")
		out, err := node.MustSh(ctx, fmt.Sprintf("if [ -s %[1]s/failed ]; then head -3 %[1]s/failed; cat %[1]s/dd; fi", dir))
		if err != nil {
			return "", err
		}
		if out = strings.TrimSpace(out); out != "" {
			fmt.Fprintf(&b, "%s: %s; ", w.name, strings.ReplaceAll(out, "\n", " | "))
		}
	}
	return b.String(), nil
}

// k12Records checks each volume's records (1..n, in order, none twice),
// then deletes the writers and their claims.
func (s *story) k12Records(ctx context.Context, sc string, node *lab.Guest, ws []fsyncPod) (string, error) {
	var got []string
	for _, w := range ws {
		out, err := node.MustSh(ctx, "cat "+volumeMount(w.pod.UID, w.pv)+"/seq")
		if err != nil {
			return "", err
		}
		rs, bad := records(out)
		n := len(rs)
		s.check(e2e.P5, sc, bad == "", "K12: %s's volume holds records 1..%d in order after the restarts (%s)", w.name, n, bad)
		if bad != "" {
			return "", fmt.Errorf("%s's volume %s: %s", w.name, w.pv, bad)
		}
		got = append(got, fmt.Sprintf("%s: records 1..%d", w.name, n))
	}
	for _, w := range ws {
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pod", w.name, "--wait=true"); err != nil {
			return "", err
		}
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", w.name, "--wait=false"); err != nil {
			return "", err
		}
	}
	return strings.Join(got, "; "), nil
}

// emptyDir is where the kubelet keeps pod uid's emptyDir volume name.
func emptyDir(uid, name string) string {
	return fmt.Sprintf("/var/lib/kubelet/pods/%s/volumes/kubernetes.io~empty-dir/%s", uid, name)
}

// fencedOn says which of the writers' volumes node's agent fenced,
// refused or released (its DiskFenced, DiskRefused and DiskReleased
// events), empty if none.
func (s *story) fencedOn(ctx context.Context, node *lab.Guest, ws []fsyncPod) (string, error) {
	evs, err := nodeEvents(ctx, node)
	if err != nil {
		return "", err
	}
	var bad []string
	for _, ev := range evs {
		for _, w := range ws {
			if ev.Volume == w.h && slices.Contains([]string{"DiskFenced", "DiskRefused", "DiskReleased"}, ev.Name()) {
				bad = append(bad, ev.Name()+" "+w.h+": "+ev.Message)
			}
		}
	}
	return strings.Join(bad, "; "), nil
}

// fsyncWriter is a pod spec, indented by indent, whose container appends
// 32-byte records "N NODE" to /data/seq on claim, with an fsync each, N
// going on from the records already there (so a pod that replaces another
// on another node continues its count). A write that fails is noted in
// /status/failed (an emptyDir, readable on the node when the volume is
// not) and tried again; /status/last holds the last N written. extra is
// more of the spec (unindented).
func fsyncWriter(claim, extra, indent string) string {
	spec := fmt.Sprintf(`terminationGracePeriodSeconds: 2
%scontainers:
  - name: writer
    image: %s
    env:
      - name: NODE
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    command:
      - sh
      - -c
      - |
        i=$(( $(stat -c %%s /data/seq 2>/dev/null || echo 0) / 32 ))
        while :; do
          if printf '%%010d %%20s\n' $((i+1)) "$NODE" | dd of=/data/seq bs=32 oflag=append conv=notrunc,fsync 2>/status/dd; then
            i=$((i+1)); echo $i >/status/last
          else
            echo "$((i+1)) $(date +%%s)" >>/status/failed
          fi
          sleep 0.2
        done
    volumeMounts:
      - {name: data, mountPath: /data}
      - {name: status, mountPath: /status}
volumes:
  - name: data
    persistentVolumeClaim: {claimName: %s}
  - name: status
    emptyDir: {}
`, extra, WorkloadImage, claim)
	var b strings.Builder
	for _, l := range strings.SplitAfter(spec, "\n") {
		if l != "" {
			b.WriteString(indent + l)
		}
	}
	return b.String()
}
