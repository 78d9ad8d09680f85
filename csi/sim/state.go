// Package sim is a whitesky.cloud API simulator: an HTTP server for the
// paths and JSON shapes of the calls vco-csi makes, with persistent state,
// several locations and cloudspaces, VMs with a reference_id, and switchable
// faults. It exists so that the real API client is what every test and the
// lab drive; nothing in vco-csi knows it is talking to a simulator.
//
// What a disk is on this machine is up to a Backend: the host backend keeps
// a sparse file per disk and turns an attachment to the VM that stands for
// this machine into a loop device; a lab backend can serve disks as iSCSI
// LUNs hot-plugged into QEMU guests.
package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// State is everything the simulator knows; it is saved as JSON after every
// change so a restarted simulator carries on where it stopped.
type State struct {
	NextID      int64                 `json:"next_id"`
	Locations   []string              `json:"locations"`
	Cloudspaces []*CloudspaceState    `json:"cloudspaces"`
	VMs         []*VMState            `json:"vms"`
	Disks       map[int64]*DiskState  `json:"disks"`
	Snapshots   map[string]*SnapState `json:"snapshots"`
	NoteSeq     int64                 `json:"note_seq"`
	// CapacitySU is each location's vdisk capacity for the customer in
	// storage units (1 SU = 1 TiB of allocated vdisk capacity, the
	// platform's billing unit); a location without an entry has
	// DefaultCapacitySU.
	CapacitySU map[string]int64 `json:"capacity_su,omitempty"`
}

// DefaultCapacitySU is a location's capacity unless set: 1 PiB.
const DefaultCapacitySU = 1024

// capacitySU is the location's capacity in storage units.
func (st *State) capacitySU(loc string) int64 {
	if n, ok := st.CapacitySU[loc]; ok {
		return n
	}
	return DefaultCapacitySU
}

// freeGiB is what the location's disks leave of its capacity.
func (st *State) freeGiB(loc string) int64 {
	free := st.capacitySU(loc) << 10
	for _, d := range st.Disks {
		if d.Location == loc {
			free -= d.SizeGiB
		}
	}
	return max(free, 0)
}

// CloudspaceState is one cloudspace; it lives in one location.
type CloudspaceState struct {
	ID       string `json:"cloudspace_id"`
	Name     string `json:"name"`
	Location string `json:"location"`
}

// VMState is one VM. Local marks the VM that stands for the machine the
// simulator runs on: the host backend gives its attachments a loop device.
type VMState struct {
	ID          int64  `json:"vm_id"`
	Name        string `json:"name"`
	Cloudspace  string `json:"cloudspace_id"`
	ReferenceID string `json:"reference_id"`
	Local       bool   `json:"local,omitempty"`
}

// DiskState is one disk with its attachments (more than one only when the
// multi-attach fault is on) and notes.
type DiskState struct {
	ID          int64  `json:"disk_id"`
	Name        string `json:"disk_name"`
	Description string `json:"description"`
	Location    string `json:"location"`
	SizeGiB     int64  `json:"disk_size"`
	// Bytes is what the disk holds when that is not whole GiB (a disk
	// created in GB); SizeGiB is then the whole GiB it holds.
	Bytes       int64         `json:"size_bytes,omitempty"`
	Type        string        `json:"disk_type"`
	IOPS        int64         `json:"iops"`
	Attachments []*Attachment `json:"attachments,omitempty"`
	Notes       []*NoteState  `json:"notes,omitempty"`
}

// Attachment is a disk on a VM at a PCI address; Device is the host device
// the backend made for it, if any.
type Attachment struct {
	VMID    int64  `json:"vm_id"`
	PCIBus  int    `json:"pci_bus"`
	PCISlot int    `json:"pci_slot"`
	Device  string `json:"device,omitempty"`
}

// NoteState is a disk note.
type NoteState struct {
	ID      string  `json:"id"`
	Title   string  `json:"title"`
	Content string  `json:"content"`
	Created float64 `json:"creation_time"`
}

// bytes is what the disk holds.
func (d *DiskState) bytes() int64 {
	if d.Bytes > 0 {
		return d.Bytes
	}
	return d.SizeGiB << 30
}

// SnapState is a snapshot of a disk.
type SnapState struct {
	ID       string `json:"snapshot_id"`
	Name     string `json:"snapshot_name"`
	DiskID   int64  `json:"disk_id"`
	Location string `json:"location"`
	SizeGiB  int64  `json:"disk_size"`
	Bytes    int64  `json:"size_bytes,omitempty"` // as DiskState.Bytes
	Created  int64  `json:"creation_time"`
	// PendingReads is how many more reads answer it without a creation
	// time (Faults.SnapshotPendingReads).
	PendingReads int `json:"pending_reads,omitempty"`
}

// pendingRead counts one read of the snapshot and reports whether it is
// still answered without a creation time.
func (sn *SnapState) pendingRead() bool {
	if sn.PendingReads <= 0 {
		return false
	}
	sn.PendingReads--
	return true
}

// Seed describes a fresh simulator's world.
type Seed struct {
	Locations []string
	// VMsPerLocation plain VMs are made in each location's cloudspace,
	// named <location>-vm-<n>, with reference_ids derived from their ids.
	VMsPerLocation int
	// HostVM, if ReferenceID is set, is added as the local VM in the given
	// location (the first one if empty).
	HostVM struct {
		ReferenceID string
		Location    string
	}
}

// DefaultSeed is three locations with two VMs each.
func DefaultSeed() Seed {
	return Seed{Locations: []string{"ch-lug-1", "ch-gen-1", "nl-ams-1"}, VMsPerLocation: 2}
}

func newState(seed Seed) *State {
	st := &State{NextID: 100, Disks: map[int64]*DiskState{}, Snapshots: map[string]*SnapState{}}
	for _, loc := range seed.Locations {
		st.Locations = append(st.Locations, loc)
		cs := &CloudspaceState{ID: "cs-" + loc, Name: "kubernetes-" + loc, Location: loc}
		st.Cloudspaces = append(st.Cloudspaces, cs)
		for i := 1; i <= seed.VMsPerLocation; i++ {
			st.addVM(cs.ID, fmt.Sprintf("%s-vm-%d", loc, i), "", false)
		}
	}
	if seed.HostVM.ReferenceID != "" && len(st.Cloudspaces) > 0 {
		cs := st.Cloudspaces[0]
		for _, c := range st.Cloudspaces {
			if c.Location == seed.HostVM.Location {
				cs = c
			}
		}
		st.addVM(cs.ID, "this-host", seed.HostVM.ReferenceID, true)
	}
	return st
}

func (st *State) nextID() int64 { st.NextID++; return st.NextID }

func (st *State) addVM(cs, name, ref string, local bool) *VMState {
	id := st.nextID()
	if ref == "" {
		// A stable, valid-looking SMBIOS UUID per VM id.
		ref = fmt.Sprintf("5a1e0000-0000-4000-8000-%012d", id)
	}
	vm := &VMState{ID: id, Name: name, Cloudspace: cs, ReferenceID: strings.ToLower(ref), Local: local}
	st.VMs = append(st.VMs, vm)
	return vm
}

func (st *State) cloudspace(id string) *CloudspaceState {
	for _, c := range st.Cloudspaces {
		if c.ID == id {
			return c
		}
	}
	return nil
}

func (st *State) vm(cs string, id int64) *VMState {
	for _, v := range st.VMs {
		if v.ID == id && v.Cloudspace == cs {
			return v
		}
	}
	return nil
}

func (st *State) vmByID(id int64) *VMState {
	for _, v := range st.VMs {
		if v.ID == id {
			return v
		}
	}
	return nil
}

func (st *State) hasLocation(loc string) bool {
	for _, l := range st.Locations {
		if l == loc {
			return true
		}
	}
	return false
}

func (st *State) sortedDisks(loc string) []*DiskState {
	var out []*DiskState
	for _, d := range st.Disks {
		if d.Location == loc {
			out = append(out, d)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func loadState(path string) (*State, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("simulator state %s is not valid JSON: %w", path, err)
	}
	if st.Disks == nil {
		st.Disks = map[int64]*DiskState{}
	}
	if st.Snapshots == nil {
		st.Snapshots = map[string]*SnapState{}
	}
	return &st, nil
}

// save writes the state atomically: a crash never leaves half a file.
func (st *State) save(path string) error {
	if path == "" {
		return nil
	}
	b, err := st.marshal()
	if err != nil {
		return err
	}
	return writeState(path, b)
}

func (st *State) marshal() ([]byte, error) { return json.Marshal(st) }

// writeState replaces the state file at path with b atomically; an empty
// path keeps the state in memory only.
func writeState(path string, b []byte) error {
	if path == "" {
		return nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".state-*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}
