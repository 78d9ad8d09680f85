// Package agentnode is the CSI node service's view of vco-agent: the
// driver.NodeAgent interface implemented over the agent's published gRPC
// API (agent/api) on its unix socket. The node plugin holds no cloud
// credential and does no privileged work; it asks the agent, one call per
// CSI method, and passes the agent's gRPC code and words back unchanged.
package agentnode

import (
	"context"
	"fmt"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/loopdisk"
)

// Options are the node plugin's explicit opt-ins for hosts that are not
// production nodes.
type Options struct {
	// AllowUnfenced asks the agent to stage disks that offer no fencing
	// method (no SCSI-3 PR, no lease), such as loop devices. The agent
	// refuses unless its own configuration (volumes.allow_unfenced) also
	// allows it.
	AllowUnfenced bool
	// LoopDiskDir is the disk directory of the simulator's host backend
	// (`vco-lab sim`).
	// When set, a volume's device is named to the agent as the loop
	// device backed by that directory's file for the publish context's
	// disk id, instead of by PCI address and serial. The agent accepts
	// that only with volumes.allow_loop_devices.
	LoopDiskDir string
}

// Agent is a connection to vco-agent.
type Agent struct {
	c *client.Client
	o Options
}

// Dial connects to the agent at socket; it fails when nothing serves it,
// or when this process may not reach it, saying then which group it lacks.
func Dial(socket string, o Options) (*Agent, error) {
	c, err := client.Dial(socket)
	if err != nil {
		if h := processGroupHint(socket); h != "" {
			return nil, fmt.Errorf("%w%s", err, h)
		}
		return nil, err
	}
	return &Agent{c: c, o: o}, nil
}

// Close drops the connection.
func (a *Agent) Close() error { return a.c.Close() }

// API is the agent's API on the same connection, for the follower of its
// event stream (csi/kubeevents).
func (a *Agent) API() api.AgentClient { return a.c.AgentClient }

// agentError carries the agent's status with its message alone as the
// text, so the words the agent chose (the holder of a refused disk, what
// the operator can do) reach the CO's event without "rpc error: code ="
// noise, and CodeForError still finds the agent's code.
type agentError struct{ st *status.Status }

func (e *agentError) Error() string              { return e.st.Message() }
func (e *agentError) GRPCStatus() *status.Status { return e.st }

// answer turns an error from a call into one the driver passes on. A
// transport failure names the socket, since the agent is what is down.
func (a *Agent) answer(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("vco-agent at %s: %w", a.c.Socket, err)
	}
	if st.Code() == codes.Unavailable || st.Code() == codes.Unimplemented {
		return &agentError{status.New(st.Code(), fmt.Sprintf("vco-agent at %s: %s", a.c.Socket, st.Message()))}
	}
	return &agentError{st}
}

// Identity asks the agent who this node is.
func (a *Agent) Identity(ctx context.Context) (driver.NodeIdentity, error) {
	id, err := a.c.GetIdentity(ctx, &api.GetIdentityRequest{})
	if err != nil {
		return driver.NodeIdentity{}, a.answer(err)
	}
	return driver.NodeIdentity{UUID: id.GetSystemUuid(), Location: id.GetLocation()}, nil
}

func invalid(format string, args ...any) error {
	return &agentError{status.Newf(codes.InvalidArgument, format, args...)}
}

// locator builds the agent's device locator from the controller's
// publish context.
func (a *Agent) locator(volumeID string, pc map[string]string) (*api.DeviceLocator, error) {
	if a.o.LoopDiskDir != "" {
		id, err := strconv.ParseInt(pc[driver.PubDiskID], 10, 64)
		if err != nil {
			return nil, invalid("volume %s: the publish context's %s %q is not a disk id; was the volume published by this driver's controller?",
				volumeID, driver.PubDiskID, pc[driver.PubDiskID])
		}
		return &api.DeviceLocator{LoopBackingFile: loopdisk.File(a.o.LoopDiskDir, id)}, nil
	}
	loc := &api.DeviceLocator{Serial: pc[driver.PubSerial]}
	bus, slot := pc[driver.PubPCIBus], pc[driver.PubPCISlot]
	if bus != "" || slot != "" {
		b, err1 := strconv.ParseUint(bus, 10, 32)
		s, err2 := strconv.ParseUint(slot, 10, 32)
		if err1 != nil || err2 != nil {
			return nil, invalid("volume %s: the publish context's PCI bus %q / slot %q are not numbers", volumeID, bus, slot)
		}
		loc.HasPci, loc.PciBus, loc.PciSlot = true, uint32(b), uint32(s)
	}
	if !loc.HasPci && loc.Serial == "" {
		return nil, invalid("volume %s: the publish context names no device (%s, %s, %s); was ControllerPublishVolume called?",
			volumeID, driver.PubPCIBus, driver.PubPCISlot, driver.PubSerial)
	}
	return loc, nil
}

// grant passes the controller's takeover grant, if any, to the agent as
// the API's type; the agent checks it (fence.NewGrant). Fields the API
// has no place for are left out.
func grant(volumeID string, pc map[string]string) (*api.TakeoverGrant, error) {
	raw := pc[driver.PubFenceGrant]
	if raw == "" {
		return nil, nil
	}
	g := &api.TakeoverGrant{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal([]byte(raw), g); err != nil {
		return nil, invalid("volume %s: the publish context's %s is not a fence grant: %v", volumeID, driver.PubFenceGrant, err)
	}
	return g, nil
}

// Stage asks the agent to find, verify and fence the disk and mount it
// (or expose the raw device) at the staging path.
func (a *Agent) Stage(ctx context.Context, r driver.StageRequest) error {
	loc, err := a.locator(r.VolumeID, r.PublishContext)
	if err != nil {
		return err
	}
	g, err := grant(r.VolumeID, r.PublishContext)
	if err != nil {
		return err
	}
	req := &api.StageVolumeRequest{VolumeId: r.VolumeID, Device: loc, StagingPath: r.StagingPath, Block: r.Block,
		MountFlags: r.MountFlags, ReadOnly: r.ReadOnly, Grant: g, AllowUnfenced: a.o.AllowUnfenced,
		NeverPublished: driver.NeverPublished(r.PublishContext)}
	if !r.Block {
		req.FsType = r.FsType
	}
	if e := r.Encryption; e != nil {
		req.Encryption = &api.Encryption{Passphrase: e.Passphrase, FormatIfBlank: e.FormatIfBlank}
		if t := e.Token; t != nil {
			req.Encryption.TransitToken = &api.TransitToken{Mount: t.Mount, KeyName: t.KeyName, KeyVersion: uint32(t.KeyVersion), Ciphertext: t.Ciphertext}
		}
	}
	_, err = a.c.StageVolume(ctx, req)
	return a.answer(err)
}

var contents = map[api.VolumeContent]driver.Content{
	api.VolumeContent_VOLUME_CONTENT_BLANK: driver.ContentBlank,
	api.VolumeContent_VOLUME_CONTENT_LUKS2: driver.ContentLUKS2,
	api.VolumeContent_VOLUME_CONTENT_OTHER: driver.ContentOther,
}

// VolumeToken asks the agent what the volume's device holds where its
// LUKS2 header goes.
func (a *Agent) VolumeToken(ctx context.Context, volumeID string, pc map[string]string) (driver.VolumeToken, error) {
	loc, err := a.locator(volumeID, pc)
	if err != nil {
		return driver.VolumeToken{}, err
	}
	r, err := a.c.GetVolumeToken(ctx, &api.GetVolumeTokenRequest{VolumeId: volumeID, Device: loc})
	if err != nil {
		return driver.VolumeToken{}, a.answer(err)
	}
	return volumeToken(r), nil
}

// volumeToken converts the agent's answer.
func volumeToken(r *api.VolumeToken) driver.VolumeToken {
	out := driver.VolumeToken{Content: contents[r.GetContent()], Detail: r.GetDetail(), Device: r.GetDevice()}
	if out.Content == "" {
		out.Content, out.Detail = driver.ContentOther, fmt.Sprintf("content the agent calls %s (%s)", r.GetContent(), r.GetDetail())
	}
	if t := r.GetTransitToken(); t != nil {
		out.Token = &luks2.TransitToken{Mount: t.GetMount(), KeyName: t.GetKeyName(), KeyVersion: int(t.GetKeyVersion()), Ciphertext: t.GetCiphertext()}
	}
	return out
}

// StagedVolumeToken asks the agent what the device of a volume staged on
// this node holds where its LUKS2 header goes; the agent finds the device
// by its record.
func (a *Agent) StagedVolumeToken(ctx context.Context, volumeID string) (driver.VolumeToken, error) {
	r, err := a.c.GetVolumeToken(ctx, &api.GetVolumeTokenRequest{VolumeId: volumeID})
	if err != nil {
		return driver.VolumeToken{}, a.answer(err)
	}
	return volumeToken(r), nil
}

// UpdateVolumeToken asks the agent to store with in place of the staged
// volume's token replaces (driver.Rewrap).
func (a *Agent) UpdateVolumeToken(ctx context.Context, volumeID string, passphrase []byte, replaces, with luks2.TransitToken) (driver.VolumeToken, error) {
	r, err := a.c.UpdateVolumeToken(ctx, &api.UpdateVolumeTokenRequest{VolumeId: volumeID, Passphrase: passphrase,
		Replaces: tokenToAPI(replaces), Token: tokenToAPI(with)})
	if err != nil {
		return driver.VolumeToken{}, a.answer(err)
	}
	return volumeToken(r), nil
}

func tokenToAPI(t luks2.TransitToken) *api.TransitToken {
	return &api.TransitToken{Mount: t.Mount, KeyName: t.KeyName, KeyVersion: uint32(t.KeyVersion), Ciphertext: t.Ciphertext}
}

// EncryptedVolumes lists the encrypted volumes staged on this node whose
// claim the agent holds (or holds unfenced by the operator's choice).
func (a *Agent) EncryptedVolumes(ctx context.Context) ([]string, error) {
	r, err := a.c.ListDisks(ctx, &api.ListDisksRequest{})
	if err != nil {
		return nil, a.answer(err)
	}
	var vols []string
	for _, d := range r.GetDisks() {
		st := d.GetState()
		if d.GetEncrypted() && d.GetVolumeId() != "" && (st == api.ClaimState_CLAIM_STATE_HELD || st == api.ClaimState_CLAIM_STATE_UNFENCED) {
			vols = append(vols, d.GetVolumeId())
		}
	}
	return vols, nil
}

// Unstage asks the agent to unmount, close and release the volume.
func (a *Agent) Unstage(ctx context.Context, volumeID, stagingPath string) error {
	_, err := a.c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: volumeID, StagingPath: stagingPath})
	return a.answer(err)
}

// Publish asks the agent to bind the staged volume at the target path.
func (a *Agent) Publish(ctx context.Context, r driver.PublishRequest) error {
	_, err := a.c.PublishVolume(ctx, &api.PublishVolumeRequest{VolumeId: r.VolumeID, StagingPath: r.StagingPath,
		TargetPath: r.TargetPath, Block: r.Block, ReadOnly: r.ReadOnly, MountFlags: r.MountFlags})
	return a.answer(err)
}

// Unpublish asks the agent to remove the bind mount at the target path.
func (a *Agent) Unpublish(ctx context.Context, volumeID, targetPath string) error {
	_, err := a.c.UnpublishVolume(ctx, &api.UnpublishVolumeRequest{VolumeId: volumeID, TargetPath: targetPath})
	return a.answer(err)
}

// Expand asks the agent to grow the volume's filesystem to its device.
func (a *Agent) Expand(ctx context.Context, volumeID, path string, bytes int64) (int64, error) {
	r, err := a.c.ExpandVolume(ctx, &api.ExpandVolumeRequest{VolumeId: volumeID, VolumePath: path, RequiredBytes: bytes})
	if err != nil {
		return 0, a.answer(err)
	}
	return r.GetCapacityBytes(), nil
}

// Stats asks the agent for the volume's usage and whether it lost its
// fence or device; the claim state in the answer tells which.
func (a *Agent) Stats(ctx context.Context, volumeID, path string) (driver.VolumeStats, error) {
	s, err := a.c.GetVolumeStats(ctx, &api.GetVolumeStatsRequest{VolumeId: volumeID, VolumePath: path})
	if err != nil {
		return driver.VolumeStats{}, a.answer(err)
	}
	st := driver.VolumeStats{
		TotalBytes: s.GetTotalBytes(), UsedBytes: s.GetUsedBytes(), AvailableBytes: s.GetAvailableBytes(),
		TotalInodes: s.GetTotalInodes(), UsedInodes: s.GetUsedInodes(), AvailableInodes: s.GetAvailableInodes(),
		Block: s.GetBlock(), Abnormal: s.GetAbnormal(), Message: s.GetMessage(),
	}
	if st.Abnormal {
		switch s.GetState() {
		case api.ClaimState_CLAIM_STATE_LOST:
			st.Reason = driver.ReasonFenceLost
		case api.ClaimState_CLAIM_STATE_GONE:
			st.Reason = driver.ReasonDeviceGone
		}
	}
	return st, nil
}
