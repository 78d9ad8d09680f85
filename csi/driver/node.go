package driver

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/csi/kubeevents"
)

// NodeIdentity is what the agent knows about the machine it runs on.
type NodeIdentity struct {
	// UUID is the SMBIOS system UUID, which is the VM's reference_id.
	UUID string
	// Location is the whitesky.cloud location, from the agent's config.
	Location string
}

// StageRequest is everything the agent needs to make a volume ready at a
// staging path: find and verify the device, fence it, open LUKS2 when
// encrypted, make a filesystem only on a blank device, mount.
type StageRequest struct {
	VolumeID       string
	StagingPath    string
	PublishContext map[string]string
	VolumeContext  map[string]string
	Block          bool
	FsType         string
	MountFlags     []string
	ReadOnly       bool
	// Encryption is set for an encrypted volume.
	Encryption *StageEncryption
}

// StageEncryption is how the agent opens (or first formats) an encrypted
// volume's LUKS2 header.
type StageEncryption struct {
	// Passphrase unlocks the volume; never logged, cleared after the call.
	Passphrase []byte
	// FormatIfBlank lets the agent write a new header, with Token, on a
	// device that holds nothing at all.
	FormatIfBlank bool
	// Token is the passphrase wrapped by the transit engine, to keep in
	// the new header.
	Token *luks2.TransitToken
}

// Content is what a volume's device holds where its LUKS2 header goes.
type Content string

// The contents a device can hold there.
const (
	ContentBlank Content = "blank"
	ContentLUKS2 Content = "luks2"
	ContentOther Content = "other"
)

// VolumeToken is what the agent read where the volume's LUKS2 header goes.
type VolumeToken struct {
	// Content is ContentBlank, ContentLUKS2 or ContentOther.
	Content Content
	// Token is the header's wrapped passphrase; nil when it has none.
	Token *luks2.TransitToken
	// Detail names what the device holds when it is not blank or LUKS2.
	Detail string
	Device string
}

// PublishRequest binds a staged volume into a pod's target path.
type PublishRequest struct {
	VolumeID    string
	StagingPath string
	TargetPath  string
	Block       bool
	ReadOnly    bool
	MountFlags  []string
}

// VolumeStats is a staged volume's usage and health.
type VolumeStats struct {
	TotalBytes, UsedBytes, AvailableBytes    int64
	TotalInodes, UsedInodes, AvailableInodes int64
	Block                                    bool
	// Abnormal with Message when the volume lost its fence or its device.
	Abnormal bool
	Message  string
	// Reason is the abnormal volume's condition in one word, ReasonFenceLost
	// or ReasonDeviceGone; empty when the agent did not say which.
	Reason string
}

// Reasons NodeGetVolumeHealth gives for an INACCESSIBLE volume.
const (
	ReasonFenceLost  = "FenceLost"
	ReasonDeviceGone = "DeviceGone"
	// ReasonAbnormal is for an abnormal volume whose cause the agent did
	// not name; its message still says what happened.
	ReasonAbnormal = "Abnormal"
)

// NodeAgent is the host daemon as the node service sees it. Every
// privileged step is one call; errors carry the agent's gRPC status, whose
// code the driver passes on unchanged.
type NodeAgent interface {
	Identity(ctx context.Context) (NodeIdentity, error)
	Stage(ctx context.Context, req StageRequest) error
	Unstage(ctx context.Context, volumeID, stagingPath string) error
	Publish(ctx context.Context, req PublishRequest) error
	Unpublish(ctx context.Context, volumeID, targetPath string) error
	Expand(ctx context.Context, volumeID, path string, bytes int64) (int64, error)
	Stats(ctx context.Context, volumeID, path string) (VolumeStats, error)
	// VolumeToken reads, changing nothing, what the volume's device holds
	// where its LUKS2 header goes.
	VolumeToken(ctx context.Context, volumeID string, publishContext map[string]string) (VolumeToken, error)
}

// Claim is the PersistentVolumeClaim a volume was made for; Pod a pod it
// is published to. They are the csi/kubeevents Object the driver knows
// them as.
type (
	Claim = kubeevents.Object
	Pod   = kubeevents.Object
)

// VolumeUsers is told which Kubernetes objects use the volumes of this
// node: the claim a volume was made for (from the volume context the
// controller wrote, when the external-provisioner passed the claim on)
// before its stage is asked for, the pod it is published to (from the
// kubelet's podInfoOnMount) once published. *kubeevents.Users is one.
type VolumeUsers interface {
	Staging(volumeID, serial string, claim Claim)
	Published(volumeID, targetPath string, pod Pod)
	Unpublished(volumeID, targetPath string)
	Unstaged(volumeID string)
}

// NodeGetCapabilities lists what the node service does.
func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, c := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: c}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// NodeGetInfo reports the node id (the SMBIOS UUID, which the controller
// maps to a VM through its reference_id) and the node's location. A node
// whose location is unknown, a placeholder, or in doubt fails with a
// sentence saying so: the kubelet then does not register the plugin, rather
// than label the node with a wrong location (nodeLocation).
func (d *Driver) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	id, err := d.cfg.Agent.Identity(ctx)
	if err != nil {
		return nil, fmt.Errorf("asking the node agent who this node is: %w", err)
	}
	if id.UUID == "" {
		return nil, failf(ErrAgent, "the node agent reports no SMBIOS UUID for this machine")
	}
	loc, err := d.nodeLocation(id.UUID, id.Location)
	if err != nil {
		return nil, err
	}
	return &csi.NodeGetInfoResponse{NodeId: canonicalUUID(id.UUID), MaxVolumesPerNode: d.nodeVolumeLimit(id.UUID),
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: loc}}}, nil
}

// pathMax and nameMax are Linux's PATH_MAX (with its NUL) and NAME_MAX:
// a longer path or name can name nothing, and is refused as such.
const (
	pathMax = 4096
	nameMax = 255
)

// underRoot checks, by its text alone, that p is an absolute path strictly
// inside the kubelet root, with no ".." and no NUL byte, and returns it
// cleaned. It reads nothing on disk: the node plugin's container has no
// view of the kubelet's directory (docs/security.md, "The node
// container"), so symlinks along p are not its to resolve. vco-agent,
// which acts on the path, resolves it beneath its own kubelet root and
// refuses a symlink anywhere on it.
func (d *Driver) underRoot(what, p string) (string, error) {
	if p == "" {
		return "", failf(ErrInvalid, "%s is required", what)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", failf(ErrInvalid, "%s %s holds a NUL byte", what, shortQuote(p))
	}
	if !filepath.IsAbs(p) {
		return "", failf(ErrInvalid, "%s %q is not an absolute path", what, p)
	}
	if len(p) >= pathMax {
		return "", failf(ErrInvalid, "%s %s is %d bytes long; a path holds fewer than %d", what, shortQuote(p), len(p), pathMax)
	}
	for _, part := range strings.Split(p, "/") {
		if part == ".." {
			return "", failf(ErrInvalid, "%s %q contains '..'", what, p)
		}
		if len(part) > nameMax {
			return "", failf(ErrInvalid, "%s %s has a name of %d bytes; a name holds at most %d", what, shortQuote(p), len(part), nameMax)
		}
	}
	root := filepath.Clean(d.cfg.KubeletRoot)
	clean := filepath.Clean(p)
	if !strings.HasPrefix(clean, strings.TrimSuffix(root, "/")+"/") {
		return "", failf(ErrInvalid, "%s %q is outside the kubelet directory %s", what, p, d.cfg.KubeletRoot)
	}
	return clean, nil
}

// volumePath checks the path a stats or expand call names. Such a call
// only reads or grows a volume already there, so a path that cannot hold
// one of our volumes (relative, or outside the kubelet root) means no
// volume is at it: NOT_FOUND, as for a path the agent does not know. An
// empty path is still a malformed request.
func (d *Driver) volumePath(volumeID, p string) (string, error) {
	if p == "" {
		return "", failf(ErrInvalid, "a volume path is required")
	}
	r, err := d.underRoot("volume path", p)
	if errors.Is(err, ErrInvalid) {
		return "", failf(ErrNotFound, "volume %s is not at %q: %v", volumeID, p, err)
	}
	return r, err
}

func accessType(c *csi.VolumeCapability) (block bool, fs string, flags []string, err error) {
	if c == nil {
		return false, "", nil, failf(ErrInvalid, "a volume capability is required")
	}
	if err := checkCapabilities([]*csi.VolumeCapability{c}); err != nil {
		return false, "", nil, err
	}
	if c.GetBlock() != nil {
		return true, "", nil, nil
	}
	fs = c.GetMount().GetFsType()
	if fs == "" {
		fs = "ext4"
	}
	return false, fs, c.GetMount().GetMountFlags(), nil
}

func readOnlyMode(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
}

// NodeStageVolume asks the agent to make the volume ready at the staging path.
func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeStageVolume needs a volume id")
	}
	if err := checkNodeVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	staging, err := d.underRoot("staging path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	block, fs, flags, err := accessType(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	encrypted := req.GetVolumeContext()[ctxEncrypted] == "true"
	if encrypted && d.cfg.Transit == nil {
		if p := d.cfg.KeyBackendProblem; p != nil {
			return nil, failf(ErrPrecondition, "volume %s is encrypted, and the node plugin's key backend is not usable: %v; "+
				"plain volumes are not affected (docs/encryption.md)", req.GetVolumeId(), p)
		}
		return nil, failf(ErrPrecondition, "volume %s is encrypted, and this node plugin has no key backend to unwrap its passphrase: "+
			"the ConfigMap csi-key-backend-config (key address) is absent from namespace csi-driver; create it, or give --vault-addr "+
			"(docs/encryption.md)", req.GetVolumeId())
	}
	release, err := d.locks.try("volume " + req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	if u := d.cfg.Users; u != nil {
		vc := req.GetVolumeContext()
		u.Staging(req.GetVolumeId(), req.GetPublishContext()[PubSerial],
			Claim{Kind: kubeevents.KindClaim, Namespace: vc[ctxClaimNamespace], Name: vc[ctxClaimName]})
	}
	sr := StageRequest{VolumeID: req.GetVolumeId(), StagingPath: staging, PublishContext: req.GetPublishContext(),
		VolumeContext: req.GetVolumeContext(), Block: block, FsType: fs, MountFlags: flags,
		ReadOnly: readOnlyMode(req.GetVolumeCapability())}
	if encrypted {
		enc, err := d.passphrase(ctx, req.GetVolumeId(), req.GetPublishContext())
		if err != nil {
			return nil, err
		}
		defer clear(enc.Passphrase)
		sr.Encryption = enc
	}
	if err := d.cfg.Agent.Stage(ctx, sr); err != nil {
		return nil, fmt.Errorf("staging volume %s at %s: %w", req.GetVolumeId(), staging, err)
	}
	if encrypted && !sr.Encryption.FormatIfBlank && !sr.ReadOnly {
		d.rewrapAfterStage(ctx, req.GetVolumeId())
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// NodeUnstageVolume asks the agent to unmount, close and release the volume.
func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeUnstageVolume needs a volume id")
	}
	staging, err := d.underRoot("staging path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume " + req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.cfg.Agent.Unstage(ctx, req.GetVolumeId(), staging); err != nil {
		return nil, fmt.Errorf("unstaging volume %s from %s: %w", req.GetVolumeId(), staging, err)
	}
	if u := d.cfg.Users; u != nil {
		u.Unstaged(req.GetVolumeId())
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// NodePublishVolume asks the agent to bind the staged volume into the pod.
func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodePublishVolume needs a volume id")
	}
	staging, err := d.underRoot("staging path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	target, err := d.underRoot("target path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	block, _, flags, err := accessType(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume " + req.GetVolumeId() + " at " + target)
	if err != nil {
		return nil, err
	}
	defer release()
	pr := PublishRequest{VolumeID: req.GetVolumeId(), StagingPath: staging, TargetPath: target, Block: block,
		ReadOnly: req.GetReadonly() || readOnlyMode(req.GetVolumeCapability()), MountFlags: flags}
	if err := d.cfg.Agent.Publish(ctx, pr); err != nil {
		return nil, fmt.Errorf("publishing volume %s at %s: %w", req.GetVolumeId(), target, err)
	}
	if u := d.cfg.Users; u != nil {
		vc := req.GetVolumeContext()
		u.Published(req.GetVolumeId(), target,
			Pod{Kind: kubeevents.KindPod, Namespace: vc[ctxPodNamespace], Name: vc[ctxPodName], UID: vc[ctxPodUID]})
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume asks the agent to remove the pod's bind mount.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeUnpublishVolume needs a volume id")
	}
	target, err := d.underRoot("target path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume " + req.GetVolumeId() + " at " + target)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.cfg.Agent.Unpublish(ctx, req.GetVolumeId(), target); err != nil {
		return nil, fmt.Errorf("unpublishing volume %s from %s: %w", req.GetVolumeId(), target, err)
	}
	if u := d.cfg.Users; u != nil {
		u.Unpublished(req.GetVolumeId(), target)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeExpandVolume asks the agent to grow what lies between the disk and
// the pod: the lease data mapping, dm-crypt, the filesystem (none on a raw
// block volume, where a disk with no mapping needs nothing grown).
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeExpandVolume needs a volume id")
	}
	p, err := d.volumePath(req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume " + req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	n, err := d.cfg.Agent.Expand(ctx, req.GetVolumeId(), p, req.GetCapacityRange().GetRequiredBytes())
	if err != nil {
		return nil, fmt.Errorf("expanding volume %s at %s: %w", req.GetVolumeId(), p, err)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: n}, nil
}

// NodeGetVolumeStats reports usage. (The volume's condition is reported by
// NodeGetVolumeHealth: CSI 1.13 removed VolumeCondition from this call.)
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeGetVolumeStats needs a volume id")
	}
	p, err := d.volumePath(req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	st, err := d.cfg.Agent.Stats(ctx, req.GetVolumeId(), p)
	if err != nil {
		return nil, fmt.Errorf("volume %s at %s: %w", req.GetVolumeId(), p, err)
	}
	resp := &csi.NodeGetVolumeStatsResponse{}
	resp.Usage = append(resp.Usage, &csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: st.TotalBytes, Used: st.UsedBytes, Available: st.AvailableBytes})
	if !st.Block {
		resp.Usage = append(resp.Usage, &csi.VolumeUsage{Unit: csi.VolumeUsage_INODES, Total: st.TotalInodes, Used: st.UsedInodes, Available: st.AvailableInodes})
	}
	return resp, nil
}

// NodeGetVolumeHealth reports a volume the agent says lost its fence or its
// device as INACCESSIBLE from this node, reason FenceLost or DeviceGone,
// with the agent's words; the replacement, since CSI 1.13, for
// VOLUME_CONDITION on the stats call.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "NodeGetVolumeHealth needs a volume id")
	}
	p := req.GetVolumePublishPath()
	if p == "" {
		p = req.GetStagingTargetPath()
	}
	if p != "" {
		var err error
		if p, err = d.underRoot("volume path", p); err != nil {
			return nil, err
		}
	}
	st, err := d.cfg.Agent.Stats(ctx, req.GetVolumeId(), p)
	if err != nil {
		return nil, fmt.Errorf("health of volume %s: %w", req.GetVolumeId(), err)
	}
	h := &csi.VolumeHealth{VolumeId: req.GetVolumeId()}
	if st.Abnormal {
		reason := st.Reason
		if reason == "" {
			reason = ReasonAbnormal
		}
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason, Message: st.Message})
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}
