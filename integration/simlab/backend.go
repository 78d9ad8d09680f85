// Package simlab is the whitesky.cloud simulator's lab mode: a disk is an
// iSCSI LUN that tgtd serves from a sparse file, and attaching it to a VM
// hot-plugs it over QMP into the QEMU guest whose SMBIOS UUID is the VM's
// reference_id. The controller and the node stack then meet the same
// thing they meet in a cloud: a PCI device at the address the API reports,
// with the disk id as its serial, and (as scsi-block) SCSI-3 persistent
// reservations that reach a real target shared by every node.
//
// Env puts the pieces together for the end-to-end scenarios and
// `vco-lab`: the lab, the simulator over HTTP on 127.0.0.1, and one VM per
// guest.
package simlab

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// Backend implements sim.Backend over a running lab.
type Backend struct {
	// Lab is the running lab whose tgtd serves the disks and whose guests
	// are the VMs.
	Lab *lab.Lab
	// Dir holds the disks' and snapshots' backing files.
	Dir string
	// Kind is how disks are shown to guests: lab.SCSIBlock (reservations
	// pass through to tgtd) or lab.VirtioBlk (no PR). PHYSICAL disks are
	// always scsi-block. Default lab.SCSIBlock.
	Kind lab.DiskKind
	// Logf, if set, receives one line per hot-plug and unplug.
	Logf func(format string, a ...any)

	mu       sync.Mutex
	luns     map[int64]*lab.LUN
	kinds    map[int64]lab.DiskKind
	detached map[string]bool // devices left in a paused guest by Detach
}

// FileVirtioBlk shows a disk as virtio-blk-pci over its backing file
// directly (QEMU's raw-over-file driver) instead of over iSCSI. tgtd fixes
// a LUN's size when it opens it and QEMU cannot grow an iSCSI disk, so
// this is the lab's way to grow a disk a running guest is using: QMP
// block_resize grows the file and the guest sees the capacity change, as
// a cloud's hypervisor would show it.
const FileVirtioBlk lab.DiskKind = "virtio-blk-file"

// Timeout bounds each backend operation (the simulator gives it no context).
const Timeout = 2 * time.Minute

// files keeps the disks' and snapshots' backing files in Dir as the
// simulator's host backend does; Backend serves them from the lab.
func (b *Backend) files() *sim.HostBackend { return &sim.HostBackend{Dir: b.Dir} }

// DiskFile is the backing file of disk id.
func (b *Backend) DiskFile(id int64) string { return b.files().DiskFile(id) }

// SetKind chooses how disk id is shown to guests from its next attach on.
func (b *Backend) SetKind(id int64, k lab.DiskKind) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.kinds == nil {
		b.kinds = map[int64]lab.DiskKind{}
	}
	b.kinds[id] = k
}

// SetDefaultKind chooses how disks without a kind of their own (SetKind)
// are shown to guests from their next attach on, and returns the kind it
// replaces.
func (b *Backend) SetDefaultKind(k lab.DiskKind) lab.DiskKind {
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.Kind
	b.Kind = k
	return prev
}

func (b *Backend) kind(id int64) lab.DiskKind {
	b.mu.Lock()
	defer b.mu.Unlock()
	if k, ok := b.kinds[id]; ok {
		return k
	}
	if b.Kind == "" {
		return lab.SCSIBlock
	}
	return b.Kind
}

func (b *Backend) logf(format string, a ...any) {
	if b.Logf != nil {
		b.Logf(format, a...)
	}
}

// serve makes the disk's file a LUN whose unit serial is the disk id: the
// serial the publish context names.
func (b *Backend) serve(id int64) error {
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	iqn := fmt.Sprintf("iqn.2026-11.cloud.whitesky.sim:disk-%d", id)
	lun, err := b.Lab.Target.ServeFile(ctx, iqn, b.DiskFile(id), strconv.FormatInt(id, 10), fmt.Sprintf("vcosim-%d", id))
	if err != nil {
		return fmt.Errorf("serving disk %d over iSCSI: %w", id, err)
	}
	b.mu.Lock()
	if b.luns == nil {
		b.luns = map[int64]*lab.LUN{}
	}
	b.luns[id] = lun
	b.mu.Unlock()
	return nil
}

// LUN returns the LUN serving disk id.
func (b *Backend) LUN(id int64) *lab.LUN {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.luns[id]
}

// CreateDisk makes a sparse file of the disk's size and serves it.
func (b *Backend) CreateDisk(id, sizeGiB int64) error { return b.CreateDiskBytes(id, sizeGiB<<30) }

// CreateDiskBytes makes a sparse file of size bytes and serves it: the
// simulator's create call takes its disk_size in GB (sim.ByteSizer).
func (b *Backend) CreateDiskBytes(id, size int64) error {
	if err := b.files().CreateDiskBytes(id, size); err != nil {
		return err
	}
	return b.serve(id)
}

// DeleteDisk stops serving the disk and removes its file.
func (b *Backend) DeleteDisk(id int64) error {
	if lun := b.LUN(id); lun != nil {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		defer cancel()
		if err := b.Lab.Target.RemoveTarget(ctx, lun.TID); err != nil {
			return fmt.Errorf("removing the iSCSI target of disk %d: %w", id, err)
		}
		b.mu.Lock()
		delete(b.luns, id)
		b.mu.Unlock()
	}
	return b.files().DeleteDisk(id)
}

// ResizeDisk grows the file. tgtd learns a LUN's size when it opens the
// file, so the LUN is served afresh; that drops the sessions of guests
// using it, which is why a disk attached to a running guest is refused.
//
// A FileVirtioBlk disk attached to running guests is grown online instead:
// block_resize in each of them.
func (b *Backend) ResizeDisk(id, sizeGiB int64) error {
	lun := b.LUN(id)
	if lun == nil {
		return fmt.Errorf("disk %d is not served by this lab", id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if b.kind(id) == FileVirtioBlk {
		if grown, err := b.resizeOnline(ctx, id, sizeGiB); grown || err != nil {
			return err
		}
	}
	if out, _ := b.Lab.Target.Show(ctx); targetHasSession(out, lun.IQN) {
		return fmt.Errorf("lab mode cannot grow disk %d while a guest is logged in to it (tgtd fixes a LUN's size when it opens it); detach it first", id)
	}
	if err := os.Truncate(b.DiskFile(id), sizeGiB<<30); err != nil {
		return err
	}
	if err := b.Lab.Target.RemoveTarget(ctx, lun.TID); err != nil {
		return err
	}
	return b.serve(id)
}

// resizeOnline grows a file-backed disk with block_resize in every guest
// that has it plugged in; it reports false when no guest has.
func (b *Backend) resizeOnline(ctx context.Context, id, sizeGiB int64) (bool, error) {
	grown := false
	for _, g := range b.Lab.Guests {
		if !b.hasDevice(ctx, g, devID(id)) {
			continue
		}
		if _, err := g.QMP().Execute(ctx, "block_resize", map[string]any{"node-name": nodeName(id), "size": sizeGiB << 30}); err != nil {
			return grown, fmt.Errorf("growing disk %d in %s (block_resize): %w", id, g.Name, err)
		}
		grown = true
		b.logf("disk %d grown to %d GiB in %s (block_resize)", id, sizeGiB, g.Name)
	}
	return grown, nil
}

// targetHasSession reads tgtadm's target listing: the block of the target
// named iqn lists an "I_T nexus" for each logged-in initiator.
func targetHasSession(show, iqn string) bool {
	blocks := strings.Split(show, "\nTarget ")
	for _, blk := range blocks {
		head, rest, _ := strings.Cut(blk, "\n")
		if strings.HasSuffix(strings.TrimSpace(head), iqn) {
			return strings.Contains(rest, "I_T nexus:")
		}
	}
	return false
}

// Snapshot copies the disk's file as it is now.
func (b *Backend) Snapshot(diskID int64, snapID string) error {
	return b.files().Snapshot(diskID, snapID)
}

// DeleteSnapshot removes the snapshot's file.
func (b *Backend) DeleteSnapshot(snapID string) error { return b.files().DeleteSnapshot(snapID) }

// CloneSnapshot copies a snapshot into a new disk and serves it.
func (b *Backend) CloneSnapshot(snapID string, newID int64) error {
	if err := b.files().CloneSnapshot(snapID, newID); err != nil {
		return err
	}
	return b.serve(newID)
}

// guest is the lab guest standing for vm, or nil when no guest has its
// reference_id (then attaching is bookkeeping only, as for VMs of other
// clusters).
func (b *Backend) guest(vm *sim.VMState) *lab.Guest {
	for _, g := range b.Lab.Guests {
		if strings.EqualFold(g.UUID, vm.ReferenceID) {
			return g
		}
	}
	return nil
}

func devID(id int64) string    { return fmt.Sprintf("vco-disk-%d", id) }
func ctlID(id int64) string    { return fmt.Sprintf("vco-scsi-%d", id) }
func nodeName(id int64) string { return fmt.Sprintf("bd-vco-disk-%d", id) }

// Attach hot-plugs the disk into vm's guest at PCI slot slot of bus 0:
// as scsi-block behind a virtio-scsi controller of its own at that slot
// (so the PCI address names the disk, as in the cloud), or as
// virtio-blk-pci there. The serial is the disk id either way.
func (b *Backend) Attach(vm *sim.VMState, id int64, bus, slot int) (string, error) {
	g := b.guest(vm)
	if g == nil {
		return "", nil
	}
	if bus != 0 {
		return "", fmt.Errorf("lab guests have one PCI bus; disk %d asked for bus %d", id, bus)
	}
	lun := b.LUN(id)
	if lun == nil {
		return "", fmt.Errorf("disk %d is not served by this lab", id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	q := g.QMP()
	addr := fmt.Sprintf("0x%x", slot)
	kind := b.kind(id)
	// A device left behind in a paused guest by an earlier Detach is
	// still there: take it away now, as the guest is being given the disk
	// again.
	b.mu.Lock()
	stale := b.detached[g.Name+"/"+devID(id)]
	b.mu.Unlock()
	if stale {
		if err := b.unplug(ctx, g, id); err != nil {
			return "", err
		}
	}
	bd := map[string]any{
		"driver": "iscsi", "node-name": nodeName(id), "transport": "tcp", "portal": lun.Portal,
		"target": lun.IQN, "lun": 1, "initiator-name": g.Initiator,
	}
	if kind == FileVirtioBlk {
		// No image locking: two guests may be given the disk (the
		// multi-attach fault), as they may share a LUN.
		bd = map[string]any{"driver": "raw", "node-name": nodeName(id),
			"file": map[string]any{"driver": "file", "filename": b.DiskFile(id), "locking": "off"}}
	}
	if _, err := q.Execute(ctx, "blockdev-add", bd); err != nil {
		return "", fmt.Errorf("attaching disk %d to %s: %w", id, g.Name, err)
	}
	undo := func() { _, _ = q.Execute(ctx, "blockdev-del", map[string]any{"node-name": nodeName(id)}) }
	switch kind {
	case lab.SCSIBlock:
		if _, err := q.Execute(ctx, "device_add", map[string]any{"driver": "virtio-scsi-pci", "id": ctlID(id), "bus": "pci.0", "addr": addr}); err != nil {
			undo()
			return "", fmt.Errorf("attaching disk %d to %s: controller at slot %d: %w", id, g.Name, slot, err)
		}
		if _, err := q.Execute(ctx, "device_add", map[string]any{"driver": "scsi-block", "id": devID(id), "drive": nodeName(id), "bus": ctlID(id) + ".0"}); err != nil {
			_ = b.delDevice(ctx, g, ctlID(id))
			undo()
			return "", fmt.Errorf("attaching disk %d to %s: %w", id, g.Name, err)
		}
	case lab.VirtioBlk, FileVirtioBlk:
		if _, err := q.Execute(ctx, "device_add", map[string]any{"driver": "virtio-blk-pci", "id": devID(id), "drive": nodeName(id),
			"bus": "pci.0", "addr": addr, "serial": strconv.FormatInt(id, 10), "share-rw": true}); err != nil {
			undo()
			return "", fmt.Errorf("attaching disk %d to %s: %w", id, g.Name, err)
		}
	default:
		undo()
		return "", fmt.Errorf("disk %d: lab mode shows disks as %s, %s or %s, not %q", id, lab.SCSIBlock, lab.VirtioBlk, FileVirtioBlk, kind)
	}
	b.logf("disk %d hot-plugged into %s as %s at PCI 00:%02x", id, g.Name, kind, slot)
	return fmt.Sprintf("%s:%s@00:%02x", g.Name, kind, slot), nil
}

// Detach unplugs the disk from vm's guest. A paused guest cannot answer
// the unplug request, so there the device stays: this is a dead node that
// comes back still seeing the disk, the case fencing exists for. The
// device goes when the disk is next attached to that guest.
func (b *Backend) Detach(vm *sim.VMState, id int64, _ string) error {
	g := b.guest(vm)
	if g == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	running, err := Running(ctx, g)
	if err != nil {
		return err
	}
	if !running {
		b.mu.Lock()
		if b.detached == nil {
			b.detached = map[string]bool{}
		}
		b.detached[g.Name+"/"+devID(id)] = true
		b.mu.Unlock()
		b.logf("disk %d detached from paused %s in the API only; the guest keeps the device", id, g.Name)
		return nil
	}
	if err := b.unplug(ctx, g, id); err != nil {
		return err
	}
	b.logf("disk %d unplugged from %s", id, g.Name)
	return nil
}

// unplug removes the disk's devices and then its block node. Each part
// that is already gone is skipped, so a retried detach finishes the work
// of one that failed half-way.
func (b *Backend) unplug(ctx context.Context, g *lab.Guest, id int64) error {
	for _, dev := range []string{ctlID(id), devID(id)} {
		if !b.hasDevice(ctx, g, dev) {
			continue
		}
		if err := b.delDevice(ctx, g, dev); err != nil {
			return fmt.Errorf("detaching disk %d from %s: %w", id, g.Name, err)
		}
	}
	// QEMU lets go of the block node a moment after the device is gone.
	for {
		_, err := g.QMP().Execute(ctx, "blockdev-del", map[string]any{"node-name": nodeName(id)})
		if err == nil || strings.Contains(err.Error(), "not found") || strings.Contains(err.Error(), "Cannot find") {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("detaching disk %d from %s: %w", id, g.Name, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	b.mu.Lock()
	delete(b.detached, g.Name+"/"+devID(id))
	b.mu.Unlock()
	return nil
}

func (b *Backend) hasDevice(ctx context.Context, g *lab.Guest, id string) bool {
	_, err := g.QMP().Execute(ctx, "qom-get", map[string]any{"path": "/machine/peripheral/" + id, "property": "type"})
	return err == nil
}

// delDevice asks the guest to release a PCI device and waits until QEMU
// reports it gone.
func (b *Backend) delDevice(ctx context.Context, g *lab.Guest, id string) error {
	q := g.QMP()
	if _, err := q.Execute(ctx, "device_del", map[string]any{"id": id}); err != nil {
		return err
	}
	for {
		if !b.hasDevice(ctx, g, id) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("guest %s did not release device %s: %w", g.Name, id, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Running reports whether the guest's CPUs run (false after QMP stop).
func Running(ctx context.Context, g *lab.Guest) (bool, error) {
	raw, err := g.QMP().Execute(ctx, "query-status", nil)
	if err != nil {
		return false, fmt.Errorf("asking %s whether it runs: %w", g.Name, err)
	}
	var st struct {
		Running bool `json:"running"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return false, fmt.Errorf("%s: query-status: %w", g.Name, err)
	}
	return st.Running, nil
}
