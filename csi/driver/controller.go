package driver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

const gib = int64(1) << 30

// StorageClass parameters (docs/storage.md). diskType is the documented
// spelling, the one CAPVCO's classes use; type is kept as an alias for
// classes written before it, since a StorageClass's parameters cannot be
// edited in place.
const (
	paramDiskType   = "diskType"   // STANDARD (default) | PHYSICAL, any case
	paramType       = "type"       // alias of diskType
	paramIOPS       = "iops"       // integer, at least MinIOPS
	paramEncryption = "encryption" // "true" | "false"
)

// Volume context keys handed to the node service.
const (
	ctxEncrypted = "cloud.whitesky/encrypted"
	ctxLocation  = TopologyKey
	// The claim a volume was made for, from the external-provisioner's
	// --extra-create-metadata: the node plugin shows what the agent
	// reports about the volume on it (docs/events.md, "In Kubernetes").
	// Volumes made before these keys existed have none.
	ctxClaimName      = "cloud.whitesky/pvc-name"
	ctxClaimNamespace = "cloud.whitesky/pvc-namespace"
	ctxPVName         = "cloud.whitesky/pv-name"
)

// The parameters the external-provisioner adds with --extra-create-metadata,
// and the pod information the kubelet adds to NodePublishVolume's volume
// context when the CSIDriver has podInfoOnMount.
const (
	paramPVCName      = "csi.storage.k8s.io/pvc/name"
	paramPVCNamespace = "csi.storage.k8s.io/pvc/namespace"
	paramPVName       = "csi.storage.k8s.io/pv/name"
	ctxPodName        = "csi.storage.k8s.io/pod.name"
	ctxPodNamespace   = "csi.storage.k8s.io/pod.namespace"
	ctxPodUID         = "csi.storage.k8s.io/pod.uid"
)

// withClaim adds the claim CreateVolume was asked for to v's context,
// when the provisioner named it.
func withClaim(v *csi.Volume, params map[string]string) *csi.Volume {
	if params[paramPVCName] == "" || params[paramPVCNamespace] == "" {
		return v
	}
	v.VolumeContext[ctxClaimName] = params[paramPVCName]
	v.VolumeContext[ctxClaimNamespace] = params[paramPVCNamespace]
	if pv := params[paramPVName]; pv != "" {
		v.VolumeContext[ctxPVName] = pv
	}
	return v
}

var controllerCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
	csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
}

// ControllerGetCapabilities lists what the controller does.
// MinIOPS is the least iops the API's disk create call takes.
const MinIOPS = 100

// GetCapacity answers how much a new volume of the class can have in a
// location: what the API's location capacity endpoint says the customer
// can still allocate there (su, storage units of 1 TiB). The location is
// the request's topology segment, or the one a volume without topology
// gets. The external-provisioner publishes it as CSIStorageCapacity, so
// WaitForFirstConsumer scheduling avoids a full location.
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if _, err := parseParams(req.GetParameters()); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) > 0 {
		if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
			return nil, err
		}
	}
	loc := req.GetAccessibleTopology().GetSegments()[TopologyKey]
	locs, err := d.locations(ctx)
	if err != nil {
		return nil, err
	}
	if loc == "" {
		if loc, err = d.pickLocation(ctx, nil); err != nil {
			return nil, err
		}
	}
	if !slices.Contains(locs, loc) {
		// Not one of the customer's locations: nothing can be made there.
		return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
	}
	c, err := d.cfg.Cloud.LocationCapacity(ctx, loc)
	if err != nil {
		return nil, fmt.Errorf("capacity of location %s: %w", loc, err)
	}
	avail := max(c.SU, 0)
	if avail > math.MaxInt64/cloud.SUBytes {
		avail = math.MaxInt64 / cloud.SUBytes
	}
	return &csi.GetCapacityResponse{AvailableCapacity: avail * cloud.SUBytes,
		MaximumVolumeSize: wrapperspb.Int64(min(avail*cloud.SUBytes, maxDiskGiB*gib))}, nil
}

func (d *Driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, c := range controllerCaps {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: c}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// checkCapabilities accepts single-node access in mount or block mode: a
// whitesky.cloud disk is attached to one VM at a time.
func checkCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return failf(ErrInvalid, "volume capabilities are required")
	}
	for _, c := range caps {
		if c.GetBlock() == nil && c.GetMount() == nil {
			return failf(ErrInvalid, "a volume capability needs an access type (mount or block)")
		}
		if c.GetAccessMode() == nil {
			return failf(ErrInvalid, "a volume capability needs an access mode")
		}
		if m := c.GetMount(); m != nil && m.FsType != "" && m.FsType != "ext4" && m.FsType != "xfs" {
			return failf(ErrInvalid, "filesystem %q is not supported; use ext4 or xfs", m.FsType)
		}
		switch c.GetAccessMode().GetMode() {
		case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		default:
			return failf(ErrInvalid, "access mode %s is not supported: a whitesky.cloud disk is attached to one VM at a time", c.GetAccessMode().GetMode())
		}
	}
	return nil
}

// sizeGiB turns a capacity range into whole GiB, rounding up.
// maxDiskGiB bounds one disk (64 TiB). No whitesky.cloud disk is larger;
// the bound keeps an absurd request (4 EiB) from reaching the API at all.
const maxDiskGiB = 64 << 10

func sizeGiB(r *csi.CapacityRange, floor int64) (int64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, failf(ErrInvalid, "capacity must not be negative")
	}
	if lim > 0 && req > lim {
		return 0, failf(ErrInvalid, "required capacity %d exceeds the limit %d", req, lim)
	}
	n := req / gib
	if req%gib != 0 {
		n++
	}
	if n > maxDiskGiB {
		return 0, failf(ErrOutOfRange, "%d GiB is more than the %d GiB this driver provisions in one disk", n, maxDiskGiB)
	}
	if n < floor {
		n = floor
	}
	if n < 1 {
		n = 1
	}
	if lim > 0 && n*gib > lim {
		return 0, failf(ErrOutOfRange, "disks come in whole GiB; %d GiB exceeds the limit of %d bytes", n, lim)
	}
	return n, nil
}

type createParams struct {
	diskType  string
	iops      int64
	encrypted bool
}

func parseParams(p map[string]string) (createParams, error) {
	out := createParams{diskType: cloud.DiskTypeData}
	var typeKey, typeVal string // the first disk type parameter seen, for a clash
	for k, v := range p {
		switch {
		case k == paramDiskType || k == paramType:
			t, err := parseDiskType(k, v)
			if err != nil {
				return out, err
			}
			if typeKey != "" && t != out.diskType {
				a, b := typeKey, k
				av, bv := typeVal, v
				if a != paramDiskType { // name diskType first, whatever the map's order
					a, b, av, bv = b, a, bv, av
				}
				return out, failf(ErrInvalid, "parameters %s=%q and %s=%q disagree; a StorageClass gives %s only (%s is its older alias)",
					a, av, b, bv, paramDiskType, paramType)
			}
			out.diskType, typeKey, typeVal = t, k, v
		case k == paramIOPS:
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < MinIOPS {
				return out, failf(ErrInvalid, "parameter iops=%q is not an integer of at least %d, the API's minimum", v, MinIOPS)
			}
			out.iops = n
		case k == paramEncryption:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return out, failf(ErrInvalid, "parameter encryption=%q is not true or false", v)
			}
			out.encrypted = b
		case strings.HasPrefix(k, "csi.storage.k8s.io/"):
			// Passed by the provisioner for its own use.
		default:
			return out, failf(ErrInvalid, "unknown parameter %q; known: diskType (alias type), iops, encryption", k)
		}
	}
	return out, nil
}

// parseDiskType maps a class's disk type, in any case, to the API's:
// STANDARD is the API's DATA disk, PHYSICAL its PHYSICAL disk.
func parseDiskType(key, v string) (string, error) {
	switch strings.ToUpper(v) {
	case "", "STANDARD":
		return cloud.DiskTypeData, nil
	case "PHYSICAL":
		return cloud.DiskTypePhysical, nil
	}
	return "", failf(ErrInvalid, "parameter %s=%q: use STANDARD or PHYSICAL (any case)", key, v)
}

// ValidateParameters checks StorageClass parameters as CreateVolume does,
// so the add-on's own classes can be checked against the plugin's rules
// (deploy/).
func ValidateParameters(p map[string]string) error {
	_, err := parseParams(p)
	return err
}

// pickLocation chooses where a new disk goes: the first preferred
// location, else the first requisite one, else the default.
func (d *Driver) pickLocation(ctx context.Context, req *csi.TopologyRequirement) (string, error) {
	known, err := d.locations(ctx)
	if err != nil {
		return "", err
	}
	has := func(l string) bool {
		for _, k := range known {
			if k == l {
				return true
			}
		}
		return false
	}
	for _, set := range [][]*csi.Topology{req.GetPreferred(), req.GetRequisite()} {
		for _, t := range set {
			if l, ok := t.GetSegments()[TopologyKey]; ok {
				if !has(l) {
					continue
				}
				return l, nil
			}
		}
	}
	if len(req.GetPreferred())+len(req.GetRequisite()) > 0 {
		var asked []string
		for _, t := range append(req.GetPreferred(), req.GetRequisite()...) {
			asked = append(asked, t.GetSegments()[TopologyKey])
		}
		return "", failf(ErrNoCapacity, "none of the requested locations (%s: %s) is one this customer has: %s",
			TopologyKey, strings.Join(asked, ", "), strings.Join(known, ", "))
	}
	if d.cfg.DefaultLocation != "" {
		return d.cfg.DefaultLocation, nil
	}
	if len(known) == 0 {
		return "", failf(ErrPrecondition, "the customer has no location to create disks in")
	}
	return known[0], nil
}

func (d *Driver) volume(loc string, disk *cloud.Disk, meta diskMeta) *csi.Volume {
	v := &csi.Volume{
		VolumeId:           volumeID(loc, disk.ID),
		CapacityBytes:      disk.SizeGiB * gib,
		VolumeContext:      map[string]string{ctxLocation: loc},
		AccessibleTopology: []*csi.Topology{{Segments: map[string]string{TopologyKey: loc}}},
	}
	if meta.Encrypted {
		v.VolumeContext[ctxEncrypted] = "true"
	}
	if kind, id, ok := strings.Cut(meta.Source, ":"); ok {
		switch kind {
		case "snapshot":
			v.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
		case "volume":
			v.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
		}
	}
	return v
}

// CreateVolume creates a disk in the chosen location, or returns the one
// an earlier call with the same name made.
func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	name := req.GetName()
	params, err := checkCreate(req)
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume name " + name)
	if err != nil {
		return nil, err
	}
	defer release()

	meta := diskMeta{Encrypted: params.encrypted}
	src, releaseSrc, err := d.copySource(ctx, name, req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	defer releaseSrc()
	meta.Source = src.meta
	size, err := sizeGiB(req.GetCapacityRange(), 0)
	if err != nil {
		return nil, err
	}
	loc, err := d.createLocation(ctx, req.GetAccessibilityRequirements(), src)
	if err != nil {
		return nil, err
	}

	// Idempotency: a disk of this name in this location is the answer to
	// an earlier call, if it matches.
	existing, err := d.disks.byName(ctx, loc, name)
	if err != nil {
		return nil, err
	}
	if existing != nil {
		if err := matchExisting(existing, loc, name, size, req.GetCapacityRange().GetLimitBytes(), meta, params.diskType); err != nil {
			return nil, err
		}
		return &csi.CreateVolumeResponse{Volume: withClaim(d.volume(loc, existing, meta), req.GetParameters())}, nil
	}
	if size, err = copySize(name, size, req.GetCapacityRange().GetLimitBytes(), src); err != nil {
		return nil, err
	}
	disk, err := d.makeDisk(ctx, loc, name, size, src, meta, params)
	if err != nil {
		return nil, err
	}
	if meta.Source == "" { // not a copy: made empty (see madeEmpty)
		d.madeEmpty.add(volumeID(loc, disk.ID))
	}
	return &csi.CreateVolumeResponse{Volume: withClaim(d.volume(loc, disk, meta), req.GetParameters())}, nil
}

// checkCreate checks what CreateVolume is asked before anything is locked
// or looked up: the name, the capabilities and the parameters.
func checkCreate(req *csi.CreateVolumeRequest) (createParams, error) {
	name := req.GetName()
	if name == "" {
		return createParams{}, failf(ErrInvalid, "CreateVolume needs a name")
	}
	if err := checkName(name); err != nil {
		return createParams{}, err
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return createParams{}, err
	}
	return parseParams(req.GetParameters())
}

// volumeCopy is what a new volume is copied from: a snapshot (snap set)
// or a volume, in loc; the zero value is no source, an empty volume.
type volumeCopy struct {
	loc  string
	disk int64
	snap string
	// floorGiB is the source's size, the least a new copy can have.
	floorGiB int64
	// meta is the diskMeta.Source recording it.
	meta string
}

// copySource resolves the content source of volume name. A volume source
// is locked, as CreateSnapshot locks it, until the returned release.
func (d *Driver) copySource(ctx context.Context, name string, cs *csi.VolumeContentSource) (volumeCopy, func(), error) {
	none := func() {}
	switch {
	case cs.GetSnapshot() != nil:
		src, err := d.snapshotSource(ctx, name, cs.GetSnapshot().GetSnapshotId())
		return src, none, err
	case cs.GetVolume() != nil:
		return d.volumeSource(ctx, name, cs.GetVolume().GetVolumeId())
	}
	return volumeCopy{}, none, nil
}

// snapshotSource checks that snapshot id exists and reads its disk's size.
func (d *Driver) snapshotSource(ctx context.Context, name, id string) (volumeCopy, error) {
	l, disk, snap, ok := parseSnapshotID(id)
	if !ok {
		return volumeCopy{}, failf(ErrNotFound, "source snapshot %q of volume %q does not exist", id, name)
	}
	snaps, err := d.cfg.Cloud.ListSnapshots(ctx, l, disk)
	if errors.Is(err, cloud.ErrNotFound) {
		return volumeCopy{}, failf(ErrNotFound, "source snapshot %s of volume %q does not exist (its disk is gone)", id, name)
	}
	if err != nil {
		return volumeCopy{}, err
	}
	found := false
	for _, s := range snaps {
		found = found || s.ID == snap
	}
	if !found {
		return volumeCopy{}, failf(ErrNotFound, "source snapshot %s of volume %q does not exist", id, name)
	}
	src, err := d.cfg.Cloud.GetDisk(ctx, l, disk)
	if err != nil {
		return volumeCopy{}, err
	}
	return volumeCopy{loc: l, disk: disk, snap: snap, floorGiB: src.SizeGiB, meta: "snapshot:" + id}, nil
}

// volumeSource locks source volume id and reads its size.
func (d *Driver) volumeSource(ctx context.Context, name, id string) (volumeCopy, func(), error) {
	none := func() {}
	l, disk, ok, err := d.volumeRef(ctx, id)
	if err != nil {
		return volumeCopy{}, none, err
	}
	if !ok {
		return volumeCopy{}, none, failf(ErrNotFound, "source volume %q of volume %q does not exist", id, name)
	}
	// The copy goes through a snapshot of the source, which, as
	// CreateSnapshot does, holds the source volume's lock.
	release, err := d.locks.tryAs("volume "+id, fmt.Sprintf("volume %s (the source of volume %s)", id, name))
	if err != nil {
		return volumeCopy{}, none, err
	}
	src, err := d.cfg.Cloud.GetDisk(ctx, l, disk)
	if errors.Is(err, cloud.ErrNotFound) {
		release()
		return volumeCopy{}, none, failf(ErrNotFound, "source volume %s of volume %q does not exist", id, name)
	}
	if err != nil {
		release()
		return volumeCopy{}, none, fmt.Errorf("source volume %s of volume %q: %w", id, name, err)
	}
	return volumeCopy{loc: l, disk: disk, floorGiB: src.SizeGiB, meta: "volume:" + id}, release, nil
}

// createLocation chooses where a new volume goes: where its source is, if
// the topology allows that, or else as pickLocation chooses.
func (d *Driver) createLocation(ctx context.Context, t *csi.TopologyRequirement, src volumeCopy) (string, error) {
	if src.loc == "" {
		return d.pickLocation(ctx, t)
	}
	// A copy lives where its source is; the topology must allow that.
	if len(t.GetRequisite()) > 0 && !topologyAllows(t, src.loc) {
		return "", failf(ErrInvalid, "the source is in location %s, which the requested topology does not allow", src.loc)
	}
	return src.loc, nil
}

// matchExisting refuses a disk named name that an earlier call did not
// make as this one asks (limit 0 is no limit).
func matchExisting(existing *cloud.Disk, loc, name string, size, limit int64, meta diskMeta, diskType string) error {
	m, ours := parseDescription(existing.Description)
	switch {
	case !ours:
		return failf(ErrAlreadyExists, "a disk named %q (id %d in %s) exists that this driver did not create", name, existing.ID, loc)
	// Compatible with the capacity range is enough: a volume grown
	// since it was made still answers a repeated create.
	case existing.SizeGiB < size:
		return failf(ErrAlreadyExists, "volume %q exists with %d GiB, less than the requested %d GiB", name, existing.SizeGiB, size)
	case limit > 0 && existing.SizeGiB*gib > limit:
		return failf(ErrAlreadyExists, "volume %q exists with %d GiB, more than the limit of %d bytes", name, existing.SizeGiB, limit)
	case m != meta:
		return failf(ErrAlreadyExists, "volume %q exists with other parameters (encryption or source differ)", name)
	case existing.Type != diskType:
		return failf(ErrAlreadyExists, "volume %q exists as disk type %s, not %s", name, existing.Type, diskType)
	}
	return nil
}

// copySize is the size of a new volume: a new copy is at least its
// source's size. (An existing one is checked against the request alone:
// the source may have grown since it was made.)
func copySize(name string, size, limit int64, src volumeCopy) (int64, error) {
	if src.loc == "" || size >= src.floorGiB {
		return size, nil
	}
	if limit > 0 && src.floorGiB*gib > limit {
		return 0, failf(ErrOutOfRange, "the source of volume %q is %d GiB, more than the limit of %d bytes", name, src.floorGiB, limit)
	}
	return src.floorGiB, nil
}

// makeDisk creates the disk, empty or copied from src, and grows it to
// size if it came out smaller.
func (d *Driver) makeDisk(ctx context.Context, loc, name string, size int64, src volumeCopy, meta diskMeta, params createParams) (*cloud.Disk, error) {
	var id int64
	var err error
	switch {
	case src.snap != "":
		id, err = d.cfg.Cloud.CloneSnapshot(ctx, loc, src.disk, src.snap, name, meta.description())
	case src.disk != 0:
		id, err = d.cloneVolume(ctx, loc, src.disk, name, meta.description())
	default:
		id, err = d.cfg.Cloud.CreateDisk(ctx, loc, cloud.DiskSpec{Name: name, Description: meta.description(),
			SizeGiB: size, IOPS: params.iops, Type: params.diskType})
	}
	if err != nil {
		return nil, fmt.Errorf("creating volume %q in %s: %w", name, loc, err)
	}
	disk := &cloud.Disk{ID: id, Name: name, SizeGiB: size}
	if src.loc != "" {
		// A copy has its source's size, which may be less than asked.
		if disk, err = d.cfg.Cloud.GetDisk(ctx, loc, id); err != nil {
			return nil, err
		}
	}
	if disk.SizeGiB < size {
		if err := d.cfg.Cloud.ResizeDisk(ctx, loc, id, size); err != nil {
			return nil, fmt.Errorf("growing new volume %s to %d GiB: %w", volumeID(loc, id), size, err)
		}
		disk.SizeGiB = size
	}
	return disk, nil
}

func topologyAllows(t *csi.TopologyRequirement, loc string) bool {
	for _, x := range t.GetRequisite() {
		if x.GetSegments()[TopologyKey] == loc {
			return true
		}
	}
	return false
}

// cloneVolume copies a disk through a temporary snapshot, which the API
// needs as the clone's source, and removes the snapshot afterwards.
func (d *Driver) cloneVolume(ctx context.Context, loc string, src int64, name, desc string) (int64, error) {
	tmp := "vco-csi-clone-" + name
	snap, err := d.cfg.Cloud.CreateSnapshot(ctx, loc, src, tmp)
	if err != nil {
		return 0, err
	}
	id, err := d.cfg.Cloud.CloneSnapshot(ctx, loc, src, snap, name, desc)
	if derr := d.cfg.Cloud.DeleteSnapshot(ctx, loc, src, snap); derr != nil && err == nil && !errors.Is(derr, cloud.ErrNotFound) {
		return id, fmt.Errorf("clone made, but removing its temporary snapshot %s of disk %d failed: %w", snap, src, derr)
	}
	return id, err
}

// DeleteVolume deletes the disk; a disk that is already gone is success.
func (d *Driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, failf(ErrInvalid, "DeleteVolume needs a volume id")
	}
	loc, disk, ok, err := d.volumeRef(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return &csi.DeleteVolumeResponse{}, nil // no such volume can exist
	}
	release, err := d.locks.try("volume " + id)
	if err != nil {
		return nil, err
	}
	defer release()
	d.madeEmpty.take(volumeID(loc, disk))
	err = d.cfg.Cloud.DeleteDisk(ctx, loc, disk)
	if errors.Is(err, cloud.ErrNotFound) {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if errors.Is(err, cloud.ErrConflict) {
		return nil, failf(ErrPrecondition, "volume %s cannot be deleted now: %v", id, err)
	}
	if err != nil {
		return nil, fmt.Errorf("deleting volume %s: %w", id, err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// ValidateVolumeCapabilities confirms the capabilities the driver supports.
func (d *Driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, failf(ErrInvalid, "ValidateVolumeCapabilities needs a volume id")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, failf(ErrInvalid, "ValidateVolumeCapabilities needs volume capabilities")
	}
	if _, err := d.getDisk(ctx, id); err != nil {
		return nil, err
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	if _, err := parseParams(req.GetParameters()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters()}}, nil
}

func (d *Driver) getDisk(ctx context.Context, id string) (*cloud.Disk, error) {
	loc, disk, ok, err := d.volumeRef(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, failf(ErrNotFound, "volume %q does not exist (not a volume id of this driver)", id)
	}
	dk, err := d.cfg.Cloud.GetDisk(ctx, loc, disk)
	if errors.Is(err, cloud.ErrNotFound) {
		return nil, failf(ErrNotFound, "volume %s does not exist", id)
	}
	return dk, err
}

// publishedNodes names the node (reference_id) a disk is attached to.
func (d *Driver) publishedNodes(ctx context.Context, disk *cloud.Disk) ([]string, error) {
	if disk.VMID == 0 {
		return nil, nil
	}
	vm, ok, err := d.vms.byVMID(ctx, disk.VMID)
	if err != nil {
		return nil, err
	}
	if !ok || vm.ReferenceID == "" {
		return []string{fmt.Sprintf("vm-%d", disk.VMID)}, nil
	}
	return []string{canonicalUUID(vm.ReferenceID)}, nil
}

type listedVolume struct {
	loc  string
	disk cloud.Disk
	meta diskMeta
}

func (d *Driver) allVolumes(ctx context.Context) ([]listedVolume, error) {
	known, err := d.locations(ctx)
	if err != nil {
		return nil, err
	}
	locs := append([]string(nil), known...)
	sort.Strings(locs)
	var out []listedVolume
	for _, l := range locs {
		disks, err := d.cfg.Cloud.ListDisks(ctx, l)
		if err != nil {
			return nil, err
		}
		sort.Slice(disks, func(i, j int) bool { return disks[i].ID < disks[j].ID })
		for _, dk := range disks {
			if m, ok := parseDescription(dk.Description); ok {
				out = append(out, listedVolume{loc: l, disk: dk, meta: m})
			}
		}
	}
	return out, nil
}

// page cuts a list by a starting token (an index) and a maximum.
func page(n int, token string, max int32) (start, end int, next string, err error) {
	if token != "" {
		i, perr := strconv.Atoi(token)
		if perr != nil || i < 0 || i > n {
			return 0, 0, "", failf(ErrBadToken, "starting token %q is not one this driver gave out", token)
		}
		start = i
	}
	end = n
	if max < 0 {
		return 0, 0, "", failf(ErrInvalid, "max_entries must not be negative")
	}
	if max > 0 && start+int(max) < n {
		end = start + int(max)
		next = strconv.Itoa(end)
	}
	return start, end, next, nil
}

// ListVolumes lists the driver's disks in every location, with the node
// each is published to.
func (d *Driver) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	all, err := d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	start, end, next, err := page(len(all), req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, v := range all[start:end] {
		nodes, err := d.publishedNodes(ctx, &v.disk)
		if err != nil {
			return nil, err
		}
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: d.volume(v.loc, &v.disk, v.meta),
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: nodes},
		})
	}
	return resp, nil
}

// ControllerGetVolume reports one volume and where it is published.
func (d *Driver) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, failf(ErrInvalid, "ControllerGetVolume needs a volume id")
	}
	disk, err := d.getDisk(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	nodes, err := d.publishedNodes(ctx, disk)
	if err != nil {
		return nil, err
	}
	loc, _, _, _ := d.volumeRef(ctx, req.GetVolumeId()) // known since getDisk
	meta, _ := parseDescription(disk.Description)
	v := d.volume(loc, disk, meta)
	v.VolumeId = req.GetVolumeId() // a bare disk id stays what the PV says
	return &csi.ControllerGetVolumeResponse{
		Volume: v,
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: nodes},
	}, nil
}

// ControllerExpandVolume grows the disk to whole GiB; the filesystem and
// any mapping between the disk and the pod (the data mapping past an
// on-disk lease, the dm-crypt mapping) are grown by the node. Node
// expansion is required for raw block volumes too: the controller cannot
// know whether the node fences the disk with a lease or it is encrypted,
// and the node's expansion of a block volume with no mapping only reads
// the device's size (docs/csi-plugin.md).
func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, failf(ErrInvalid, "ControllerExpandVolume needs a volume id")
	}
	if req.GetCapacityRange() == nil {
		return nil, failf(ErrInvalid, "ControllerExpandVolume needs a capacity range")
	}
	size, err := sizeGiB(req.GetCapacityRange(), 0)
	if err != nil {
		return nil, err
	}
	release, err := d.locks.try("volume " + id)
	if err != nil {
		return nil, err
	}
	defer release()
	disk, err := d.getDisk(ctx, id)
	if err != nil {
		return nil, err
	}
	if disk.SizeGiB >= size {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: disk.SizeGiB * gib, NodeExpansionRequired: true}, nil
	}
	loc, diskID, _, _ := d.volumeRef(ctx, id) // known since getDisk
	if err := d.cfg.Cloud.ResizeDisk(ctx, loc, diskID, size); err != nil {
		return nil, fmt.Errorf("growing volume %s to %d GiB: %w", id, size, err)
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size * gib, NodeExpansionRequired: true}, nil
}

// snapshotEntry is a snapshot with the disk it belongs to.
type snapshotEntry struct {
	loc  string
	disk cloud.Disk
	snap cloud.Snapshot
	// taken stands in for the creation time while the API reports none.
	taken time.Time
}

// csi is the snapshot as CSI reports it. whitesky.cloud's snapshots have
// no status field: a snapshot is ready to use once the API reports its
// creation time (creation_time in the list and in the snapshot endpoint),
// and not before, even when its id is already known (docs/storage.md).
func (e snapshotEntry) csi() *csi.Snapshot {
	created := time.Unix(e.snap.CreationTime, 0)
	if e.snap.CreationTime <= 0 {
		created = e.taken
		if created.IsZero() {
			created = time.Now()
		}
	}
	return &csi.Snapshot{
		SnapshotId:     snapshotID(e.loc, e.disk.ID, e.snap.ID),
		SourceVolumeId: volumeID(e.loc, e.disk.ID),
		SizeBytes:      e.disk.SizeGiB * gib,
		CreationTime:   timestamppb.New(created),
		ReadyToUse:     e.snap.CreationTime > 0,
	}
}

// askSnapshot asks the snapshot endpoint about one snapshot of a disk and
// gives it as an entry, its creation time set only when the API reports
// one. cloud.ErrNotFound is passed on.
func (d *Driver) askSnapshot(ctx context.Context, loc string, disk cloud.Disk, snapID string) (snapshotEntry, error) {
	det, err := d.cfg.Cloud.GetSnapshot(ctx, loc, disk.ID, snapID)
	if err != nil {
		return snapshotEntry{}, err
	}
	if len(det.Disks) > 0 && !det.HasDisk(disk.ID) {
		return snapshotEntry{}, fmt.Errorf("the API's answer about snapshot %s of volume %s names other disks (%v)",
			snapID, volumeID(loc, disk.ID), det.Disks)
	}
	e := snapshotEntry{loc: loc, disk: disk, snap: cloud.Snapshot{ID: snapID, Name: det.Name}}
	if string(det.CreationTime) != "" {
		t, ok := det.Created()
		if !ok {
			// Reported, in a form this driver does not read: the list
			// carries it as an integer.
			list, err := d.cfg.Cloud.ListSnapshots(ctx, loc, disk.ID)
			if err != nil {
				return snapshotEntry{}, err
			}
			for _, s := range list {
				if s.ID == snapID && s.CreationTime > 0 {
					t = time.Unix(s.CreationTime, 0)
				}
			}
		}
		if !t.IsZero() {
			e.snap.CreationTime = t.Unix()
		}
	}
	return e, nil
}

func (d *Driver) snapshotsOf(ctx context.Context, loc string, disk cloud.Disk) ([]snapshotEntry, error) {
	snaps, err := d.cfg.Cloud.ListSnapshots(ctx, loc, disk.ID)
	if err != nil {
		return nil, err
	}
	sort.Slice(snaps, func(i, j int) bool { return snaps[i].ID < snaps[j].ID })
	var out []snapshotEntry
	for _, s := range snaps {
		if strings.HasPrefix(s.Name, "vco-csi-clone-") {
			continue // a clone's temporary snapshot, not a user's
		}
		out = append(out, snapshotEntry{loc: loc, disk: disk, snap: s})
	}
	return out, nil
}

func (d *Driver) allSnapshots(ctx context.Context) ([]snapshotEntry, error) {
	vols, err := d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	var out []snapshotEntry
	for _, v := range vols {
		s, err := d.snapshotsOf(ctx, v.loc, v.disk)
		if errors.Is(err, cloud.ErrNotFound) {
			continue // deleted while listing
		}
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	return out, nil
}

// CreateSnapshot snapshots a volume; the snapshot name is unique across
// the driver's volumes.
func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	name, src := req.GetName(), req.GetSourceVolumeId()
	if name == "" || src == "" {
		return nil, failf(ErrInvalid, "CreateSnapshot needs a name and a source volume id")
	}
	// The source volume is locked as every other call on it is, so a
	// snapshot is not taken while the disk is deleted or grown; the name
	// too, since a name is unique across volumes.
	release, err := d.locks.try("volume " + src)
	if err != nil {
		return nil, err
	}
	defer release()
	releaseName, err := d.locks.tryAs("snapshot name "+name, fmt.Sprintf("snapshot name %s (asked of volume %s)", name, src))
	if err != nil {
		return nil, err
	}
	defer releaseName()
	disk, err := d.getDisk(ctx, src)
	if err != nil {
		return nil, err
	}
	loc, _, _, _ := d.volumeRef(ctx, src) // known since getDisk
	// A repeated call finds its snapshot on the source disk; only a new
	// name costs the scan that keeps names unique across volumes.
	own, err := d.snapshotsOf(ctx, loc, *disk)
	if err != nil {
		return nil, err
	}
	for _, e := range own {
		if e.snap.Name == name {
			return &csi.CreateSnapshotResponse{Snapshot: e.csi()}, nil
		}
	}
	all, err := d.allSnapshots(ctx)
	if err != nil {
		return nil, err
	}
	for _, e := range all {
		if e.snap.Name != name {
			continue
		}
		if e.disk.ID != disk.ID || e.loc != loc {
			return nil, failf(ErrAlreadyExists, "snapshot %q exists for volume %s, not %s", name, volumeID(e.loc, e.disk.ID), src)
		}
		return &csi.CreateSnapshotResponse{Snapshot: e.csi()}, nil
	}
	sid, err := d.cfg.Cloud.CreateSnapshot(ctx, loc, disk.ID, name)
	if err != nil {
		return nil, fmt.Errorf("snapshotting volume %s: %w", src, err)
	}
	taken := time.Now()
	e, err := d.askSnapshot(ctx, loc, *disk, sid)
	switch {
	case errors.Is(err, cloud.ErrNotFound):
		// Taken, and not yet answered by the snapshot endpoint: not
		// ready; the snapshotter asks again and finds it by its name.
		e = snapshotEntry{loc: loc, disk: *disk, snap: cloud.Snapshot{ID: sid, Name: name}}
	case err != nil:
		return nil, fmt.Errorf("snapshot %s of volume %s was taken; asking the API about it: %w", sid, src, err)
	}
	e.taken = taken
	return &csi.CreateSnapshotResponse{Snapshot: e.csi()}, nil
}

// GetSnapshot reports one snapshot as the API's snapshot endpoint
// answers it, ready once the API reports its creation time.
func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, failf(ErrInvalid, "GetSnapshot needs a snapshot id")
	}
	loc, diskID, snap, ok := parseSnapshotID(id)
	if !ok {
		return nil, failf(ErrNotFound, "snapshot %s: not a snapshot id of this driver (<location>/<disk id>/<snapshot id>)", id)
	}
	disk, err := d.cfg.Cloud.GetDisk(ctx, loc, diskID)
	if errors.Is(err, cloud.ErrNotFound) {
		return nil, failf(ErrNotFound, "snapshot %s: its volume %s does not exist", id, volumeID(loc, diskID))
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	e, err := d.askSnapshot(ctx, loc, *disk, snap)
	if errors.Is(err, cloud.ErrNotFound) {
		return nil, failf(ErrNotFound, "snapshot %s does not exist", id)
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	return &csi.GetSnapshotResponse{Snapshot: e.csi()}, nil
}

// DeleteSnapshot deletes a snapshot; one already gone is success.
func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, failf(ErrInvalid, "DeleteSnapshot needs a snapshot id")
	}
	loc, disk, snap, ok := parseSnapshotID(id)
	if !ok {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	release, err := d.locks.try("snapshot " + id)
	if err != nil {
		return nil, err
	}
	defer release()
	err = d.cfg.Cloud.DeleteSnapshot(ctx, loc, disk, snap)
	if err != nil && !errors.Is(err, cloud.ErrNotFound) {
		return nil, fmt.Errorf("deleting snapshot %s: %w", id, err)
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists snapshots, all or by id or by source volume.
func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	var all []snapshotEntry
	switch {
	case req.GetSnapshotId() != "":
		loc, diskID, snap, ok := parseSnapshotID(req.GetSnapshotId())
		if !ok {
			return &csi.ListSnapshotsResponse{}, nil
		}
		disk, err := d.cfg.Cloud.GetDisk(ctx, loc, diskID)
		if errors.Is(err, cloud.ErrNotFound) {
			return &csi.ListSnapshotsResponse{}, nil
		}
		if err != nil {
			return nil, err
		}
		es, err := d.snapshotsOf(ctx, loc, *disk)
		if err != nil {
			return nil, err
		}
		for _, e := range es {
			if e.snap.ID == snap {
				all = append(all, e)
			}
		}
	case req.GetSourceVolumeId() != "":
		loc, diskID, ok, err := d.volumeRef(ctx, req.GetSourceVolumeId())
		if err != nil {
			return nil, err
		}
		if !ok {
			return &csi.ListSnapshotsResponse{}, nil
		}
		disk, err := d.cfg.Cloud.GetDisk(ctx, loc, diskID)
		if errors.Is(err, cloud.ErrNotFound) {
			return &csi.ListSnapshotsResponse{}, nil
		}
		if err != nil {
			return nil, err
		}
		if all, err = d.snapshotsOf(ctx, loc, *disk); err != nil {
			return nil, err
		}
	default:
		var err error
		if all, err = d.allSnapshots(ctx); err != nil {
			return nil, err
		}
	}
	start, end, next, err := page(len(all), req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, e := range all[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: e.csi()})
	}
	return resp, nil
}
