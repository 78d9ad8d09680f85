// Package driver holds vco-csi's CSI services: identity, the controller
// (which speaks to the whitesky.cloud API through a narrow Cloud interface)
// and the node service (which hands every privileged step to the host's
// vco-agent through the NodeAgent interface). Errors of every kind are
// turned into gRPC codes in one place, CodeForError.
package driver

import (
	"github.com/whitesky-cloud/vco-storage/crypt"

	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// TopologyKey is the node label and topology segment naming a location.
const TopologyKey = "cloud.whitesky/location"

// Cloud is the part of the whitesky.cloud API the controller uses.
// *cloud.Client implements it.
type Cloud interface {
	ListLocations(ctx context.Context) ([]string, error)
	LocationCapacity(ctx context.Context, loc string) (*cloud.Capacity, error)
	CreateDisk(ctx context.Context, loc string, spec cloud.DiskSpec) (int64, error)
	FindDiskByName(ctx context.Context, loc, name string) (*cloud.Disk, error)
	GetDisk(ctx context.Context, loc string, id int64) (*cloud.Disk, error)
	ListDisks(ctx context.Context, loc string) ([]cloud.Disk, error)
	DeleteDisk(ctx context.Context, loc string, id int64) error
	ResizeDisk(ctx context.Context, loc string, id, sizeGiB int64) error
	CreateSnapshot(ctx context.Context, loc string, diskID int64, name string) (string, error)
	ListSnapshots(ctx context.Context, loc string, diskID int64) ([]cloud.Snapshot, error)
	GetSnapshot(ctx context.Context, loc string, diskID int64, snapID string) (*cloud.SnapshotDetail, error)
	DeleteSnapshot(ctx context.Context, loc string, diskID int64, snapID string) error
	CloneSnapshot(ctx context.Context, loc string, diskID int64, snapID, name, description string) (int64, error)
	ListDiskNotes(ctx context.Context, loc string, diskID int64) ([]cloud.Note, error)
	SetDiskNoteIn(ctx context.Context, loc string, diskID int64, notes []cloud.Note, title, content string) error
	AddDiskNote(ctx context.Context, loc string, diskID int64, title, content string) error
	ListCloudspaces(ctx context.Context) ([]cloud.Cloudspace, error)
	ListVMs(ctx context.Context, cloudspace string) ([]cloud.VM, error)
	ListVMDisks(ctx context.Context, cloudspace string, vm int64) ([]cloud.VMDisk, error)
	AttachDisk(ctx context.Context, cloudspace string, vm, diskID int64) error
	DetachDisk(ctx context.Context, cloudspace string, vm, diskID int64) error
}

// Mode says which services a process serves.
type Mode string

const (
	ModeController Mode = "controller"
	ModeNode       Mode = "node"
	ModeAll        Mode = "all"
)

// Config is everything the driver needs.
type Config struct {
	Name    string
	Version string
	Mode    Mode

	// Controller.
	Cloud Cloud
	// DefaultLocation is used when a CreateVolume request has no topology;
	// empty means the first location the API lists.
	DefaultLocation string
	// AttachTimeout bounds the wait for an attached disk to show its PCI
	// address, within the request's own deadline. Default 2m.
	AttachTimeout time.Duration
	// AttachPoll is the interval between looks. Default 500ms.
	AttachPoll time.Duration

	// Node.
	Agent NodeAgent
	// KubeletRoot is the directory every staging and target path must lie
	// under. Default /var/lib/kubelet.
	KubeletRoot string
	// NodeLocationsDir is where the controller's map of reference_ids to
	// locations is projected (one file per reference_id); empty: no map,
	// and the agent's node.location must be set.
	NodeLocationsDir string
	// MaxVolumesPerNode is how many data disks the platform attaches to a
	// VM. The controller subtracts each VM's disks that are not volumes
	// of this driver and publishes the result with the VM's location; the
	// node reports its entry, or this when it has none. 0: the default.
	MaxVolumesPerNode int64
	// Transit wraps and unwraps encrypted volumes' passphrases with
	// TransitKey; nil means this node stages no encrypted volume.
	Transit    crypt.Wrapper
	TransitKey crypt.TransitKey
	// KeyBackendProblem, with Transit nil, is why the key backend the
	// cluster configured cannot be used: an encrypted stage is refused
	// with it (FAILED_PRECONDITION) while plain volumes are served as
	// usual. It names settings, never a secret.
	KeyBackendProblem error
	// Log gets what the node service does besides answering, such as the
	// rewrap of a token after a stage; nil discards it.
	Log *slog.Logger
	// Users, when set, is told which claim each volume staged here was
	// made for and which pods it is published to, so that what the agent
	// reports about a volume is shown on them (csi/kubeevents).
	Users VolumeUsers
}

// DefaultMaxVolumesPerNode is how many data disks a VM takes: the
// hot-plug PCI slots on the VM's root bus left after its own devices
// (boot disk, network interfaces), one per virtio disk (docs/csi-plugin.md,
// "Volume limit").
const DefaultMaxVolumesPerNode = 24

// Driver serves the CSI services.
type Driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	cfg     Config
	locks   *inflight
	vms     *vmIndex
	disks   *diskReads
	vmDisks *vmDiskReads
	legacy  legacyLocations
	// madeEmpty: volumes made empty here and not yet asked to publish.
	madeEmpty madeEmpty

	// Locations change rarely (a customer is granted a new one); they are
	// listed at most once a minute.
	locMu      sync.Mutex
	locs       []string
	locFetched time.Time
}

func (d *Driver) locations(ctx context.Context) ([]string, error) {
	d.locMu.Lock()
	defer d.locMu.Unlock()
	if d.locs != nil && time.Since(d.locFetched) < time.Minute {
		return d.locs, nil
	}
	locs, err := d.cfg.Cloud.ListLocations(ctx)
	if err != nil {
		return nil, err
	}
	d.locs, d.locFetched = locs, time.Now()
	return locs, nil
}

// New checks the configuration for the mode.
func New(cfg Config) (*Driver, error) {
	if cfg.Name == "" {
		return nil, errors.New("driver: a driver name is required")
	}
	switch cfg.Mode {
	case ModeController, ModeNode, ModeAll:
	default:
		return nil, fmt.Errorf("driver: mode %q is not controller, node or all", cfg.Mode)
	}
	if cfg.Mode != ModeNode && cfg.Cloud == nil {
		return nil, errors.New("driver: the controller needs the whitesky.cloud API")
	}
	if cfg.Mode != ModeController && cfg.Agent == nil {
		return nil, errors.New("driver: the node service needs the agent")
	}
	if cfg.AttachTimeout <= 0 {
		cfg.AttachTimeout = 2 * time.Minute
	}
	if cfg.AttachPoll <= 0 {
		cfg.AttachPoll = 500 * time.Millisecond
	}
	if cfg.KubeletRoot == "" {
		cfg.KubeletRoot = "/var/lib/kubelet"
	}
	if cfg.MaxVolumesPerNode <= 0 {
		cfg.MaxVolumesPerNode = DefaultMaxVolumesPerNode
	}
	d := &Driver{cfg: cfg, locks: newInflight()}
	if cfg.Cloud != nil {
		d.vms = newVMIndex(cfg.Cloud)
		d.disks = newDiskReads(cfg.Cloud)
		d.vmDisks = newVMDiskReads(cfg.Cloud)
	}
	return d, nil
}

func (d *Driver) controller() bool { return d.cfg.Mode != ModeNode }
func (d *Driver) node() bool       { return d.cfg.Mode != ModeController }

// GetPluginInfo names the driver.
func (d *Driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.cfg.Name, VendorVersion: d.cfg.Version}, nil
}

// GetPluginCapabilities says the plugin has a controller (when it runs one),
// honours topology, and expands online.
func (d *Driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	caps := []*csi.PluginCapability{
		svc(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{
			Type: csi.PluginCapability_VolumeExpansion_ONLINE}}},
	}
	if d.controller() {
		caps = append(caps, svc(csi.PluginCapability_Service_CONTROLLER_SERVICE))
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe is ready only when what the plugin depends on answers: the API for
// the controller, the agent for the node service.
func (d *Driver) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if d.controller() {
		if _, err := d.cfg.Cloud.ListLocations(ctx); err != nil {
			return nil, fmt.Errorf("probe: the whitesky.cloud API does not answer: %w", err)
		}
	}
	if d.node() {
		if _, err := d.cfg.Agent.Identity(ctx); err != nil {
			return nil, fmt.Errorf("probe: the node agent does not answer: %w", err)
		}
	}
	return &csi.ProbeResponse{Ready: wrapBool(true)}, nil
}
