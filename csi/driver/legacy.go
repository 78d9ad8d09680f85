package driver

import (
	"context"
	"strconv"
	"sync"
)

// Volumes of the driver this one replaces (the earlier whitesky.cloud CSI
// driver, registered under the same driver name) have the bare disk id as
// their volume id, so the PVs Kubernetes keeps for them name no location.
// The controller finds it by listing the locations' disks, once per disk
// id: a disk never moves between locations. What staging such a disk takes
// is in docs/storage.md, "Volumes of the earlier driver".

// legacyDiskID reads a bare disk id, the earlier driver's volume id.
func legacyDiskID(id string) (int64, bool) {
	if id == "" || id[0] == '0' || id[0] == '+' || id[0] == '-' {
		return 0, false
	}
	n, err := strconv.ParseInt(id, 10, 64)
	return n, err == nil && n > 0
}

// legacyLocations remembers where bare disk ids were found.
type legacyLocations struct {
	mu  sync.Mutex
	loc map[int64]string
}

// volumeRef finds the location and disk a volume id names: from the id
// itself ("<location>/<disk id>"), or for a bare disk id from the
// locations' disk listings. ok is false when the id names no disk: not an
// id of either form, or a bare id no location has. err is an API failure.
func (d *Driver) volumeRef(ctx context.Context, id string) (loc string, disk int64, ok bool, err error) {
	if loc, disk, ok := parseVolumeID(id); ok {
		return loc, disk, true, nil
	}
	n, ok := legacyDiskID(id)
	if !ok {
		return "", 0, false, nil
	}
	d.legacy.mu.Lock()
	l, known := d.legacy.loc[n]
	d.legacy.mu.Unlock()
	if known {
		return l, n, true, nil
	}
	locs, err := d.locations(ctx)
	if err != nil {
		return "", 0, false, err
	}
	for _, l := range locs {
		disks, err := d.disks.s.get(ctx, l, 0) // the location's listing, shared
		if err != nil {
			return "", 0, false, err
		}
		d.legacy.mu.Lock()
		if d.legacy.loc == nil {
			d.legacy.loc = map[int64]string{}
		}
		for _, dk := range disks {
			d.legacy.loc[dk.ID] = l
		}
		d.legacy.mu.Unlock()
		for _, dk := range disks {
			if dk.ID == n {
				return l, n, true, nil
			}
		}
	}
	return "", 0, false, nil
}
