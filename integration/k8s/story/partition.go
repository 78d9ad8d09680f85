package story

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// k10: a partition. The holder's node loses the API server: its kubelet
// and its node plugin are cut off, the node and its pod keep running and
// writing. The operator follows docs/troubleshooting.md ("A partitioned
// node"): the out-of-service taint once the node is NotReady. The pod
// comes up on the other worker with its data; the old node's writes
// after the takeover land nowhere (checked on the disk's backing file,
// not only in the new pod); when the partition heals, the old node's
// kubelet, node plugin and agent clean up by themselves. Each phase is
// timed.
func (s *story) k10(ctx context.Context) error {
	const sc = "K10"
	var held podInfo
	var pv string
	if err := s.step(sc, "cluster", "a Deployment of one writer with an fsync per record, on its claim", func() (string, error) {
		var err error
		held, pv, err = s.k10Start(ctx)
		return "Ready on " + held.Node, err
	}); err != nil {
		return err
	}
	old := s.c.Env.Lab.Guest(held.Node)
	live := s.c.Env.Lab.Guest(s.other(held.Node))
	healed := false
	defer s.undoPartition(ctx, old, &healed)
	if err := s.step(sc, old.Name, "partition: its traffic to the API server dropped; NotReady while its pod writes on", func() (string, error) {
		return s.k10Cut(ctx, old, held)
	}); err != nil {
		return err
	}
	var moved podInfo
	if err := s.step(sc, live.Name, "the operator taints "+old.Name+" out-of-service: the pod Running on "+live.Name+" with its data, attached with a grant", func() (string, error) {
		var err error
		var took time.Duration
		moved, took, err = s.k10Taint(ctx, sc, old, live, pv)
		return fmt.Sprintf("%s Ready on %s %.1fs after the taint", moved.Name, live.Name, took.Seconds()), err
	}); err != nil {
		return err
	}
	if err := s.step(sc, old.Name, "the old node's writes after the takeover land nowhere: not in the new pod's file, not on the disk", func() (string, error) {
		return s.k10NoneLanded(ctx, sc, old, held, moved, pv)
	}); err != nil {
		return err
	}
	if err := s.step(sc, old.Name, "the partition heals: its kubelet, node plugin and agent clean up by themselves", func() (string, error) {
		healed = true
		return s.k10Heal(ctx, old, live, pv)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the writer and its claim go", func() (string, error) {
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "deployment", "k10", "--wait=true"); err != nil {
			return "", err
		}
		_, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "k10", "--wait=false")
		return "deleted", err
	})
}

// undoPartition heals old's partition unless healed says it was, and
// lifts its out-of-service taint: what a scenario that cut old leaves
// done however it ends.
func (s *story) undoPartition(ctx context.Context, old *lab.Guest, healed *bool) {
	bg := context.WithoutCancel(ctx)
	if !*healed {
		_, _ = old.Sh(bg, healScript())
	}
	_, _ = s.c.Kubectl(bg, "taint", "node", old.Name, "node.kubernetes.io/out-of-service-")
}

// k10Start starts K10's writer Deployment and returns its pod and PV.
func (s *story) k10Start(ctx context.Context) (podInfo, string, error) {
	if err := s.apply(ctx, pvc("k10", "1Gi")+`---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: k10
spec:
  replicas: 1
  strategy: {type: Recreate}
  selector: {matchLabels: {app: k10}}
  template:
    metadata: {labels: {app: k10}}
    spec:
`+fsyncWriter("k10", "", "      ")); err != nil {
		return podInfo{}, "", err
	}
	ps, err := s.waitPods(ctx, "app=k10", 10*time.Minute, "k10 Ready", allReady(1))
	if err != nil {
		return podInfo{}, "", err
	}
	pv, err := s.pvOf(ctx, "k10")
	return ps[0], pv, err
}

// partitionRules are the iptables commands (op -I to cut, -D to heal)
// that drop a worker's traffic to the API server: its own (the kubelet)
// and its pods' (the node plugin), which the worker sends to the API
// server's address in place of the kubernetes service's (joinNode).
func partitionRules(op string) string {
	var b strings.Builder
	for _, chain := range []string{"OUTPUT", "FORWARD"} {
		fmt.Fprintf(&b, "iptables %s %s -d %s/32 -p tcp --dport %d -j DROP; ", op, chain, k8s.HostInGuest, k8s.GuestAPIPort)
	}
	return b.String() + "true"
}

// cutScript cuts a worker off the API server and keeps it cut across its
// reboots: its network applies k8s.PartitionFile at each boot.
func cutScript() string {
	return fmt.Sprintf("mkdir -p $(dirname %[1]s) && echo '%[2]s' >%[1]s && sync && sh %[1]s", k8s.PartitionFile, partitionRules("-I"))
}

// healScript heals cutScript's partition.
func healScript() string {
	return fmt.Sprintf("rm -f %s && sync; %s", k8s.PartitionFile, partitionRules("-D"))
}

// k10Cut cuts old off the API server and waits until it is NotReady,
// its pod still writing.
func (s *story) k10Cut(ctx context.Context, old *lab.Guest, held podInfo) (string, error) {
	w := []fsyncPod{{name: "k10", pod: held}}
	before, err := s.lastRecords(ctx, old, w)
	if err != nil {
		return "", err
	}
	began := time.Now()
	if _, err := old.MustSh(ctx, cutScript()); err != nil {
		return "", err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, old.Name+" NotReady", func() (bool, string, error) {
		st, err := s.c.Kubectl(ctx, "get", "node", old.Name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && strings.TrimSpace(st) != "True", st, nil
	}); err != nil {
		return "", err
	}
	notReady := time.Since(began)
	after, err := s.lastRecords(ctx, old, w)
	if err != nil {
		return "", err
	}
	if after[0] <= before[0] {
		return "", fmt.Errorf("the pod on %s stopped writing when the API server was cut (records %v -> %v)", old.Name, before, after)
	}
	return fmt.Sprintf("NotReady %.1fs after the cut; the pod wrote on (records %d -> %d)", notReady.Seconds(), before[0], after[0]), nil
}

// k10Taint taints old out-of-service and waits for the pod on live, its
// data there and the controller's grant on its VolumeAttachment.
func (s *story) k10Taint(ctx context.Context, sc string, old, live *lab.Guest, pv string) (podInfo, time.Duration, error) {
	began := time.Now()
	if _, err := s.c.Kubectl(ctx, "taint", "node", old.Name, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"); err != nil {
		return podInfo{}, 0, err
	}
	ps, err := s.waitPods(ctx, "app=k10", 10*time.Minute, "k10 Ready on "+live.Name, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == live.Name
	})
	if err != nil {
		return podInfo{}, 0, err
	}
	took := time.Since(began)
	grant, err := s.grantOf(ctx, pv, live.Name)
	if err != nil {
		return podInfo{}, 0, err
	}
	s.check(e2e.P3, sc, grant != "", "K10: the VolumeAttachment to %s carries the controller's grant %q", live.Name, grant)
	if grant == "" {
		return podInfo{}, 0, fmt.Errorf("no grant on the VolumeAttachment of %s to %s", pv, live.Name)
	}
	return ps[0], took, nil
}

// grantOf is the fence grant on pv's VolumeAttachment to node, empty if none.
func (s *story) grantOf(ctx context.Context, pv, node string) (string, error) {
	meta, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o",
		"jsonpath={range .items[?(@.spec.source.persistentVolumeName==\""+pv+"\")]}{.spec.nodeName} {.status.attachmentMetadata}{\"\\n\"}{end}")
	if err != nil {
		return "", err
	}
	return grantIn(meta, node), nil
}

// grantIn is the fence grant of node's line in lines of "NODE
// ATTACHMENT-METADATA-JSON", empty if none.
func grantIn(lines, node string) string {
	for _, l := range strings.Split(strings.TrimSpace(lines), "\n") {
		n, js, _ := strings.Cut(l, " ")
		var pc map[string]string
		if n == node && json.Unmarshal([]byte(js), &pc) == nil {
			return pc[driver.PubFenceGrant]
		}
	}
	return ""
}

// k10NoneLanded waits until the old node's writer sees its writes fail
// (or the old node resets, k10Stopped), then checks that none it made
// after the takeover landed: the records the new pod reads are the old
// node's up to where the new pod began, then the new node's; the old
// node's last acknowledged record is before that; and the disk's backing
// file holds no record of the old node past it.
func (s *story) k10NoneLanded(ctx context.Context, sc string, old *lab.Guest, held, moved podInfo, pv string) (string, error) {
	acked, how, err := s.k10Stopped(ctx, old, held)
	if err != nil {
		return "", err
	}
	out, err := s.c.Env.Lab.Guest(moved.Node).MustSh(ctx, "cat "+volumeMount(moved.UID, pv)+"/seq")
	if err != nil {
		return "", err
	}
	recs, bad := records(out)
	first := handover(recs, moved.Node)
	okFile := bad == "" && first > 0 && acked[0] < first
	s.check(e2e.P1, sc, okFile, "K10: the new pod's file: %d records, %s's first is %d, %s's last acknowledged write %d (%s)", len(recs), moved.Node, first, old.Name, acked[0], bad)
	if !okFile {
		return "", fmt.Errorf("the new pod reads %d records (%s), the new node's first is %d, the old node's last acknowledged %d", len(recs), bad, first, acked[0])
	}
	id, err := s.diskOfPV(ctx, pv)
	if err != nil {
		return "", err
	}
	late, err := lateRecords(s.c.Env.Backend.DiskFile(id), old.Name, first)
	if err != nil {
		return "", err
	}
	s.check(e2e.P1, sc, len(late) == 0, "K10: the disk's backing file holds no record of %s numbered %d or later (found %v)", old.Name, first, late)
	if len(late) > 0 {
		return "", fmt.Errorf("records of %s written after the takeover are on the disk: %v", old.Name, late)
	}
	return fmt.Sprintf("%s %s; its last acknowledged record %d, %s's first %d; none of %s's later records on the disk", old.Name, how, acked[0], moved.Node, first, old.Name), nil
}

// diskOfPV is the disk id of pv.
func (s *story) diskOfPV(ctx context.Context, pv string) (int64, error) {
	h, err := s.handle(ctx, pv)
	if err != nil {
		return 0, err
	}
	return diskOf(h)
}

// k10Heal drops old's partition and waits until nothing of pv is left
// there: no mount, no claim in its agent, no VolumeAttachment to it.
// Then it lifts the taint.
func (s *story) k10Heal(ctx context.Context, old, live *lab.Guest, pv string) (string, error) {
	h, err := s.handle(ctx, pv)
	if err != nil {
		return "", err
	}
	began := time.Now()
	if _, err := old.MustSh(ctx, healScript()); err != nil {
		return "", err
	}
	err = k8s.WaitFor(ctx, 5*time.Minute, "nothing of "+pv+" left on "+old.Name, func() (bool, string, error) {
		left, err := s.leftOn(ctx, old, pv, h)
		if err != nil {
			return false, err.Error(), nil
		}
		return left == "", left, nil
	})
	if err != nil {
		out, _ := old.MustSh(ctx, "journalctl -u kubelet --no-pager -n 15 2>&1 | cut -c1-300")
		return "", fmt.Errorf("%w\nkubelet on %s:\n%s", err, old.Name, out)
	}
	clean := time.Since(began)
	if _, err := s.c.Kubectl(ctx, "taint", "node", old.Name, "node.kubernetes.io/out-of-service-"); err != nil {
		return "", err
	}
	return fmt.Sprintf("clean %.1fs after the heal: nothing mounted, no claim in the agent, no VolumeAttachment to %s; taint lifted", clean.Seconds(), old.Name), nil
}

// leftOn says what of pv (handle h) is still on g: its mounts, its claim
// in g's agent, a VolumeAttachment to g; empty when nothing.
func (s *story) leftOn(ctx context.Context, g *lab.Guest, pv, h string) (string, error) {
	var left []string
	mounts, err := s.mountsOf(ctx, g, pv)
	if err != nil {
		return "", err
	}
	if len(mounts) > 0 {
		left = append(left, fmt.Sprintf("%d mounts", len(mounts)))
	}
	out, err := g.MustSh(ctx, "vco-agent disks --json")
	if err != nil {
		return "", err
	}
	if strings.Contains(out, `"volume_id":"`+h+`"`) || strings.Contains(out, `"volume_id": "`+h+`"`) {
		left = append(left, "a claim in the agent")
	}
	va, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o",
		"jsonpath={range .items[?(@.spec.source.persistentVolumeName==\""+pv+"\")]}{.spec.nodeName}{\" \"}{end}")
	if err != nil {
		return "", err
	}
	if strings.Contains(" "+va, " "+g.Name+" ") {
		left = append(left, "a VolumeAttachment")
	}
	return strings.Join(left, ", "), nil
}

// record is one of fsyncWriter's records.
type record struct {
	n    int
	node string
}

// records reads fsyncWriter's records and says what is wrong with them
// (empty when they are numbered 1..n in order).
func records(out string) ([]record, string) {
	var rs []record
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			return rs, fmt.Sprintf("record after %d is %q", len(rs), line)
		}
		i, err := strconv.Atoi(f[0])
		if err != nil || i != len(rs)+1 {
			return rs, fmt.Sprintf("record after %d is %q", len(rs), line)
		}
		rs = append(rs, record{i, f[1]})
	}
	if len(rs) == 0 {
		return nil, "no record"
	}
	return rs, ""
}

// handover is the number of node's first record, 0 if it has none, and
// -1 if a record of another node follows one of node's.
func handover(rs []record, node string) int {
	first := 0
	for _, r := range rs {
		switch {
		case r.node == node && first == 0:
			first = r.n
		case r.node != node && first != 0:
			return -1
		}
	}
	return first
}

// recordRE is one of fsyncWriter's records anywhere in a disk's bytes.
var recordRE = regexp.MustCompile(`(\d{10}) +([a-z0-9.-]{1,20})\n`)

// lateRecords scans the disk's backing file for records of node numbered
// from on or later: writes that landed after another node took the disk.
func lateRecords(file, node string, from int) ([]string, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var late []string
	r := bufio.NewReaderSize(f, 1<<20)
	buf := make([]byte, 1<<20)
	carry := []byte{}
	for {
		n, err := io.ReadFull(r, buf)
		chunk := append(carry, buf[:n]...)
		for _, m := range recordRE.FindAllSubmatch(chunk, -1) {
			i, _ := strconv.Atoi(string(m[1]))
			if string(m[2]) == node && i >= from && len(late) < 10 {
				late = append(late, string(m[1])+" "+node)
			}
		}
		if len(chunk) > 64 {
			carry = append([]byte{}, chunk[len(chunk)-64:]...)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return late, nil
		}
		if err != nil {
			return late, err
		}
	}
}

// k10Stopped waits until the old node's writer sees its writes fail, or
// the old node resets. On the lease (virtio-blk) the reset must come: the
// platform's unplugging of the disk fails the holder's renewals, a lease
// lost whose I/O cannot be shown stopped keeps the host watchdog unfed,
// and the host resets (docs/fencing.md, "Host watchdog"); the node is
// then waited for until it answers again, still cut off. It returns the
// writer's last acknowledged record (after a reset, the last one read
// before it) and what stopped it.
func (s *story) k10Stopped(ctx context.Context, old *lab.Guest, held podInfo) ([]int, string, error) {
	w := []fsyncPod{{name: "k10", pod: held}}
	acked, err := s.lastRecords(ctx, old, w)
	if err != nil {
		return nil, "", err
	}
	began, reason, failed := time.Now(), "", ""
	err = k8s.WaitFor(ctx, 3*time.Minute, "the writer on "+old.Name+" failing, or "+old.Name+" reset", func() (bool, string, error) {
		if reason = resetSeen(ctx, old); reason != "" {
			return true, "", nil
		}
		if l, err := s.lastRecords(ctx, old, w); err == nil {
			acked = l
		}
		f, err := s.failedWrites(ctx, old, w)
		failed = f
		return err == nil && f != "", f, nil
	})
	if err != nil {
		return nil, "", err
	}
	if reason == "" && s.r.Kind != string(lab.VirtioBlk) {
		return acked, "sees its writes fail", nil
	}
	if reason == "" {
		err = k8s.WaitFor(ctx, 2*time.Minute, old.Name+" reset by its host watchdog", func() (bool, string, error) {
			reason = resetSeen(ctx, old)
			return reason != "", failed, nil
		})
		if err != nil {
			return nil, "", err
		}
	}
	if _, err := old.WaitBack(ctx, 5*time.Minute); err != nil {
		return nil, "", err
	}
	at := old.LastReset()
	return acked, fmt.Sprintf("reset (%s) %.0fs after the pod ran on the other worker (a negative figure: before), answering again %.0fs after the reset, still cut off",
		reason, at.Sub(began).Seconds(), time.Since(at).Seconds()), nil
}

// resetSeen is why g reset since it last came back, empty if it did not.
func resetSeen(ctx context.Context, g *lab.Guest) string {
	rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	reason, _ := g.WaitReset(rctx)
	return reason
}
