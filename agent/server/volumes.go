package server

import (
	"context"
	"fmt"
	"strings"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// The volume methods translate between the API and package volume.

func (s *Server) volumes() (*volume.Manager, error) {
	if s.o.Volumes == nil {
		return nil, agenterr.New(agenterr.Unavailable, "this agent serves no volume methods (started without a volume manager)")
	}
	return s.o.Volumes, nil
}

// LocatorFromAPI turns the API's device locator into the volume
// manager's, which claims record as it is.
func LocatorFromAPI(l *api.DeviceLocator) (volume.Locator, error) {
	if l == nil {
		return volume.Locator{}, agenterr.New(agenterr.InvalidArgument, "the request names no device")
	}
	var d discovery.Locator
	switch {
	case l.GetPciAddress() != "":
		a, err := discovery.ParsePCIAddress(l.GetPciAddress())
		if err != nil {
			return volume.Locator{}, agenterr.New(agenterr.InvalidArgument, "%v", err)
		}
		d.PCI = &a
	case l.GetHasPci():
		a, err := discovery.PCIFromAPI(int(l.GetPciBus()), int(l.GetPciSlot()))
		if err != nil {
			return volume.Locator{}, agenterr.New(agenterr.InvalidArgument, "%v", err)
		}
		d.PCI = &a
	}
	// Targets pad serials with spaces, and discovery compares them
	// trimmed.
	d.Serial, d.WWN = strings.TrimSpace(l.GetSerial()), strings.TrimSpace(l.GetWwn())
	if !d.IsZero() {
		if err := d.Check(); err != nil {
			return volume.Locator{}, agenterr.New(agenterr.InvalidArgument, "%v", err)
		}
	}
	return volume.Locator{Disk: d, BackingFile: l.GetLoopBackingFile()}, nil
}

// GrantFromAPI checks and converts a takeover grant (fence.NewGrant); nil
// stays nil.
func GrantFromAPI(g *api.TakeoverGrant) (*fence.Grant, error) {
	if g == nil {
		return nil, nil
	}
	out, err := fence.NewGrant(g.GetDisk(), g.GetNode(), g.GetSupersedes())
	if err != nil {
		return nil, agenterr.New(agenterr.InvalidArgument, "%v", err)
	}
	return out, nil
}

// TransitTokenFromAPI converts the API's transit token; nil stays nil. The
// volume manager checks it (luks2.TransitToken.Check) when it formats.
func TransitTokenFromAPI(t *api.TransitToken) *luks2.TransitToken {
	if t == nil {
		return nil
	}
	return &luks2.TransitToken{Mount: t.GetMount(), KeyName: t.GetKeyName(), KeyVersion: int(t.GetKeyVersion()), Ciphertext: t.GetCiphertext()}
}

// StageVolume implements api.AgentServer. The passphrase of an encrypted
// volume is the decoded request's own buffer, which the volume manager
// uses in place (it makes no copy); it is zeroed when the call returns,
// whatever the outcome. The copies gRPC made while receiving the request
// are gRPC's and are not reached from here (docs/security.md).
func (s *Server) StageVolume(ctx context.Context, req *api.StageVolumeRequest) (*api.StageVolumeResponse, error) {
	defer clear(req.GetEncryption().GetPassphrase())
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	loc, err := LocatorFromAPI(req.GetDevice())
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", req.GetVolumeId(), err)
	}
	grant, err := GrantFromAPI(req.GetGrant())
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", req.GetVolumeId(), err)
	}
	r := volume.StageRequest{
		Volume: req.GetVolumeId(), Locator: loc, StagingPath: req.GetStagingPath(), FsType: req.GetFsType(),
		Block: req.GetBlock(), MountFlags: req.GetMountFlags(), ReadOnly: req.GetReadOnly(), Grant: grant,
		AllowUnfenced: req.GetAllowUnfenced(), NeverPublished: req.GetNeverPublished(),
	}
	if e := req.GetEncryption(); e != nil {
		r.Encrypted, r.Passphrase, r.FormatLUKS = true, e.GetPassphrase(), e.GetFormatIfBlank()
		r.Token = TransitTokenFromAPI(e.GetTransitToken())
	}
	res, err := m.Stage(ctx, r)
	if err != nil {
		return nil, err
	}
	return &api.StageVolumeResponse{Device: res.Device, Fencing: api.FencingOf(res.Method), Formatted: res.Formatted}, nil
}

// UnstageVolume implements api.AgentServer.
func (s *Server) UnstageVolume(ctx context.Context, req *api.UnstageVolumeRequest) (*api.UnstageVolumeResponse, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	return &api.UnstageVolumeResponse{}, m.Unstage(ctx, req.GetVolumeId(), req.GetStagingPath())
}

// PublishVolume implements api.AgentServer.
func (s *Server) PublishVolume(ctx context.Context, req *api.PublishVolumeRequest) (*api.PublishVolumeResponse, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	return &api.PublishVolumeResponse{}, m.Publish(ctx, volume.PublishRequest{
		Volume: req.GetVolumeId(), StagingPath: req.GetStagingPath(), TargetPath: req.GetTargetPath(),
		Block: req.GetBlock(), ReadOnly: req.GetReadOnly(), MountFlags: req.GetMountFlags(),
	})
}

// UnpublishVolume implements api.AgentServer.
func (s *Server) UnpublishVolume(ctx context.Context, req *api.UnpublishVolumeRequest) (*api.UnpublishVolumeResponse, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	return &api.UnpublishVolumeResponse{}, m.Unpublish(ctx, req.GetVolumeId(), req.GetTargetPath())
}

// ExpandVolume implements api.AgentServer.
func (s *Server) ExpandVolume(ctx context.Context, req *api.ExpandVolumeRequest) (*api.ExpandVolumeResponse, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	n, err := m.Expand(ctx, req.GetVolumeId(), req.GetVolumePath(), req.GetRequiredBytes())
	if err != nil {
		return nil, err
	}
	return &api.ExpandVolumeResponse{CapacityBytes: n}, nil
}

// GetVolumeStats implements api.AgentServer.
func (s *Server) GetVolumeStats(ctx context.Context, req *api.GetVolumeStatsRequest) (*api.VolumeStats, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	st, err := m.Stats(ctx, req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	return &api.VolumeStats{
		TotalBytes: st.TotalBytes, UsedBytes: st.UsedBytes, AvailableBytes: st.AvailableBytes,
		TotalInodes: st.TotalInodes, UsedInodes: st.UsedInodes, AvailableInodes: st.AvailableInodes,
		Block: st.Block, Abnormal: st.Abnormal, Message: st.Message, State: claimStates[st.State],
	}, nil
}

var claimStates = map[string]api.ClaimState{
	"unclaimed":  api.ClaimState_CLAIM_STATE_UNCLAIMED,
	"held":       api.ClaimState_CLAIM_STATE_HELD,
	"unfenced":   api.ClaimState_CLAIM_STATE_UNFENCED,
	"lost":       api.ClaimState_CLAIM_STATE_LOST,
	"gone":       api.ClaimState_CLAIM_STATE_GONE,
	"refused":    api.ClaimState_CLAIM_STATE_REFUSED,
	"unreadable": api.ClaimState_CLAIM_STATE_UNREADABLE,
}

// ListDisks implements api.AgentServer.
func (s *Server) ListDisks(ctx context.Context, _ *api.ListDisksRequest) (*api.ListDisksResponse, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	ds, err := m.Disks(ctx)
	if err != nil {
		return nil, err
	}
	out := &api.ListDisksResponse{}
	for _, d := range ds {
		pd := &api.Disk{
			Device: d.Device, Name: d.Name, Kind: d.Kind, PciAddress: d.PCI, Serial: d.Serial, Wwns: d.WWNs,
			Fencing: api.FencingOf(d.Method), State: claimStates[d.State], VolumeId: d.Volume, StagingPath: d.Staging,
			HolderNode: d.HolderNode, Detail: d.Detail, FsType: d.FsType, Encrypted: d.Encrypted, ReadOnly: d.ReadOnly,
		}
		if d.HolderKey != 0 {
			pd.HolderKey = fmt.Sprintf("%016x", uint64(d.HolderKey))
		}
		if pd.State == api.ClaimState_CLAIM_STATE_UNSPECIFIED && d.Detail == "" {
			pd.Detail = "stage in progress or interrupted (" + d.State + ")"
		}
		out.Disks = append(out.Disks, pd)
	}
	return out, nil
}

var contentKinds = map[volume.ContentKind]api.VolumeContent{
	volume.ContentBlank: api.VolumeContent_VOLUME_CONTENT_BLANK,
	volume.ContentLUKS2: api.VolumeContent_VOLUME_CONTENT_LUKS2,
	volume.ContentOther: api.VolumeContent_VOLUME_CONTENT_OTHER,
}

// GetVolumeToken implements api.AgentServer.
func (s *Server) GetVolumeToken(ctx context.Context, req *api.GetVolumeTokenRequest) (*api.VolumeToken, error) {
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	var loc volume.Locator
	if req.GetDevice() != nil {
		if loc, err = LocatorFromAPI(req.GetDevice()); err != nil {
			return nil, fmt.Errorf("volume %s: %w", req.GetVolumeId(), err)
		}
	}
	res, err := m.VolumeToken(ctx, req.GetVolumeId(), loc)
	if err != nil {
		return nil, err
	}
	return volumeTokenToAPI(res), nil
}

// UpdateVolumeToken implements api.AgentServer. The passphrase is the
// decoded request's own buffer, zeroed when the call returns, as
// StageVolume's is.
func (s *Server) UpdateVolumeToken(ctx context.Context, req *api.UpdateVolumeTokenRequest) (*api.VolumeToken, error) {
	defer clear(req.GetPassphrase())
	m, err := s.volumes()
	if err != nil {
		return nil, err
	}
	replaces, with := TransitTokenFromAPI(req.GetReplaces()), TransitTokenFromAPI(req.GetToken())
	if replaces == nil || with == nil || len(req.GetPassphrase()) == 0 {
		return nil, agenterr.New(agenterr.InvalidArgument, "volume %s: a token update needs the passphrase, the token it replaces and the new token", req.GetVolumeId())
	}
	res, err := m.UpdateVolumeToken(ctx, req.GetVolumeId(), req.GetPassphrase(), *replaces, *with)
	if err != nil {
		return nil, err
	}
	return volumeTokenToAPI(res), nil
}

// volumeTokenToAPI converts what a volume's device holds.
func volumeTokenToAPI(res volume.TokenResult) *api.VolumeToken {
	out := &api.VolumeToken{Content: contentKinds[res.Kind], LuksUuid: res.UUID, Detail: res.Detail, Device: res.Device}
	if t := res.Token; t != nil {
		out.TransitToken = &api.TransitToken{Mount: t.Mount, KeyName: t.KeyName, KeyVersion: uint32(t.KeyVersion), Ciphertext: t.Ciphertext}
	}
	return out
}
