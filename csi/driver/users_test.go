package driver_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// usersLog records what the node service tells its VolumeUsers, and the
// agent's stage calls among them.
type usersLog struct {
	mu    sync.Mutex
	calls []string
}

func (u *usersLog) add(format string, a ...any) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls = append(u.calls, fmt.Sprintf(format, a...))
}

func (u *usersLog) Staging(id, serial string, c driver.Claim) {
	u.add("staging %s serial=%s claim=%s %s/%s", id, serial, c.Kind, c.Namespace, c.Name)
}

func (u *usersLog) Published(id, target string, p driver.Pod) {
	u.add("published %s at %s pod=%s %s/%s %s", id, filepath.Base(target), p.Kind, p.Namespace, p.Name, p.UID)
}
func (u *usersLog) Unpublished(id, target string) {
	u.add("unpublished %s at %s", id, filepath.Base(target))
}
func (u *usersLog) Unstaged(id string) { u.add("unstaged %s", id) }

// refusingAgent refuses the stage as the agent does a disk held
// elsewhere, and publishes.
type refusingAgent struct {
	identityAgent
	log *usersLog
}

func (a refusingAgent) Stage(_ context.Context, r driver.StageRequest) error {
	a.log.add("agent stage %s", r.VolumeID)
	return status.Errorf(codes.FailedPrecondition, "volume %s: disk /dev/sdb is held by another node", r.VolumeID)
}

func (a refusingAgent) Publish(context.Context, driver.PublishRequest) error { return nil }

// The claim the external-provisioner names (--extra-create-metadata)
// goes into the volume context, and reaches the node service's
// VolumeUsers before the agent is asked to stage (so the refusal is shown
// on the claim); the pod the kubelet names (podInfoOnMount) once the
// volume is published to it. A volume whose context names no claim (made
// before) is staged as before, with an empty claim.
func TestClaimAndPodReachVolumeUsers(t *testing.T) {
	e := newTestEnv(t, envOpts{})
	ctx := context.Background()
	resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-9f1e", VolumeCapabilities: rwo,
		Parameters: map[string]string{"csi.storage.k8s.io/pvc/name": "data-web-0", "csi.storage.k8s.io/pvc/namespace": "shop",
			"csi.storage.k8s.io/pv/name": "pvc-9f1e"}})
	if err != nil {
		t.Fatal(err)
	}
	vc := resp.GetVolume().GetVolumeContext()
	if vc["cloud.whitesky/pvc-name"] != "data-web-0" || vc["cloud.whitesky/pvc-namespace"] != "shop" || vc["cloud.whitesky/pv-name"] != "pvc-9f1e" {
		t.Fatalf("volume context %v lacks the claim", vc)
	}
	again, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-9f1e", VolumeCapabilities: rwo,
		Parameters: map[string]string{"csi.storage.k8s.io/pvc/name": "data-web-0", "csi.storage.k8s.io/pvc/namespace": "shop",
			"csi.storage.k8s.io/pv/name": "pvc-9f1e"}})
	if err != nil || again.GetVolume().GetVolumeContext()["cloud.whitesky/pvc-name"] != "data-web-0" {
		t.Fatalf("a repeated create: %v %v", again, err)
	}
	plain, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-old", VolumeCapabilities: rwo})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := plain.GetVolume().GetVolumeContext()["cloud.whitesky/pvc-name"]; ok {
		t.Fatalf("a volume made without the provisioner's metadata names a claim: %v", plain.GetVolume().GetVolumeContext())
	}

	log := &usersLog{}
	kubelet := t.TempDir()
	d, err := driver.New(driver.Config{Name: "cloud.whitesky.csi", Mode: driver.ModeNode, KubeletRoot: kubelet,
		Agent: refusingAgent{identityAgent{hostUUID, hostLoc}, log}, Users: log})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(kubelet, "staging"),
		VolumeCapability: rwo[0], VolumeContext: vc, PublishContext: map[string]string{driver.PubSerial: "42"}})
	wantCode(t, err, codes.FailedPrecondition, "held by another node")
	_, err = d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: plain.GetVolume().GetVolumeId(), StagingTargetPath: filepath.Join(kubelet, "staging2"),
		VolumeCapability: rwo[0], VolumeContext: plain.GetVolume().GetVolumeContext(), PublishContext: map[string]string{driver.PubSerial: "43"}})
	wantCode(t, err, codes.FailedPrecondition)
	podCtx := map[string]string{"csi.storage.k8s.io/pod.name": "web-0", "csi.storage.k8s.io/pod.namespace": "shop",
		"csi.storage.k8s.io/pod.uid": "0b7c5e2a", "csi.storage.k8s.io/ephemeral": "false"}
	for k, v := range vc {
		podCtx[k] = v
	}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(kubelet, "staging"),
		TargetPath: filepath.Join(kubelet, "pods", "0b7c5e2a", "mount"), VolumeCapability: rwo[0], VolumeContext: podCtx}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(kubelet, "pods", "0b7c5e2a", "mount")}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(kubelet, "staging")}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"staging " + id + " serial=42 claim=PersistentVolumeClaim shop/data-web-0",
		"agent stage " + id,
		"staging " + plain.GetVolume().GetVolumeId() + " serial=43 claim=PersistentVolumeClaim /",
		"agent stage " + plain.GetVolume().GetVolumeId(),
		"published " + id + " at mount pod=Pod shop/web-0 0b7c5e2a",
		"unpublished " + id + " at mount",
		"unstaged " + id,
	}
	if !slices.Equal(log.calls, want) {
		t.Errorf("calls\n%q\nwant\n%q", log.calls, want)
	}
}
