package story

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

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
	err = k8s.WaitFor(ctx, 5*time.Minute, "VolumeSnapshot k9 ready to use", func() (bool, string, error) {
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
