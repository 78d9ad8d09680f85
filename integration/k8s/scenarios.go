package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s/images"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// The scenarios after K1, K2 and K4 (docs/development.md, "The Kubernetes
// lab"): K3 a StatefulSet, K6 online expansion, K9 snapshots installed
// after the bundle, K8 a disk the platform attached to a second VM, K5 a
// powered-off node. K6, K9, K8 and K5 use K4's claim and Deployment, so
// they run after it, in this order.

// k3: a StatefulSet of two replicas with volumeClaimTemplates, one per
// worker: a disk each, each writable, each mounted on its own node only.
func (s *story) k3(ctx context.Context) error {
	const sc = "K3"
	var ps []podInfo
	aff := `affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector: {matchLabels: {app: k3}}
        topologyKey: kubernetes.io/hostname
`
	if err := s.step(sc, "cluster", "StatefulSet of 2 replicas with volumeClaimTemplates of the seed's class vco-csi-physical (diskType: PHYSICAL), one per worker", func() (string, error) {
		if err := s.apply(ctx, fmt.Sprintf(`apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: k3
spec:
  serviceName: k3
  replicas: 2
  podManagementPolicy: Parallel
  selector: {matchLabels: {app: k3}}
  template:
    metadata: {labels: {app: k3}}
    spec:
%s  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
        storageClassName: vco-csi-physical
        accessModes: [ReadWriteOnce]
        resources: {requests: {storage: 1Gi}}
`, writerSpec("", aff, "      "))); err != nil {
			return "", err
		}
		var err error
		ps, err = s.waitPods(ctx, "app=k3", 10*time.Minute, "both k3 replicas Ready", allReady(2))
		if err != nil {
			return "", err
		}
		if ps[0].Node == ps[1].Node {
			return "", fmt.Errorf("both replicas on %s", ps[0].Node)
		}
		return fmt.Sprintf("%s on %s, %s on %s", ps[0].Name, ps[0].Node, ps[1].Name, ps[1].Node), nil
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "a PHYSICAL disk each, each holding what its pod wrote, mounted only on its node", func() (string, error) {
		var got []string
		handles := map[string]string{}
		for _, p := range ps {
			pv, h, err := s.ownDisk(ctx, p, handles)
			if err != nil {
				return "", err
			}
			id, err := diskOf(h)
			if err != nil {
				return "", err
			}
			if d := s.c.Env.Sim.Snapshot().Disks[id]; d == nil || d.Type != "PHYSICAL" {
				return "", fmt.Errorf("%s's disk %s is not the PHYSICAL disk its class vco-csi-physical asks for: %+v", p.Name, h, d)
			}
			data, err := s.readLog(ctx, p, pv)
			if err != nil {
				return "", err
			}
			if data != "written-on-"+p.Node {
				return "", fmt.Errorf("%s's volume %s holds %q", p.Name, pv, data)
			}
			elsewhere, err := s.mountsOf(ctx, s.c.Env.Lab.Guest(s.other(p.Node)), pv)
			if err != nil {
				return "", err
			}
			s.check(e2e.P1, sc, len(elsewhere) == 0, "K3: %s's disk %s is mounted on %s only (mounts on the other worker: %d)", p.Name, h, p.Node, len(elsewhere))
			if len(elsewhere) > 0 {
				return "", fmt.Errorf("%s mounted on the other worker: %v", pv, elsewhere)
			}
			got = append(got, fmt.Sprintf("%s: PHYSICAL disk %s on %s", p.Name, h, p.Node))
		}
		// The claims outlive the StatefulSet; both go, freeing their disks.
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "statefulset", "k3", "--wait=true"); err != nil {
			return "", err
		}
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "data-k3-0", "data-k3-1", "--wait=false"); err != nil {
			return "", err
		}
		return strings.Join(got, "; "), nil
	})
}

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

// InstallSnapshots installs external-snapshotter's CRDs and
// snapshot-controller as docs/csi-addon.md tells operators, and applies
// the add-on's snapshots part the release way (envsubst over
// deploy/csi-snapshots.yaml).
func (c *Cluster) InstallSnapshots(ctx context.Context) (string, error) {
	f, err := images.Snapshotter(ctx, filepath.Join(c.Opts.Lab.CacheDir, "k8s-images"))
	if err != nil {
		return "", err
	}
	for _, crd := range f.CRDs {
		if _, err := c.Kubectl(ctx, "apply", "-f", crd); err != nil {
			return "", err
		}
	}
	for _, crd := range []string{"volumesnapshots", "volumesnapshotcontents", "volumesnapshotclasses"} {
		if _, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+crd+".snapshot.storage.k8s.io"); err != nil {
			return "", err
		}
	}
	for _, m := range f.Controller {
		if _, err := c.Kubectl(ctx, "apply", "-f", m); err != nil {
			return "", err
		}
	}
	// The upstream Deployment names the release's image; the lab
	// serves the one it built from the same release under that name.
	if _, err := c.Kubectl(ctx, "-n", "kube-system", "set", "image", "deployment/snapshot-controller", "snapshot-controller="+f.Image); err != nil {
		return "", err
	}
	if _, err := c.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deployment/snapshot-controller", "--timeout=5m"); err != nil {
		return "", c.podsState(ctx, err)
	}
	rendered, err := envsubst(ctx, "deploy/csi-snapshots.yaml")
	if err != nil {
		return "", err
	}
	out, err := c.KubectlInput(ctx, strings.NewReader(rendered), "apply", "-f", "-")
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%d CRDs, snapshot-controller %s; %s", len(f.CRDs), f.Image, strings.TrimSpace(out)), nil
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
	err := waitFor(ctx, 5*time.Minute, what, func() (bool, string, error) {
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
	if err := waitFor(ctx, 5*time.Minute, "claim k4 detached", func() (bool, string, error) {
		va, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o", "jsonpath={range .items[?(@.spec.source.persistentVolumeName==\""+pv+"\")]}{.spec.nodeName} {end}")
		return err == nil && strings.TrimSpace(va) == "", va, nil
	}); err != nil {
		return "", err
	}
	if err := s.k6Patch(ctx); err != nil {
		return "", err
	}
	if err := waitFor(ctx, 5*time.Minute, "the disk grown by the controller", func() (bool, string, error) {
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

// k9: the bundle went in on a cluster without the snapshot CRDs (the
// story's setup); the CRDs and snapshot-controller of external-snapshotter
// are installed now, the snapshots part applied the release way (envsubst
// over deploy/csi-snapshots.yaml), and a snapshot of K4's claim restored
// into a new claim holds its data.
func (s *story) k9(ctx context.Context) error {
	const sc = "K9"
	if err := s.step(sc, "cluster", "the bundle was applied (exit 0) with no snapshot CRDs in the cluster", func() (string, error) {
		out, err := s.c.Kubectl(ctx, "get", "crd", "-o", "name")
		if err != nil {
			return "", err
		}
		if strings.Contains(out, "snapshot.storage.k8s.io") {
			return "", fmt.Errorf("the cluster already has snapshot CRDs: %s", out)
		}
		return fmt.Sprintf("no snapshot.storage.k8s.io CRD; the setup step applied the bundle with exit 0 (%d CRDs in the cluster)", strings.Count(out, "\n")), nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "install external-snapshotter's CRDs and snapshot-controller; apply csi-snapshots.yaml through envsubst", func() (string, error) {
		return s.c.InstallSnapshots(ctx)
	}); err != nil {
		return err
	}
	var before string
	if err := s.step(sc, "cluster", "VolumeSnapshot of claim k4, ready to use", func() (string, error) {
		return s.k9Snapshot(ctx, &before)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "a claim restored from the snapshot holds claim k4's data", func() (string, error) {
		return s.k9Restored(ctx, sc, before)
	})
}

// k9Snapshot reads K4's data into before and takes a snapshot of claim k4.
func (s *story) k9Snapshot(ctx context.Context, before *string) (string, error) {
	ps, err := s.pods(ctx, "app=k4")
	if err != nil || len(ps) != 1 {
		return "", fmt.Errorf("K9 needs K4's pod: %+v %v", ps, err)
	}
	pv, err := s.pvOf(ctx, "k4")
	if err != nil {
		return "", err
	}
	if *before, err = s.readLog(ctx, ps[0], pv); err != nil {
		return "", err
	}
	if err := s.apply(ctx, `apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata:
  name: k9
spec:
  source: {persistentVolumeClaimName: k4}
`); err != nil {
		return "", err
	}
	var state string
	err = waitFor(ctx, 5*time.Minute, "VolumeSnapshot k9 ready to use", func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "volumesnapshot", "k9", "-o", "jsonpath={.status.readyToUse} {.status.restoreSize} {.status.error.message}")
		state = strings.TrimSpace(out)
		return err == nil && strings.HasPrefix(state, "true"), state, nil
	})
	return "readyToUse restoreSize: " + state, err
}

// k9Restored restores the snapshot into a new claim, whose pod must find K4's data (before).
func (s *story) k9Restored(ctx context.Context, sc, before string) (string, error) {
	if err := s.apply(ctx, `apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: k9-restored
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 2Gi}}
  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: k9}
---
`+fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: k9
  labels: {app: k9}
spec:
%s`, writerSpec("k9-restored", "", "  "))); err != nil {
		return "", err
	}
	ps, err := s.waitPods(ctx, "app=k9", 10*time.Minute, "pod k9 Ready", allReady(1))
	if err != nil {
		return "", err
	}
	pv, err := s.pvOf(ctx, "k9-restored")
	if err != nil {
		return "", err
	}
	data, err := s.readLog(ctx, ps[0], pv)
	if err != nil {
		return "", err
	}
	want := before + "\nwritten-on-" + ps[0].Node
	s.check(e2e.P5, sc, data == want, "K9: the claim restored from a snapshot of k4 holds %q (k4 held %q)", data, before)
	if data != want {
		return "", fmt.Errorf("the restored volume holds %q, want %q", data, want)
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pod", "k9", "--wait=true"); err != nil {
		return "", err
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "k9-restored", "--wait=false"); err != nil {
		return "", err
	}
	return fmt.Sprintf("restored claim on %s holds %q", ps[0].Node, data), nil
}

// envsubst renders a release file of the repository as the release
// instructions do: envsubst '$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME'.
func envsubst(ctx context.Context, file string) (string, error) {
	f, err := os.Open(repoRoot() + "/" + file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	cmd := exec.CommandContext(ctx, "envsubst", "$VCO_CSI_IMAGE $VCO_CSI_DRIVER_NAME")
	cmd.Stdin = f
	cmd.Env = append(os.Environ(), "VCO_CSI_IMAGE="+Image, "VCO_CSI_DRIVER_NAME="+simlab.DriverName)
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("envsubst < %s: %w", file, err)
	}
	return string(out), nil
}

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
	if err := waitFor(ctx, 2*time.Minute, "DiskRefused for "+*dev+" on "+intruder.Name, func() (bool, string, error) {
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

// eventItem is what the scenarios read of a core/v1 Event.
type eventItem struct{ Message, Type string }

// waitEvent waits up to two minutes for an Event in scope (kubectl's -A
// or -n NS) matching the field selector sel of which match holds, and
// returns its type and message.
func (s *story) waitEvent(ctx context.Context, scope []string, sel string, match func(eventItem) bool) (string, error) {
	var msg string
	err := waitFor(ctx, 2*time.Minute, "an Event with "+sel, func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, append(append([]string{"get", "events"}, scope...), "--field-selector", sel, "-o", "json")...)
		if err != nil {
			return false, err.Error(), nil
		}
		var list struct{ Items []eventItem }
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return false, err.Error(), nil
		}
		for _, it := range list.Items {
			if match(it) {
				msg = it.Type + ": " + it.Message
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d Events with %s, none about the disk and its holder", len(list.Items), sel), nil
	})
	return msg, err
}

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
	if err := waitFor(ctx, 5*time.Minute, dead.Name+" not Ready", func() (bool, string, error) {
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
	err := waitFor(ctx, time.Minute, "DiskFenced on "+dead.Name, func() (bool, string, error) {
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
	err := waitFor(ctx, 4*time.Minute, "no mount of "+pv+" left on "+dead.Name, func() (bool, string, error) {
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

// ownDisk is the PV and volume handle of a StatefulSet pod p's claim
// (data-<pod>), refused when handles (handle -> pod) has another pod's
// claim on the same disk; p's is added to it.
func (s *story) ownDisk(ctx context.Context, p podInfo, handles map[string]string) (string, string, error) {
	pv, err := s.pvOf(ctx, "data-"+p.Name)
	if err != nil {
		return "", "", err
	}
	h, err := s.handle(ctx, pv)
	if err != nil {
		return "", "", err
	}
	if other, dup := handles[h]; dup {
		return "", "", fmt.Errorf("the claims of %s and %s are one disk %s", other, p.Name, h)
	}
	handles[h] = p.Name
	return pv, h, nil
}

// handle is pv's CSI volume handle.
func (s *story) handle(ctx context.Context, pv string) (string, error) {
	h, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
	h = strings.TrimSpace(h)
	if err == nil && h == "" {
		err = fmt.Errorf("PV %s has no CSI volume handle", pv)
	}
	return h, err
}

// diskOf is the disk id of a volume handle (location/disk).
func diskOf(handle string) (int64, error) {
	_, id, ok := strings.Cut(handle, "/")
	n, err := strconv.ParseInt(id, 10, 64)
	if !ok || err != nil {
		return 0, fmt.Errorf("volume handle %q is not <location>/<disk id>", handle)
	}
	return n, nil
}

// nodeEvents are the events of the agent on g (the .deb's vco-agent on
// its default socket).
func nodeEvents(ctx context.Context, g *lab.Guest) ([]simlab.Event, error) {
	out, err := g.MustSh(ctx, "vco-agent events --json")
	if err != nil {
		return nil, err
	}
	var evs []simlab.Event
	for _, line := range strings.Split(out, "\n") {
		if line = strings.TrimSpace(line); line == "" {
			continue
		}
		var ev simlab.Event
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			return nil, fmt.Errorf("%s: vco-agent events printed %q: %w", g.Name, line, err)
		}
		ev.Node = g.Name
		evs = append(evs, ev)
	}
	return evs, nil
}

// claimKey is the fence key g's agent claimed volume with: the holder key
// of its last DiskClaimed event for it.
func claimKey(ctx context.Context, g *lab.Guest, volume string) (string, error) {
	evs, err := nodeEvents(ctx, g)
	if err != nil {
		return "", err
	}
	key := ""
	for _, ev := range evs {
		if ev.Name() == "DiskClaimed" && ev.Volume == volume {
			key = ev.HolderKey
		}
	}
	if key == "" {
		return "", fmt.Errorf("%s's agent has no DiskClaimed event for %s", g.Name, volume)
	}
	return key, nil
}

// k4Claim is what the scenarios after K4 work on: its running pod and its
// claim's PV, volume handle and disk.
type k4Claim struct {
	pod        podInfo
	pv, handle string
	disk       int64
}

func (s *story) k4Volume(ctx context.Context, sc string) (*k4Claim, error) {
	ps, err := s.pods(ctx, "app=k4")
	if err != nil {
		return nil, err
	}
	if len(ps) != 1 || !ps[0].Ready {
		return nil, fmt.Errorf("%s needs K4's pod running: %+v", sc, ps)
	}
	k := &k4Claim{pod: ps[0]}
	if k.pv, err = s.pvOf(ctx, "k4"); err != nil {
		return nil, err
	}
	if k.handle, err = s.handle(ctx, k.pv); err != nil {
		return nil, err
	}
	if k.disk, err = diskOf(k.handle); err != nil {
		return nil, err
	}
	return k, nil
}
