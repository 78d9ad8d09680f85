package cloud

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Disk is a customer disk as the disks endpoints return it. Sizes are GiB.
type Disk struct {
	ID           int64   `json:"disk_id"`
	Name         string  `json:"disk_name"`
	Description  string  `json:"description,omitempty"`
	SizeGiB      int64   `json:"disk_size"`
	Type         string  `json:"disk_type"`
	Status       string  `json:"status"`
	VMID         int64   `json:"vm_id,omitempty"`
	VMName       string  `json:"vm_name,omitempty"`
	CloudspaceID string  `json:"cloudspace_id,omitempty"`
	IOTune       *IOTune `json:"iotune,omitempty"`
	DeletionTime string  `json:"deletion_time,omitempty"`
}

// IOTune is a disk's I/O limit.
type IOTune struct {
	IOPS float64 `json:"iops"`
}

// Disk types the create call accepts.
const (
	DiskTypeData     = "DATA"
	DiskTypePhysical = "PHYSICAL"
	DiskTypeBoot     = "BOOT" // a VM's boot disk, in listings

)

// VMDisk is a disk as a VM's disk list shows it, with its PCI address.
type VMDisk struct {
	ID      int64  `json:"disk_id"`
	Name    string `json:"disk_name"`
	SizeGiB int64  `json:"disk_size"`
	Type    string `json:"disk_type"`
	Status  string `json:"status"`
	PCIBus  int    `json:"pci_bus"`
	PCISlot int    `json:"pci_slot"`
	Order   string `json:"order,omitempty"`
}

// VM is a virtual machine. ReferenceID is the SMBIOS system UUID the guest
// sees, which is how a node finds itself in the API. (The listing's
// cloudspace_id is left out: the spec types it as an integer where every
// other shape has a string, and the caller knows the cloudspace it listed.)
type VM struct {
	ID          int64   `json:"vm_id"`
	Name        string  `json:"name"`
	Status      string  `json:"status"`
	ReferenceID string  `json:"reference_id"`
	Disks       []int64 `json:"disks"`
}

// Cloudspace is a customer's virtual network, which lives in one location.
type Cloudspace struct {
	ID       string `json:"cloudspace_id"`
	Name     string `json:"name"`
	Location string `json:"location"`
	Status   string `json:"status"`
}

// Snapshot is a disk snapshot as the snapshot list returns it.
type Snapshot struct {
	ID           string `json:"snapshot_id"`
	Name         string `json:"snapshot_name"`
	CreationTime int64  `json:"creation_time"`
	IsAutomatic  bool   `json:"is_automatic"`
}

// Note is a titled text attached to a disk.
type Note struct {
	ID      string `json:"id"`
	Title   string `json:"title"`
	Content string `json:"content"`
}

// DiskSpec is what CreateDisk needs.
type DiskSpec struct {
	Name        string
	Description string
	SizeGiB     int64
	IOPS        int64 // 0: the API's default
	Type        string
}

func diskTarget(loc string, id int64) string {
	return fmt.Sprintf("disk %d in location %s", id, loc)
}

func diskPath(loc string, id int64) string {
	return "/locations/" + url.PathEscape(loc) + "/disks/" + strconv.FormatInt(id, 10)
}

func vmPath(cs string, vm int64) string {
	return "/cloudspaces/" + url.PathEscape(cs) + "/vms/" + strconv.FormatInt(vm, 10)
}

// ListLocations returns the names of the customer's locations.
func (c *Client) ListLocations(ctx context.Context) ([]string, error) {
	var out struct {
		Locations []struct {
			Location string `json:"location"`
		} `json:"locations"`
	}
	if err := c.do(ctx, call{op: "list locations", method: http.MethodGet, path: "/locations", out: &out}); err != nil {
		return nil, err
	}
	names := make([]string, 0, len(out.Locations))
	for _, l := range out.Locations {
		names = append(names, l.Location)
	}
	return names, nil
}

// Capacity is a location's capacity as the location capacity endpoint
// (getCustomerLocationCapacity) answers it, in the platform's units.
type Capacity struct {
	// SU is the vdisk capacity in storage units: 1 SU is 1 TiB of
	// allocated vdisk capacity (whitesky.cloud's billing unit).
	SU int64 `json:"su"`
}

// SUBytes is one storage unit.
const SUBytes = int64(1) << 40

// LocationCapacity asks what the customer can still allocate in a
// location.
func (c *Client) LocationCapacity(ctx context.Context, loc string) (*Capacity, error) {
	var out Capacity
	err := c.do(ctx, call{op: "get capacity", target: "of location " + loc, method: http.MethodGet,
		path: "/locations/" + url.PathEscape(loc) + "/capacity", out: &out, forbiddenHint: locationGrantHint(loc)})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateSizeGB is the disk_size the create call is given for a disk of
// at least sizeGiB GiB. The API documents the create call's disk_size in GB
// and the resize call's in GiB (docs/storage.md, "Sizes"). Asked in GB,
// rounded up, the disk holds the GiB asked whichever unit the platform
// applies: exactly that many GB (at least sizeGiB GiB), or that many GiB
// (up to 7.4% more, plus the rounding).
func CreateSizeGB(sizeGiB int64) int64 {
	const gb, gib = 1_000_000_000, 1 << 30
	return (sizeGiB*gib + gb - 1) / gb
}

// CreateDisk creates a data disk and returns its id. The create call is not
// idempotent, so before a retry it looks for a disk of the same name that
// the first attempt may have made after all.
func (c *Client) CreateDisk(ctx context.Context, loc string, spec DiskSpec) (int64, error) {
	q := url.Values{
		"disk_name":   {spec.Name},
		"description": {spec.Description},
		"disk_size":   {strconv.FormatInt(CreateSizeGB(spec.SizeGiB), 10)},
	}
	if spec.IOPS > 0 {
		q.Set("iops", strconv.FormatInt(spec.IOPS, 10))
	}
	if spec.Type != "" {
		q.Set("disk_type", spec.Type)
	}
	var out struct {
		ID int64 `json:"disk_id"`
	}
	err := c.do(ctx, call{
		op: "create disk", target: fmt.Sprintf("%q in location %s", spec.Name, loc),
		method: http.MethodPost, path: "/locations/" + url.PathEscape(loc) + "/disks", query: q, out: &out,
		forbiddenHint: locationGrantHint(loc),
		beforeRetry: func(ctx context.Context) bool {
			d, err := c.FindDiskByName(ctx, loc, spec.Name)
			if err == nil && d != nil {
				out.ID = d.ID
				return true
			}
			return false
		},
	})
	if err == nil && out.ID <= 0 {
		// A 200 without a usable id (an empty answer from a proxy, say):
		// the disk may exist; find it by name rather than hand back id 0.
		if d, ferr := c.FindDiskByName(ctx, loc, spec.Name); ferr == nil && d != nil {
			return d.ID, nil
		}
		return 0, &APIError{Op: "create disk", Target: fmt.Sprintf("%q in location %s", spec.Name, loc),
			Message: "the answer names no disk id, and no disk of that name exists", Kind: ErrInvalid}
	}
	return out.ID, err
}

// FindDiskByName returns the live disk with this name, or nil.
func (c *Client) FindDiskByName(ctx context.Context, loc, name string) (*Disk, error) {
	disks, err := c.ListDisks(ctx, loc)
	if err != nil {
		return nil, err
	}
	for i := range disks {
		if disks[i].Name == name {
			return &disks[i], nil
		}
	}
	return nil, nil
}

// GetDisk returns one disk.
func (c *Client) GetDisk(ctx context.Context, loc string, id int64) (*Disk, error) {
	var d Disk
	err := c.do(ctx, call{op: "get", target: diskTarget(loc, id), method: http.MethodGet, path: diskPath(loc, id), out: &d})
	if err != nil {
		return nil, err
	}
	return &d, nil
}

// ListDisks returns the location's live disks.
func (c *Client) ListDisks(ctx context.Context, loc string) ([]Disk, error) {
	var out struct {
		Result []Disk `json:"result"`
	}
	err := c.do(ctx, call{op: "list disks", target: "in location " + loc, method: http.MethodGet,
		path: "/locations/" + url.PathEscape(loc) + "/disks", out: &out})
	return out.Result, err
}

// DeleteDisk deletes a disk permanently. It refuses (ErrConflict) to delete
// an attached disk rather than detaching it from under a workload.
func (c *Client) DeleteDisk(ctx context.Context, loc string, id int64) error {
	q := url.Values{"detach": {"false"}, "permanently": {"true"}}
	return c.do(ctx, call{op: "delete", target: diskTarget(loc, id), method: http.MethodDelete, path: diskPath(loc, id), query: q})
}

// ResizeDisk grows a disk to sizeGiB.
func (c *Client) ResizeDisk(ctx context.Context, loc string, id, sizeGiB int64) error {
	q := url.Values{"disk_size": {strconv.FormatInt(sizeGiB, 10)}}
	return c.do(ctx, call{op: "resize", target: diskTarget(loc, id), method: http.MethodPut, path: diskPath(loc, id) + "/size", query: q})
}

// CreateSnapshot takes a snapshot and returns its id. Like CreateDisk, it
// looks for a snapshot of the same name before retrying.
func (c *Client) CreateSnapshot(ctx context.Context, loc string, diskID int64, name string) (string, error) {
	var id string
	err := c.do(ctx, call{
		op: "snapshot", target: diskTarget(loc, diskID), method: http.MethodPost,
		path: diskPath(loc, diskID) + "/snapshots", query: url.Values{"snapshot_name": {name}}, out: &id,
		beforeRetry: func(ctx context.Context) bool {
			snaps, err := c.ListSnapshots(ctx, loc, diskID)
			if err != nil {
				return false
			}
			for _, s := range snaps {
				if s.Name == name {
					id = s.ID
					return true
				}
			}
			return false
		},
	})
	if err == nil && id == "" {
		return "", &APIError{Op: "snapshot", Target: diskTarget(loc, diskID), Message: "the answer names no snapshot id", Kind: ErrInvalid}
	}
	return id, err
}

// ListSnapshots returns a disk's snapshots, automatic ones excluded.
func (c *Client) ListSnapshots(ctx context.Context, loc string, diskID int64) ([]Snapshot, error) {
	var out struct {
		Result []Snapshot `json:"result"`
	}
	err := c.do(ctx, call{op: "list snapshots", target: "of " + diskTarget(loc, diskID), method: http.MethodGet,
		path: diskPath(loc, diskID) + "/snapshots", out: &out})
	return out.Result, err
}

// SnapshotDetail is one snapshot as the snapshot endpoint
// (getDiskSnapshot) answers it.
type SnapshotDetail struct {
	ID   string `json:"snapshot_id"`
	Name string `json:"snapshot_name"`
	// CreationTime is the API's creation_time, a string in this
	// endpoint's schema (an integer in the list's): empty while the
	// platform reports none.
	CreationTime flexString `json:"creation_time"`
	Disks        []struct {
		ID int64 `json:"disk_id"`
	} `json:"disks"`
}

// Created reads the creation time: seconds since the epoch, or an
// RFC 3339 time. ok is false when the answer carries none or another form.
func (s *SnapshotDetail) Created() (t time.Time, ok bool) {
	v := strings.TrimSpace(string(s.CreationTime))
	if n, err := strconv.ParseFloat(v, 64); err == nil && n > 0 {
		return time.Unix(int64(n), 0), true
	}
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return t, true
	}
	return time.Time{}, false
}

// HasDisk reports whether the snapshot names the disk among its disks.
func (s *SnapshotDetail) HasDisk(id int64) bool {
	for _, d := range s.Disks {
		if d.ID == id {
			return true
		}
	}
	return false
}

// flexString is a JSON string that also reads a number as its text.
type flexString string

func (f *flexString) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*f = ""
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*f = flexString(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return err
	}
	*f = flexString(n.String())
	return nil
}

// GetSnapshot asks the snapshot endpoint about one snapshot of a disk.
func (c *Client) GetSnapshot(ctx context.Context, loc string, diskID int64, snapID string) (*SnapshotDetail, error) {
	var out SnapshotDetail
	err := c.do(ctx, call{op: "get snapshot " + snapID, target: "of " + diskTarget(loc, diskID), method: http.MethodGet,
		path: diskPath(loc, diskID) + "/snapshots/" + url.PathEscape(snapID), out: &out})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// DeleteSnapshot deletes one snapshot.
func (c *Client) DeleteSnapshot(ctx context.Context, loc string, diskID int64, snapID string) error {
	return c.do(ctx, call{op: "delete snapshot " + snapID, target: "of " + diskTarget(loc, diskID), method: http.MethodDelete,
		path: diskPath(loc, diskID) + "/snapshots/" + url.PathEscape(snapID)})
}

// CloneSnapshot makes a new disk from a snapshot and returns its id.
func (c *Client) CloneSnapshot(ctx context.Context, loc string, diskID int64, snapID, name, description string) (int64, error) {
	var out struct {
		Result []struct {
			Original int64 `json:"original_disk_id"`
			New      int64 `json:"new_disk_id"`
		} `json:"result"`
	}
	var found int64
	err := c.do(ctx, call{
		op: "clone snapshot " + snapID, target: "of " + diskTarget(loc, diskID), method: http.MethodPost,
		path:  diskPath(loc, diskID) + "/snapshots/" + url.PathEscape(snapID) + "/clone",
		query: url.Values{"name": {name}, "description": {description}}, out: &out,
		forbiddenHint: locationGrantHint(loc),
		beforeRetry: func(ctx context.Context) bool {
			d, err := c.FindDiskByName(ctx, loc, name)
			if err == nil && d != nil {
				found = d.ID
				return true
			}
			return false
		},
	})
	if err != nil {
		return 0, err
	}
	if found != 0 {
		return found, nil
	}
	for _, r := range out.Result {
		if r.New > 0 && (r.Original == diskID || len(out.Result) == 1) {
			return r.New, nil
		}
	}
	return 0, &APIError{Op: "clone snapshot " + snapID, Target: "of " + diskTarget(loc, diskID),
		Message: "the answer names no new disk", Kind: ErrInvalid}
}

// ListDiskNotes returns a disk's notes.
func (c *Client) ListDiskNotes(ctx context.Context, loc string, diskID int64) ([]Note, error) {
	var out struct {
		Result []Note `json:"result"`
	}
	err := c.do(ctx, call{op: "list notes", target: "of " + diskTarget(loc, diskID), method: http.MethodGet,
		path: diskPath(loc, diskID) + "/notes", out: &out})
	return out.Result, err
}

// SetDiskNote creates the note with this title, or updates it if it exists.
func (c *Client) SetDiskNote(ctx context.Context, loc string, diskID int64, title, content string) error {
	notes, err := c.ListDiskNotes(ctx, loc, diskID)
	if err != nil {
		return err
	}
	return c.SetDiskNoteIn(ctx, loc, diskID, notes, title, content)
}

// SetDiskNoteIn is SetDiskNote for a caller that has just listed the notes.
func (c *Client) SetDiskNoteIn(ctx context.Context, loc string, diskID int64, notes []Note, title, content string) error {
	body := map[string]string{"title": title, "content": content}
	for _, n := range notes {
		if n.Title == title {
			if n.Content == content {
				return nil
			}
			return c.do(ctx, call{op: "update note", target: "of " + diskTarget(loc, diskID), method: http.MethodPut,
				path: diskPath(loc, diskID) + "/notes/" + url.PathEscape(n.ID), body: body})
		}
	}
	return c.AddDiskNote(ctx, loc, diskID, title, content)
}

// AddDiskNote adds a note to the disk without looking at the notes it
// has: a note of the same title already there stays, beside the new one.
func (c *Client) AddDiskNote(ctx context.Context, loc string, diskID int64, title, content string) error {
	return c.do(ctx, call{op: "add note", target: "to " + diskTarget(loc, diskID), method: http.MethodPost,
		path: diskPath(loc, diskID) + "/notes", body: map[string]string{"title": title, "content": content}})
}

// ListCloudspaces returns the customer's cloudspaces.
func (c *Client) ListCloudspaces(ctx context.Context) ([]Cloudspace, error) {
	var out struct {
		Result []Cloudspace `json:"result"`
	}
	err := c.do(ctx, call{op: "list cloudspaces", method: http.MethodGet, path: "/cloudspaces", out: &out})
	return out.Result, err
}

// ListVMs returns a cloudspace's VMs.
func (c *Client) ListVMs(ctx context.Context, cloudspace string) ([]VM, error) {
	var out struct {
		Result []VM `json:"result"`
	}
	err := c.do(ctx, call{op: "list VMs", target: "in cloudspace " + cloudspace, method: http.MethodGet,
		path: "/cloudspaces/" + url.PathEscape(cloudspace) + "/vms", out: &out})
	return out.Result, err
}

// ListVMDisks returns the disks attached to a VM with their PCI addresses.
func (c *Client) ListVMDisks(ctx context.Context, cloudspace string, vm int64) ([]VMDisk, error) {
	var out struct {
		Result []VMDisk `json:"result"`
	}
	err := c.do(ctx, call{op: "list disks", target: fmt.Sprintf("of VM %d", vm), method: http.MethodGet,
		path: vmPath(cloudspace, vm) + "/disks", out: &out})
	return out.Result, err
}

// AttachDisk attaches a disk to a VM. Attaching is retried: attaching a disk
// that the first attempt already attached answers a conflict, which the
// caller sees and resolves by listing the VM's disks.
func (c *Client) AttachDisk(ctx context.Context, cloudspace string, vm, diskID int64) error {
	return c.do(ctx, call{op: "attach", target: fmt.Sprintf("disk %d to VM %d", diskID, vm), method: http.MethodPost,
		path: vmPath(cloudspace, vm) + "/disks", query: url.Values{"disk_id": {strconv.FormatInt(diskID, 10)}}})
}

// DetachDisk detaches a disk from a VM.
func (c *Client) DetachDisk(ctx context.Context, cloudspace string, vm, diskID int64) error {
	return c.do(ctx, call{op: "detach", target: fmt.Sprintf("disk %d from VM %d", diskID, vm), method: http.MethodDelete,
		path: vmPath(cloudspace, vm) + "/disks/" + strconv.FormatInt(diskID, 10)})
}

// SameReference compares two SMBIOS UUIDs the way the platform and the
// kernel may print them (case differs).
func SameReference(a, b string) bool {
	return strings.EqualFold(strings.TrimSpace(a), strings.TrimSpace(b))
}

// locationGrantHint is what a 403 on disk creation means in practice: the
// credential's role is not granted on that location.
func locationGrantHint(loc string) string {
	return "the credential needs a location-scoped grant on location " + loc + " that allows creating disks; ask the customer admin to add it"
}
