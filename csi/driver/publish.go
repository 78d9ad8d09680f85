package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// Publish context keys: where the node finds the disk, and what it may do
// to take it over. The grant is fence.Grant's JSON ({"disk": volume id,
// "node": SMBIOS UUID, "supersedes": ["0x..."]}), the keys derived with
// fence.KeyFromUUID from the earlier holders' reference_ids.
const (
	PubDiskID     = "cloud.whitesky/disk-id"
	PubPCIBus     = "cloud.whitesky/pci-bus"
	PubPCISlot    = "cloud.whitesky/pci-slot"
	PubSerial     = "cloud.whitesky/serial"
	PubFenceGrant = "cloud.whitesky/fence-grant"
	// PubNeverPublished is "true" when no publish context had been
	// returned for the disk before this one (see neverPublished; for one
	// case of two controllers, to another node: see madeEmpty): no other
	// node can have claimed it, so its stage need not wait for a holder to
	// re-establish a claim the target forgot. Any other value, or none,
	// means the disk may have had a holder.
	PubNeverPublished = "cloud.whitesky/never-published"
)

// NeverPublished reads PubNeverPublished from a publish context.
func NeverPublished(pc map[string]string) bool { return pc[PubNeverPublished] == "true" }

// The controller records on the disk's notes which nodes may hold a fence
// key on it, because a takeover grant must name them and the notes are the
// only state that outlives a controller restart. After a node dies,
// Kubernetes detaches the disk first and publishes it elsewhere later, and
// by then the cloud no longer says who had it.
//
// holdersNote lists, oldest first and comma-separated, the canonical UUID
// of every node the controller has attached the disk to or may have: a node
// goes into the list before the attach to it is asked for, and stays. A
// node can only have registered a key on the disk by staging it, which
// needs an attachment; nothing the controller sees proves that the key is
// gone again (an unpublish follows a clean unstage or a dead node's forced
// detach alike, and a publish is no proof that the node staged and took the
// earlier keys over), so no event removes a node but the bound below.
//
// holderNote is the form earlier versions kept, the last node only. It is
// still written, after holdersNote, so that an earlier controller run
// after this one grants at least the takeover of the last holder, and read,
// so that a disk published by an earlier version (or by one run in
// between) loses none of its holders.
const (
	holdersNote = "vco-csi/holders"
	holderNote  = "vco-csi/holder"
)

// maxHolders bounds holdersNote. When a node is added to a full list the
// oldest is dropped. Its key can still hold the disk only if none of the
// maxHolders nodes published after it staged the disk (a stage leaves the
// disk held by the node that staged, and their grants named the dropped
// node); a stage that meets it anyway is refused naming the key, as for
// any holder no grant names.
const maxHolders = 32

// Two more notes say whether a publish context was ever returned for the
// disk. The driver writes each once and never changes or removes either:
// an unpublish leaves them, unlike a note that tracked the attachment.
//
// publishedNote names the node the first publish context went to. It is
// written before that context is returned, so a disk without it has had
// none. firstPublishNote names the node of the first publish attempt; it
// is written before the holder notes on a disk that has none of these, so a
// holder note without it comes from a driver that did not keep
// publishedNote, and such a disk counts as published. A clone or a
// restored snapshot is a new disk without notes; were the cloud to copy
// its source's notes, it would count as published (its first stage waits).
const (
	publishedNote    = "vco-csi/published"
	firstPublishNote = "vco-csi/first-publish"
)

// neverPublished says whether no publish context was ever returned for
// the disk: no published note, and either no holder note (of either form)
// or the holder notes of a first publish attempt that did not return (a
// retry after an attach that timed out).
func neverPublished(notes []cloud.Note) bool {
	if hasNote(notes, publishedNote) {
		return false
	}
	return !(hasNote(notes, holderNote) || hasNote(notes, holdersNote)) || hasNote(notes, firstPublishNote)
}

func hasNote(notes []cloud.Note, title string) bool {
	for _, n := range notes {
		if n.Title == title {
			return true
		}
	}
	return false
}

// madeEmpty holds the volumes this controller made empty (not copies) and
// has not been asked to publish since. Nothing but this controller knows
// such a disk's id yet, so it is expected to carry no notes, and its first
// publish adds the holders note naming its node beside its reads instead
// of after them: one round trip less on the way to the attach, which still
// waits for the note. The expectation decides nothing. The reads are
// judged as for any disk; holders they show are written into the list as
// usual, and the list into every holders note (writeHolders). Every note
// of the title counts, so adding one never removes a holder. A restarted
// controller has forgotten the set, and its publishes go the usual way.
//
// The note goes out early only for a node whose VM the controller already
// knows in the volume's location: a publish to a node that is no VM of the
// customer's, or is in another location, is refused having changed
// nothing, as any bad request (but for a VM deleted within the ten minutes
// the controller keeps what it listed: its note names an absent key).
//
// Such a publish's reads may show the added note or not; its form
// (earlyNote) tells it apart, and it does not count against
// never-published there. Two controllers can both hold a volume in the
// set (a CreateVolume retried at the other finds the disk by name in
// cloud.Client.CreateDisk's retry). Should both publish it first to the
// same node, the second says never published too: the first context went
// to that node, so still no other node can have claimed the disk. An added
// note naming another node counts.
type madeEmpty struct {
	mu  sync.Mutex
	ids map[string]time.Time
}

// maxMadeEmpty bounds the set. When it is full, volumes made over
// madeEmptyFor ago are dropped; a volume made while it is still full is
// published the usual way.
const (
	maxMadeEmpty = 4096
	madeEmptyFor = time.Hour
)

func (m *madeEmpty) add(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ids == nil {
		m.ids = map[string]time.Time{}
	}
	if len(m.ids) >= maxMadeEmpty {
		for k, t := range m.ids {
			if time.Since(t) > madeEmptyFor {
				delete(m.ids, k)
			}
		}
	}
	if len(m.ids) < maxMadeEmpty {
		m.ids[id] = time.Now()
	}
}

// take says whether id is in the set, and removes it.
func (m *madeEmpty) take(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.ids[id]
	delete(m.ids, id)
	return ok
}

// mayHoldData says whether a disk may hold data before any node of ours
// wrote it: a copy (its description names a source) or a disk this driver
// did not make.
func mayHoldData(disk *cloud.Disk) bool {
	m, ours := parseDescription(disk.Description)
	return !ours || m.Source != ""
}

// canonicalUUID is the form node ids and fence keys are derived from.
func canonicalUUID(s string) string { return strings.ToLower(strings.TrimSpace(s)) }

// ControllerPublishVolume attaches the disk to the node's VM.
func (d *Driver) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if err := checkPublish(req); err != nil {
		return nil, err
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	release, err := d.locks.try("volume " + id)
	if err != nil {
		return nil, err
	}
	defer release()
	p, err := d.publishTarget(ctx, id, node)
	if err != nil {
		return nil, err
	}
	if err := d.recordHolders(ctx, p); err != nil {
		return nil, err
	}
	if err := d.attach(ctx, p); err != nil {
		return nil, err
	}
	vd, err := d.waitAttached(ctx, p.vm, p.diskID)
	if err != nil {
		return nil, fmt.Errorf("volume %s on node %s: %w", id, node, err)
	}
	pc, err := d.publishContext(ctx, p, vd)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pc}, nil
}

// checkPublish checks what ControllerPublishVolume is asked before
// anything is locked or looked up.
func checkPublish(req *csi.ControllerPublishVolumeRequest) error {
	if req.GetVolumeId() == "" || req.GetNodeId() == "" {
		return failf(ErrInvalid, "ControllerPublishVolume needs a volume id and a node id")
	}
	if req.GetVolumeCapability() == nil {
		return failf(ErrInvalid, "ControllerPublishVolume needs a volume capability")
	}
	return checkCapabilities([]*csi.VolumeCapability{req.GetVolumeCapability()})
}

// publication is one ControllerPublishVolume call: volume id's disk and the
// VM of node, then what the disk's notes say of its holders.
type publication struct {
	id, node string
	loc      string
	diskID   int64
	disk     *cloud.Disk
	vm       vmRef

	// Read once by publishTarget; every write but the added note (early)
	// is decided from them.
	notes []cloud.Note
	// me is the node's canonical UUID, its fence key's source.
	me string
	// holders are the recorded holders with me among them.
	holders []string
	// never: no publish has been recorded on the disk.
	never bool
	// early: a holders note naming only me was added beside the reads
	// (madeEmpty).
	early bool
	// track: the disk may hold data no node of ours wrote (mayHoldData).
	track bool
}

// publishTarget finds the disk of volume id, the VM of node and the disk's
// notes, and refuses a VM in another location or a disk attached to
// another VM. The three reads go out side by side (they change nothing),
// with, on the first publish of a disk this controller made empty, the
// holders note naming node (madeEmpty); what the reads say is judged in
// the order one reader after the other would.
func (d *Driver) publishTarget(ctx context.Context, id, node string) (publication, error) {
	p := publication{id: id, node: node}
	loc, diskID, ok, err := d.volumeRef(ctx, id)
	if err != nil {
		return p, err
	}
	if !ok {
		return p, failf(ErrNotFound, "volume %q does not exist (not a volume id of this driver, nor a disk id any location has)", id)
	}
	p.loc, p.diskID = loc, diskID
	var (
		wg                                sync.WaitGroup
		vm                                vmRef
		vmFound                           bool
		diskErr, vmErr, noteErr, earlyErr error
	)
	me, meErr := fence.CanonicalUUID(node)
	p.early = d.madeEmpty.take(volumeID(loc, diskID)) && meErr == nil && d.vms.knownIn(node, loc)
	wg.Go(func() { p.disk, diskErr = d.disks.byID(ctx, loc, diskID) })
	wg.Go(func() { vm, vmFound, vmErr = d.vms.byNode(ctx, node) })
	wg.Go(func() { p.notes, noteErr = d.cfg.Cloud.ListDiskNotes(ctx, loc, diskID) })
	if p.early {
		wg.Go(func() { earlyErr = d.cfg.Cloud.AddDiskNote(ctx, loc, diskID, holdersNote, earlyNote(me)) })
	}
	wg.Wait()
	if errors.Is(diskErr, cloud.ErrNotFound) {
		return p, failf(ErrNotFound, "volume %s does not exist", id)
	}
	if diskErr != nil {
		return p, diskErr
	}
	if vmErr != nil {
		return p, vmErr
	}
	if !vmFound {
		return p, failf(ErrNotFound, "node %s is not a VM of this customer (no VM has reference_id %s)", node, node)
	}
	p.vm = vm
	if vm.Location != loc {
		return p, failf(ErrPrecondition, "volume %s is in location %s but node %s (VM %s) is in %s", id, loc, node, vm.Name, vm.Location)
	}
	if p.disk.VMID != 0 && p.disk.VMID != vm.ID {
		return p, d.attachedElsewhere(ctx, id, p.disk.VMID, node)
	}
	if noteErr != nil {
		return p, fmt.Errorf("volume %s: reading its holder notes: %w", p.id, noteErr)
	}
	if earlyErr != nil {
		return p, fmt.Errorf("recording node %s among the holders of volume %s: %w", p.node, p.id, earlyErr)
	}
	return p, p.readHolders()
}

// readHolders reads what the disk's notes say of its holders into p.
func (p *publication) readHolders() error {
	recorded, err := recordedHolders(p.notes)
	if err != nil {
		return failf(ErrPrecondition, "volume %s: %v; correct or remove that note (vco-csi/holders lists node UUIDs, comma-separated) and retry", p.id, err)
	}
	me, err := fence.CanonicalUUID(p.node)
	if err != nil {
		return failf(ErrPrecondition, "volume %s: node %s (VM %s) has no fence key to record, its id is not an SMBIOS UUID: %v", p.id, p.node, p.vm.Name, err)
	}
	p.me = me
	p.holders = withHolder(recorded, me)
	p.never = neverPublished(p.notes)
	if p.early {
		// The reads may have come before or after the note added beside
		// them, which does not count as a publish recorded earlier. (A
		// note of that form from another controller that also made the
		// volume names this node too: see madeEmpty.)
		p.never = neverPublished(slices.DeleteFunc(slices.Clone(p.notes), func(n cloud.Note) bool {
			return n.Title == holdersNote && n.Content == earlyNote(me)
		}))
	}
	// Whether a context was returned before matters to a stage only on a
	// disk that holds data no node of ours wrote (a copy, or a disk this
	// driver did not make): its stage may skip the reclaim wait and set
	// aside copied lease slots. A disk this driver made empty is blank
	// until a node that got a context writes it, and a blank disk is
	// claimed at once either way, so its first publish writes the holders
	// note alone, which makes every later publish say published
	// (docs/fencing.md).
	p.track = mayHoldData(p.disk)
	return nil
}

// recordHolders writes the node into the disk's notes before the attach.
func (d *Driver) recordHolders(ctx context.Context, p publication) error {
	if p.track && p.never && !hasNote(p.notes, firstPublishNote) {
		if err := d.cfg.Cloud.SetDiskNoteIn(ctx, p.loc, p.diskID, p.notes, firstPublishNote, p.me); err != nil {
			return fmt.Errorf("recording the first publish of volume %s (to node %s): %w", p.id, p.node, err)
		}
	}
	// Record the node before attaching: if the attach happens and this
	// call fails or the controller dies, every later grant still names it.
	// A retry reads the list it wrote and grants the same takeover. A note
	// added beside the reads already says all when they showed no other
	// holder.
	if !p.early || len(p.holders) > 1 {
		if err := d.writeHolders(ctx, p); err != nil {
			return fmt.Errorf("recording node %s among the holders of volume %s: %w", p.node, p.id, err)
		}
	}
	if hasNote(p.notes, holderNote) {
		// A disk an earlier version published: keep its note current
		// for a controller of that version run after this one.
		if err := d.cfg.Cloud.SetDiskNoteIn(ctx, p.loc, p.diskID, p.notes, holderNote, p.me); err != nil {
			return fmt.Errorf("recording node %s as holder of volume %s: %w", p.node, p.id, err)
		}
	}
	return nil
}

// attach attaches the disk to the VM unless it already is; a conflict is
// read as a lost race or an earlier try that worked.
func (d *Driver) attach(ctx context.Context, p publication) error {
	if p.disk.VMID != 0 {
		return nil
	}
	err := d.cfg.Cloud.AttachDisk(ctx, p.vm.Cloudspace, p.vm.ID, p.diskID)
	if errors.Is(err, cloud.ErrConflict) {
		// Lost a race, or the first try of a retried call worked.
		now, gerr := d.getDisk(ctx, p.id)
		if gerr != nil {
			return gerr
		}
		if now.VMID == 0 {
			return failf(ErrNoCapacity, "attaching volume %s to node %s (VM %s): %v", p.id, p.node, p.vm.Name, err)
		}
		if now.VMID != p.vm.ID {
			return d.attachedElsewhere(ctx, p.id, now.VMID, p.node)
		}
		return nil
	}
	if err != nil {
		if errors.Is(err, cloud.ErrNotFound) {
			d.vms.forget() // the VM may be gone; look it up afresh next time
		}
		return fmt.Errorf("attaching volume %s to node %s (VM %d): %w", p.id, p.node, p.vm.ID, err)
	}
	return nil
}

// publishContext is what the node plugin is told of the attached disk vd:
// where it is, a takeover grant, and whether it was never published.
func (d *Driver) publishContext(ctx context.Context, p publication, vd cloud.VMDisk) (map[string]string, error) {
	pc := map[string]string{
		PubDiskID:  strconv.FormatInt(p.diskID, 10),
		PubPCIBus:  strconv.Itoa(vd.PCIBus),
		PubPCISlot: strconv.Itoa(vd.PCISlot),
		PubSerial:  strconv.FormatInt(p.diskID, 10),
	}
	// A grant only when there is someone to take over from: the agent
	// refuses a grant that supersedes nothing.
	if grant := takeoverGrant(p.id, p.me, p.holders); grant != nil {
		pc[PubFenceGrant] = grant.Encode()
	}
	if !p.never {
		return pc, nil
	}
	// Recorded before the context leaves: once a node may have it, no
	// later publish may say the disk never had a holder. (On a disk made
	// empty the holders note, written before the attach, says so.)
	if p.track {
		if err := d.cfg.Cloud.SetDiskNoteIn(ctx, p.loc, p.diskID, p.notes, publishedNote, canonicalUUID(p.node)); err != nil {
			return nil, fmt.Errorf("recording that volume %s is published to node %s: %w", p.id, p.node, err)
		}
	}
	pc[PubNeverPublished] = "true"
	return pc, nil
}

// attachedElsewhere builds the refusal that names the VM holding the disk.
func (d *Driver) attachedElsewhere(ctx context.Context, id string, vmID int64, node string) error {
	other := fmt.Sprintf("VM %d", vmID)
	if r, ok, err := d.vms.byVMID(ctx, vmID); err == nil && ok {
		other = fmt.Sprintf("VM %s (id %d, node %s)", r.Name, vmID, canonicalUUID(r.ReferenceID))
	}
	return failf(ErrPrecondition, "volume %s is attached to %s; it must be unpublished there before node %s can have it", id, other, node)
}

// writeHolders writes p's list into every holders note the read showed,
// or adds one. A disk has more than one when a note added beside a
// publish's reads (madeEmpty) met a list: each then holds the whole list,
// so the bound ages a node out of all at once (a note left naming it would
// bring it back as the newest), and no note is removed. Two controllers
// writing the list at once can still lose each other's node, in every
// copy as in a single note: one controller is active at a time (the
// sidecars' leader election).
func (d *Driver) writeHolders(ctx context.Context, p publication) error {
	list := strings.Join(p.holders, ",")
	wrote := false
	for _, n := range p.notes {
		if n.Title != holdersNote {
			continue
		}
		if err := d.cfg.Cloud.SetDiskNoteIn(ctx, p.loc, p.diskID, []cloud.Note{n}, holdersNote, list); err != nil {
			return err
		}
		wrote = true
	}
	if wrote {
		return nil
	}
	return d.cfg.Cloud.SetDiskNoteIn(ctx, p.loc, p.diskID, p.notes, holdersNote, list)
}

// earlyNote is the content of the holders note added beside a publish's
// reads: the node in the urn:uuid: form, which every version that reads
// the list reads as the node (fence.CanonicalUUID) and which no list the
// controller writes uses, so a read tells that note apart.
func earlyNote(me string) string { return "urn:uuid:" + me }

// recordedHolders reads the nodes the disk's notes say may hold a key on
// it, oldest first: holdersNote's list, then a holderNote naming a node not
// in it (written by an earlier version, after the list). Every note of
// either title counts, should the cloud hold two.
func recordedHolders(notes []cloud.Note) ([]string, error) {
	var out []string
	add := func(title, entry string) error {
		u, err := fence.CanonicalUUID(entry)
		if err != nil {
			return fmt.Errorf("its %q note names a holder that is not a node id: %v", title, err)
		}
		if !slices.Contains(out, u) {
			out = append(out, u)
		}
		return nil
	}
	for _, n := range notes {
		if n.Title != holdersNote {
			continue
		}
		for _, entry := range strings.FieldsFunc(n.Content, func(r rune) bool { return r == ',' || unicode.IsSpace(r) }) {
			if err := add(holdersNote, entry); err != nil {
				return nil, err
			}
		}
	}
	for _, n := range notes {
		if n.Title == holderNote && strings.TrimSpace(n.Content) != "" {
			if err := add(holderNote, n.Content); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// withHolder returns holders with node moved to the end, the oldest
// dropped beyond maxHolders.
func withHolder(holders []string, node string) []string {
	out := make([]string, 0, len(holders)+1)
	for _, h := range holders {
		if h != node {
			out = append(out, h)
		}
	}
	out = append(out, node)
	if len(out) > maxHolders {
		out = out[len(out)-maxHolders:]
	}
	return out
}

// takeoverGrant is the grant for node: every recorded holder's key but its
// own; nil when there is none.
func takeoverGrant(id, node string, holders []string) *fence.Grant {
	g := &fence.Grant{Disk: id, Node: node}
	for _, h := range holders {
		if h == node {
			continue
		}
		k, err := fence.KeyFromUUID(h)
		if err != nil {
			continue // recordedHolders let only node ids in
		}
		g.Supersedes = append(g.Supersedes, k)
	}
	if len(g.Supersedes) == 0 {
		return nil
	}
	return g
}

// waitAttached polls the VM's disks until the disk shows with its PCI
// address, within AttachTimeout and the request's deadline.
func (d *Driver) waitAttached(ctx context.Context, vm vmRef, diskID int64) (cloud.VMDisk, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.AttachTimeout)
	defer cancel()
	for {
		disks, err := d.vmDisks.list(ctx, vm)
		if err != nil && ctx.Err() == nil {
			if errors.Is(err, cloud.ErrNotFound) {
				d.vms.forget() // the VM may be gone; look it up afresh next time
			}
			return cloud.VMDisk{}, err
		}
		for _, x := range disks {
			if x.ID == diskID {
				return x, nil
			}
		}
		t := time.NewTimer(d.cfg.AttachPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return cloud.VMDisk{}, fmt.Errorf("disk %d did not show up on VM %s within the attach wait: %w", diskID, vm.Name, ctx.Err())
		case <-t.C:
		}
	}
}

// ControllerUnpublishVolume detaches the disk from the node's VM. A disk or
// node that is gone, or a disk not attached there, is success.
func (d *Driver) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	if id == "" {
		return nil, failf(ErrInvalid, "ControllerUnpublishVolume needs a volume id")
	}
	loc, diskID, ok, err := d.volumeRef(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	release, err := d.locks.try("volume " + id)
	if err != nil {
		return nil, err
	}
	defer release()
	disk, err := d.cfg.Cloud.GetDisk(ctx, loc, diskID)
	if errors.Is(err, cloud.ErrNotFound) {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if disk.VMID == 0 {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	vm, found, err := d.vms.byVMID(ctx, disk.VMID)
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, failf(ErrNotFound, "volume %s is attached to VM %d, which is not listed in any cloudspace", id, disk.VMID)
	}
	if node != "" && !cloud.SameReference(vm.ReferenceID, node) {
		return &csi.ControllerUnpublishVolumeResponse{}, nil // attached elsewhere, so not to this node
	}
	err = d.cfg.Cloud.DetachDisk(ctx, vm.Cloudspace, vm.ID, diskID)
	if err != nil && !errors.Is(err, cloud.ErrNotFound) {
		return nil, fmt.Errorf("detaching volume %s from node %s (VM %d): %w", id, node, vm.ID, err)
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}
