package volume

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
)

// The pod device. A raw block volume of a lease-fenced disk lives on the
// data mapping, a loop device over the disk from the lease's data offset.
// Whoever holds a loop device open for writing may change its offset and
// size limit (LOOP_SET_STATUS64 asks for no capability then), so a pod
// given the data mapping itself could move it over the lease area. The
// pod is given the pod device instead: a second loop device, over the
// data mapping from its byte 0, whatever the pod makes of its offset and
// size stays inside the data area. It reads and writes the data mapping
// with direct I/O where the kernel allows it, so the pod's data is not
// cached in the data mapping's page cache too. An encrypted volume needs
// none: its pod gets the dm-crypt mapping, whose ioctls reach the device
// below only with CAP_SYS_RAWIO.
//
// The stage makes it after the data mapping and the claim's record names
// it before it is bound (PodDevice); it is detached before the data
// mapping, and the record stops naming it once it is (unmapPodRecorded).
// It is found only through the record: the kubelet's own loop device over
// a published raw block device looks the same in sysfs, so none is ever
// taken for a pod device by a search.

// needsPodDevice reports whether c's pod is given a pod device: a raw
// block volume on the data mapping, not encrypted.
func needsPodDevice(c *Claim) bool {
	return c.Block && !c.Encrypted && c.Mapper == "" && c.DataDevice != ""
}

// podDevice attaches the pod device over the data mapping, telling name
// the loop device's path before it is bound (the record names it first).
func podDevice(mapping string, readOnly bool, name func(p string) error) (string, error) {
	p, err := loopdev.AttachWith(mapping, 0, loopdev.Options{ReadOnly: readOnly, DirectIO: true, Naming: name})
	if err != nil {
		return "", fmt.Errorf("the pod device over the data mapping %s: %w", mapping, err)
	}
	return p, nil
}

// dropPodDevice detaches the pod device at p; one detached already (a
// detached loop device keeps its node) is done.
func dropPodDevice(p string) error {
	if _, err := os.Stat(p); err != nil || !loopBound(p) {
		return nil
	}
	// Not left behind for the loop device's next user (drainData set it
	// when the claim was lost).
	_ = clearReadOnly(p)
	if err := loopdev.Detach(p); err != nil {
		return fmt.Errorf("the pod device: %w", err)
	}
	return nil
}

// loopOver reads whether the device p (under the host's device
// directory) is a loop device bound to the backing file backing: false
// for one that is not bound, or bound to another file; an error when
// sysfs could not be read.
func (h osHost) loopOver(p, backing string) (bool, error) {
	name := filepath.Base(p)
	if !strings.HasPrefix(name, "loop") || filepath.Dir(p) != filepath.Clean(h.dev) || backing == "" {
		return false, nil
	}
	if _, err := os.Stat(filepath.Join(h.sysfs, "block", name)); err != nil {
		if os.IsNotExist(err) {
			return false, nil
		}
		return false, err
	}
	b, err := os.ReadFile(filepath.Join(h.sysfs, "block", name, "loop", "backing_file"))
	if os.IsNotExist(err) {
		return false, nil // not bound
	}
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == backing, nil
}

func (h osHost) PodDeviceOver(p, mapping string) (bool, error) { return h.loopOver(p, mapping) }

// mapPodDevice gives a raw block volume on the data mapping its pod
// device (a stage's step, after the data mapping and dm-crypt): the
// record names it before it is bound; the rollback detaches it.
func (s *staging) mapPodDevice(context.Context) error {
	m, c := s.m, s.c
	if !needsPodDevice(c) {
		return nil
	}
	if err := m.unmapPodRecorded(c); err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	// Pushed first: an attach that failed may have bound the device the
	// record names (its answer lost), which the undo detaches only if it
	// is over the data mapping, and stops naming either way.
	s.undo.push(func() {
		if err := m.unmapPodRecorded(c); err != nil {
			m.log.Error("could not detach the pod device of a failed stage", "volume", c.Volume, "err", err)
		}
	})
	p, err := m.mapPod(c.DataDevice, c.ReadOnly, func(p string) error {
		c.PodDevice = p
		return m.store.Put(c)
	})
	if err != nil {
		return fmt.Errorf("volume %s: %w", c.Volume, err)
	}
	c.PodDevice = p
	return nil
}

// unmapPodRecorded detaches the pod device c's record names, only while it
// is a loop device over the data mapping the record names, itself over
// the claim's disk: a damaged or hostile record, or a number the kernel
// gave to another loop device since, never makes the agent detach another
// device. Unlike the data mapping's, the record stops naming it only once
// it is detached (or found not over the data mapping): nothing may look
// for an unnamed one (the kubelet's loop device over a published raw
// block device looks the same), and one left unnamed by a crash would
// hold the data mapping, and so the fence, for good; a name left by a
// crash right after the detach is dropped by the retry, which finds it
// not over the data mapping. A device that could not be looked at stays
// named, and the caller stops.
func (m *Manager) unmapPodRecorded(c *Claim) error {
	p := c.PodDevice
	if p == "" {
		return nil
	}
	over, err := m.host.PodDeviceOver(p, c.DataDevice)
	if err != nil {
		return fmt.Errorf("whether the pod device %s is still over the data mapping %s could not be read: %w", p, c.DataDevice, err)
	}
	if over && !m.host.MapsDisk(c.DataDevice, c.Device) {
		return fmt.Errorf("the pod device %s is over %s, which the record names as the data mapping, but that is not a loop device over the disk %s; left alone: detach them by hand if they are not another volume's", p, c.DataDevice, c.Device)
	}
	if over {
		if err := m.unmapPod(p); err != nil {
			return err
		}
	} else {
		m.log.Warn("the pod device the claim's record names is not a loop device over its data mapping; left alone", "volume", c.Volume, "pod_device", p, "mapping", c.DataDevice)
	}
	c.PodDevice = ""
	return m.store.Put(c)
}

// podDeviceIntact reports whether a raw block volume on the data mapping
// has its pod device, as its record names it, over that mapping.
func (m *Manager) podDeviceIntact(c *Claim) bool {
	if !needsPodDevice(c) {
		return true
	}
	if c.PodDevice == "" {
		return false
	}
	ok, err := m.host.PodDeviceOver(c.PodDevice, c.DataDevice)
	return err == nil && ok
}

// growPodDevice makes the pod device see the grown data mapping (after
// it): LOOP_SET_CAPACITY keeps the offset and size limit the pod set.
func (m *Manager) growPodDevice(c *Claim) error {
	if c.PodDevice == "" {
		return nil
	}
	ok, err := m.host.PodDeviceOver(c.PodDevice, c.DataDevice)
	if err != nil || !ok {
		return fmt.Errorf("its recorded pod device %s is not a loop device over its data mapping %s (%v); unstage and stage the volume again to remap it", c.PodDevice, c.DataDevice, err)
	}
	if err := m.resizeLoop(c.PodDevice); err != nil {
		return fmt.Errorf("growing the pod device: %w", err)
	}
	return nil
}
