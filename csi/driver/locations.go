package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/internal/location"
)

// A node's location is its topology label, so it must be right. The
// controller knows every VM's location (its cloudspace's) by reference_id,
// which is the node id; it publishes that map (NodeLocationMap, written by
// RunNodeLocations) and the node plugin reads its own entry from the map as
// the kubelet projects it (Config.NodeLocationsDir: one file per
// reference_id, holding the location). The agent's node.location is an
// optional override that must agree (docs/csi-plugin.md, "Node location").

// NodeLocationsConfigMap is the ConfigMap the controller keeps the map in,
// in its own namespace: key = canonical reference_id, value = location.
const NodeLocationsConfigMap = "vco-csi-node-locations"

// MaxVolumesSuffix ends the map's key that holds a node's volume limit:
// "<reference_id>.max-volumes" (volumeLimits).
const MaxVolumesSuffix = ".max-volumes"

// NodeLocationMap lists every VM of the customer that has a reference_id,
// with its location (key: the reference_id) and its volume limit (key:
// reference_id + MaxVolumesSuffix), as of a fresh listing.
func (d *Driver) NodeLocationMap(ctx context.Context) (map[string]string, error) {
	if !d.controller() {
		return nil, errors.New("driver: only the controller knows the VMs' locations")
	}
	vms, err := d.vms.all(ctx)
	if err != nil {
		return nil, err
	}
	limits, err := d.volumeLimits(ctx, vms)
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, 2*len(vms))
	for ref, r := range vms {
		out[ref] = r.Location
		out[ref+MaxVolumesSuffix] = strconv.FormatInt(limits[ref], 10)
	}
	return out, nil
}

// volumeLimits is how many volumes of this driver each VM can take: the
// data disks the platform attaches to a VM (MaxVolumesPerNode: the PCI
// slots left for hot-plugged virtio disks, the model the API gives the
// driver's disks) less the VM's data disks that are not volumes of this
// driver (an etcd disk, a disk attached by hand). The boot disk is one of
// the VM's own devices and takes none of those slots. A disk the
// location's listing does not show counts as not ours. Never less than 1:
// 0 would mean no limit to Kubernetes (docs/csi-plugin.md, "Volume limit").
func (d *Driver) volumeLimits(ctx context.Context, vms map[string]vmRef) (map[string]int64, error) {
	byLoc := map[string]map[int64]cloud.Disk{}
	for _, r := range vms {
		if len(r.Disks) == 0 || byLoc[r.Location] != nil {
			continue
		}
		disks, err := d.cfg.Cloud.ListDisks(ctx, r.Location)
		if err != nil {
			return nil, err
		}
		m := make(map[int64]cloud.Disk, len(disks))
		for _, dk := range disks {
			m[dk.ID] = dk
		}
		byLoc[r.Location] = m
	}
	out := make(map[string]int64, len(vms))
	for ref, r := range vms {
		foreign := int64(0)
		for _, id := range r.Disks {
			dk, ok := byLoc[r.Location][id]
			if _, ours := parseDescription(dk.Description); ok && (ours || strings.EqualFold(dk.Type, cloud.DiskTypeBoot)) {
				continue
			}
			foreign++
		}
		out[ref] = max(d.cfg.MaxVolumesPerNode-foreign, 1)
	}
	return out, nil
}

// RunNodeLocations writes the map with write now and after every period
// while ctx lasts, whenever it changed; a failed listing or write is
// logged and tried again at the next period.
func (d *Driver) RunNodeLocations(ctx context.Context, log *slog.Logger, every time.Duration, write func(context.Context, map[string]string) error) {
	var last map[string]string
	for {
		m, err := d.NodeLocationMap(ctx)
		if err == nil && !maps.Equal(m, last) {
			if err = write(ctx, m); err == nil {
				log.Info("node location map written", "vms", len(m))
				last = m
			}
		}
		if err != nil && ctx.Err() == nil {
			log.Error("node location map not written; nodes not yet in it report no location", "err", err)
		}
		t := time.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// WriteNodeLocationDir writes the map as the kubelet projects a ConfigMap:
// one file per key in dir, each written whole (temporary file, rename);
// files of keys no longer in the map are removed. For the controller where
// there is no Kubernetes (the lab).
func WriteNodeLocationDir(dir string, m map[string]string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for k, v := range m {
		tmp := filepath.Join(dir, ".tmp-"+k)
		if err := os.WriteFile(tmp, []byte(v), 0o644); err != nil {
			return err
		}
		if err := os.Rename(tmp, filepath.Join(dir, k)); err != nil {
			return err
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if _, ok := m[e.Name()]; !ok && !strings.HasPrefix(e.Name(), ".") {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// nodeLocation decides the node's location from what the controller's map
// says (learned, "" when the node is not in it or there is no map) and the
// agent's node.location (configured, "" when not set), or says in a
// sentence why the node has none.
func (d *Driver) nodeLocation(uuid, configured string) (string, error) {
	if configured != "" {
		if err := location.Check(configured); err != nil {
			return "", failf(ErrPrecondition, "this node's location is not usable: the agent's node.location %v; "+
				"remove it from the agent's configuration (/etc/vco-agent/config.yaml), so that the node takes its VM's location from the controller, or set it to that location, and restart vco-agent", err)
		}
	}
	learned, where, err := d.learnedLocation(uuid)
	if err != nil {
		return "", err
	}
	switch {
	case learned != "" && configured != "" && learned != configured:
		return "", failf(ErrPrecondition, "this node's location is in doubt: the agent's node.location says %s, but the controller lists this node's VM (reference_id %s) in %s (%s); "+
			"correct or remove node.location in the agent's configuration and restart vco-agent", configured, uuid, learned, where)
	case learned != "":
		return learned, nil
	case configured != "":
		return configured, nil
	case d.cfg.NodeLocationsDir == "":
		return "", failf(ErrPrecondition, "this node's location is unknown: the agent's node.location is not set and the node plugin reads no location map (--node-locations-dir); "+
			"give the node plugin the controller's map (ConfigMap %s) or set node.location in the agent's configuration", NodeLocationsConfigMap)
	default:
		return "", failf(ErrPrecondition, "this node's location is unknown: the controller's map (%s) has no VM with reference_id %s yet, and the agent's node.location is not set; "+
			"the controller lists the customer's VMs every minute, so a VM of this customer appears soon; if it does not, check that this VM belongs to the customer the controller's credential is for", where, uuid)
	}
}

// learnedLocation reads the node's entry in the projected map.
func (d *Driver) learnedLocation(uuid string) (loc, where string, err error) {
	if d.cfg.NodeLocationsDir == "" {
		return "", "", nil
	}
	path := filepath.Join(d.cfg.NodeLocationsDir, canonicalUUID(uuid))
	where = fmt.Sprintf("ConfigMap %s, as %s", NodeLocationsConfigMap, path)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Sprintf("ConfigMap %s, as %s", NodeLocationsConfigMap, d.cfg.NodeLocationsDir), nil
	}
	if err != nil {
		return "", where, failf(ErrPrecondition, "this node's location is unknown: reading the controller's map: %v", err)
	}
	loc = strings.TrimSpace(string(b))
	if err := location.Check(loc); err != nil {
		return "", where, failf(ErrPrecondition, "this node's location is unknown: the controller's map (%s) says %v", where, err)
	}
	return loc, where, nil
}

// nodeVolumeLimit is the node's entry for its volume limit in the
// controller's map, or MaxVolumesPerNode when there is none.
func (d *Driver) nodeVolumeLimit(uuid string) int64 {
	if d.cfg.NodeLocationsDir == "" {
		return d.cfg.MaxVolumesPerNode
	}
	b, err := os.ReadFile(filepath.Join(d.cfg.NodeLocationsDir, canonicalUUID(uuid)+MaxVolumesSuffix))
	if err != nil {
		return d.cfg.MaxVolumesPerNode
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n < 1 {
		return d.cfg.MaxVolumesPerNode
	}
	return n
}
