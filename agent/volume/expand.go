package volume

// NodeExpand: the disk grown by the controller, then the data mapping,
// the dm-crypt mapping and the filesystem over it.

import (
	"context"
	"slices"

	mount "k8s.io/mount-utils"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// volumePath checks that p is the staging path or a target of c.
func (m *Manager) volumePath(c *Claim, p string) (string, error) {
	if p == "" {
		return c.StagingPath, nil
	}
	rp, err := confine(m.o.Config.KubeletRoot, "volume path", p)
	if err != nil {
		return "", err
	}
	if rp != c.StagingPath && !slices.Contains(c.Publications, rp) {
		return "", agenterr.New(agenterr.NotFound, "volume %s is not staged or published at %s", c.Volume, p)
	}
	return rp, nil
}

// Expand implements ExpandVolume: once the disk has reached required bytes,
// grow the data mapping (lease disks), the dm-crypt mapping (encrypted
// volumes) and the filesystem, online. A raw block volume has no
// filesystem: growing its mappings is what makes the pod's device node
// see the new size, and with no mapping (an unfenced or PR-fenced disk,
// not encrypted) the call only reads the size. It returns the usable
// size: the disk less the metadata kept before the volume's data.
func (m *Manager) Expand(ctx context.Context, volume, path string, required int64) (n int64, err error) {
	defer m.count("expand", &err)
	if volume == "" {
		return 0, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if required < 0 {
		return 0, agenterr.New(agenterr.InvalidArgument, "volume %s: required size %d is negative", volume, required)
	}
	release, err := m.locks.try(volume, "expand")
	if err != nil {
		return 0, err
	}
	defer release()
	c, err := m.store.Get(volume)
	if err != nil {
		return 0, err
	}
	if c == nil || c.Phase != PhaseStaged {
		return 0, agenterr.New(agenterr.NotFound, "volume %s is not staged on this node", volume)
	}
	if _, err := m.volumePath(c, path); err != nil {
		return 0, err
	}
	if c.Abnormal() {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s", volume, c.Detail)
	}
	// Grown through the recorded device node: only while it is still the
	// volume's disk, under the volume's fence.
	if err := m.stillOurs(ctx, c, "expansion"); err != nil {
		return 0, err
	}
	return m.grow(ctx, c, required)
}

// grow grows the staged volume c once its disk holds required bytes, and
// returns the usable size.
func (m *Manager) grow(ctx context.Context, c *Claim, required int64) (int64, error) {
	// required_bytes is the capacity the controller granted: the disk's
	// size. The device the filesystem sits on is the disk less our
	// metadata (the lease area, the LUKS2 header), so the disk itself is
	// what must have reached that size before anything is grown.
	disk, err := m.host.Size(c.Device)
	if err != nil {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	if required > 0 && disk < required {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: disk %s holds %d bytes, less than the %d asked for; the grown disk has not reached this node yet, retry",
			c.Volume, c.Device, disk, required)
	}
	if err := m.growMappings(ctx, c, disk); err != nil {
		return 0, err
	}
	// The usable size, reported back, is what the mapping the filesystem
	// sits on now holds.
	dev := c.MountDevice()
	size, err := m.host.Size(dev)
	if err != nil {
		return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
	}
	if !c.Block {
		if c.ReadOnly {
			return 0, agenterr.New(agenterr.FailedPrecondition, "volume %s is staged read-only; its filesystem cannot be grown", c.Volume)
		}
		if _, err := mount.NewResizeFs(m.exec).Resize(dev, c.StagingPath); err != nil {
			return 0, agenterr.New(agenterr.Internal, "volume %s: growing the %s filesystem on %s: %v", c.Volume, c.FsType, dev, err)
		}
	}
	m.log.Info("volume expanded", "volume", c.Volume, "device", dev, "bytes", size)
	return size, nil
}

// growMappings makes the data mapping (lease disks) and then the dm-crypt
// mapping (encrypted volumes) see the grown disk of disk bytes.
func (m *Manager) growMappings(ctx context.Context, c *Claim, disk int64) error {
	if c.DataDevice == "" && c.DataOffset > 0 {
		// Detached by an unstage that stopped after it: the disk itself
		// starts with the lease area, never the volume.
		return agenterr.New(agenterr.FailedPrecondition, "volume %s: its data mapping is detached (an unstage stopped after it); stage the volume again to remap it", c.Volume)
	}
	if c.DataDevice != "" {
		if !m.host.MapsDisk(c.DataDevice, c.Device) {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: its recorded data mapping %s is not a loop device over its disk %s; unstage and stage the volume again to remap it",
				c.Volume, c.DataDevice, c.Device)
		}
		if err := m.growData(c.DataDevice); err != nil {
			return agenterr.New(agenterr.Internal, "volume %s: %v", c.Volume, err)
		}
		if n, err := m.host.Size(c.DataDevice); err != nil || n != disk-c.DataOffset {
			return agenterr.New(agenterr.Internal, "volume %s: the data mapping %s holds %d bytes after growing, not the disk's %d less the %d-byte lease area (%v); unstage and stage the volume again to remap it",
				c.Volume, c.DataDevice, n, disk, c.DataOffset, err)
		}
		if err := m.growPodDevice(c); err != nil {
			return agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
		}
	}
	if c.Mapper == "" {
		return nil
	}
	if m.o.Crypt == nil {
		return agenterr.New(agenterr.FailedPrecondition, "volume %s is encrypted, but this agent has no LUKS2 support to grow its mapping", c.Volume)
	}
	if err := m.o.Crypt.Resize(ctx, m.mapperToClose(c)); err != nil {
		return agenterr.New(agenterr.Internal, "volume %s: growing the dm-crypt mapping: %v", c.Volume, err)
	}
	return nil
}
