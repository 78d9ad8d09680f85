package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// MinIOPS is the least iops the disk create call takes (the API's
// documented minimum).
const MinIOPS = 100

// Faults are the misbehaviours the simulator can be told to show, by flag
// at start or later through PUT /admin/faults.
type Faults struct {
	// Latency is added to every API request.
	Latency Duration `json:"latency"`
	// ErrorRate is the fraction (0..1) of API requests answered 503.
	ErrorRate float64 `json:"error_rate"`
	// ForbidCreate answers 403 to disk creation and cloning, as the API does
	// for a credential without a location-scoped grant.
	ForbidCreate bool `json:"forbid_create"`
	// AllowMultiAttach lets a disk be attached to a second VM. The real
	// platform never does this; it exists to prove the node side refuses.
	AllowMultiAttach bool `json:"allow_multi_attach"`
	// SnapshotPendingReads makes a snapshot taken from now on answer its
	// first reads (the list's entry and the snapshot endpoint, this many
	// in all) without a creation time. The API has no snapshot status;
	// this is how the simulator models a snapshot the platform has not
	// finished, which the driver reports as not ready.
	SnapshotPendingReads int `json:"snapshot_pending_reads,omitempty"`
}

// Duration is a time.Duration that reads and writes as "250ms" in JSON.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var n int64
		if err2 := json.Unmarshal(b, &n); err2 != nil {
			return err
		}
		*d = Duration(n)
		return nil
	}
	v, err := time.ParseDuration(s)
	*d = Duration(v)
	return err
}

// Options configure a Server.
type Options struct {
	// Customer is the only customer id the simulator answers for.
	Customer string
	// Token, if set, is the only Bearer credential accepted; otherwise any
	// non-empty one is.
	Token string
	// StateFile keeps the state across restarts; empty keeps it in memory.
	StateFile string
	// Seed makes the world when StateFile does not exist yet.
	Seed    Seed
	Backend Backend
	Faults  Faults
	// MaxDisksPerVM is how many data disks a VM takes (PCI hot-plug
	// slots). Default 24.
	MaxDisksPerVM int
	Logger        *slog.Logger
}

// Server is the simulator. It is an http.Handler: API under /api/1, admin
// under /admin.
type Server struct {
	opts Options
	mux  *http.ServeMux

	mu     sync.Mutex
	st     *State
	faults Faults
	calls  map[string]int // API requests by operation, for tests
	// changes counts the API's changes to st (under mu); saved is the
	// count the state file holds (written under saveMu, which one saver
	// holds; read without it by requests whose state is saved already).
	changes uint64
	saveMu  sync.Mutex
	saved   atomic.Uint64
}

// New loads or seeds the state and builds the handler.
func New(opts Options) (*Server, error) {
	if opts.Customer == "" {
		return nil, errors.New("sim: a customer id is required")
	}
	if opts.Backend == nil {
		opts.Backend = BookkeepingBackend{}
	}
	if opts.MaxDisksPerVM <= 0 {
		opts.MaxDisksPerVM = 24
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	st, err := loadState(opts.StateFile)
	if err != nil {
		return nil, err
	}
	if st == nil {
		st = newState(opts.Seed)
		if err := st.save(opts.StateFile); err != nil {
			return nil, fmt.Errorf("sim: writing state: %w", err)
		}
	}
	s := &Server{opts: opts, st: st, faults: opts.Faults, mux: http.NewServeMux(), calls: map[string]int{}}
	s.routes()
	return s, nil
}

// SetFaults replaces the active faults.
func (s *Server) SetFaults(f Faults) { s.mu.Lock(); s.faults = f; s.mu.Unlock() }

// Faults returns the active faults.
func (s *Server) Faults() Faults { s.mu.Lock(); defer s.mu.Unlock(); return s.faults }

// Calls returns how many API requests each operation has had.
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

// AddVM adds a VM to a cloudspace and returns its id.
func (s *Server) AddVM(cloudspace, name, referenceID string, local bool) (int64, error) {
	s.mu.Lock()
	if s.st.cloudspace(cloudspace) == nil {
		s.mu.Unlock()
		return 0, fmt.Errorf("no cloudspace %q", cloudspace)
	}
	vm := s.st.addVM(cloudspace, name, referenceID, local)
	s.changes++
	seen := s.changes
	s.mu.Unlock()
	return vm.ID, s.persist(seen)
}

// Snapshot returns a deep copy of the state.
func (s *Server) Snapshot() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, _ := json.Marshal(s.st)
	var st State
	_ = json.Unmarshal(b, &st)
	return st
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

const api = "/api/1/customers/{customer}"

type handler func(w http.ResponseWriter, r *http.Request) (any, *httpError)

type httpError struct {
	code int
	msg  string
}

func errf(code int, format string, a ...any) *httpError {
	return &httpError{code: code, msg: fmt.Sprintf(format, a...)}
}

func (s *Server) routes() {
	add := func(method, path, op string, h handler) {
		s.mux.HandleFunc(method+" "+api+path, s.wrap(op, h))
	}
	add("GET", "/locations", "listLocations", s.listLocations)
	add("GET", "/locations/{loc}/capacity", "getCustomerLocationCapacity", s.locationCapacity)
	add("GET", "/locations/{loc}/disks", "listDisks", s.listDisks)
	add("POST", "/locations/{loc}/disks", "createDisk", s.createDisk)
	add("GET", "/locations/{loc}/disks/{disk}", "getDisk", s.getDisk)
	add("DELETE", "/locations/{loc}/disks/{disk}", "deleteDisk", s.deleteDisk)
	add("PUT", "/locations/{loc}/disks/{disk}/size", "resizeDisk", s.resizeDisk)
	add("GET", "/locations/{loc}/disks/{disk}/snapshots", "listDiskSnapshots", s.listSnapshots)
	add("POST", "/locations/{loc}/disks/{disk}/snapshots", "takeDiskSnapshot", s.takeSnapshot)
	add("GET", "/locations/{loc}/disks/{disk}/snapshots/{snap}", "getDiskSnapshot", s.getSnapshot)
	add("DELETE", "/locations/{loc}/disks/{disk}/snapshots/{snap}", "deleteDiskSnapshot", s.deleteSnapshot)
	add("POST", "/locations/{loc}/disks/{disk}/snapshots/{snap}/clone", "cloneDiskSnapshot", s.cloneSnapshot)
	add("GET", "/locations/{loc}/disks/{disk}/notes", "getDiskNotes", s.listNotes)
	add("POST", "/locations/{loc}/disks/{disk}/notes", "createDiskNote", s.addNote)
	add("PUT", "/locations/{loc}/disks/{disk}/notes/{note}", "updateDiskNote", s.updateNote)
	add("GET", "/cloudspaces", "listCloudspaces", s.listCloudspaces)
	add("GET", "/cloudspaces/{cs}/vms", "listCloudspaceVirtualMachines", s.listVMs)
	add("GET", "/cloudspaces/{cs}/vms/{vm}/disks", "listDisksVirtualMachine", s.listVMDisks)
	add("POST", "/cloudspaces/{cs}/vms/{vm}/disks", "attachDiskVirtualMachine", s.attach)
	add("DELETE", "/cloudspaces/{cs}/vms/{vm}/disks/{disk}", "detachDiskVirtualMachine", s.detach)

	s.mux.HandleFunc("GET /admin/faults", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, s.Faults())
	})
	s.mux.HandleFunc("PUT /admin/faults", func(w http.ResponseWriter, r *http.Request) {
		var f Faults
		if err := json.NewDecoder(r.Body).Decode(&f); err != nil {
			writeJSON(w, 400, map[string]string{"message": "faults: " + err.Error()})
			return
		}
		s.SetFaults(f)
		writeJSON(w, 200, f)
	})
	s.mux.HandleFunc("POST /admin/vms", func(w http.ResponseWriter, r *http.Request) {
		var v struct {
			Cloudspace  string `json:"cloudspace_id"`
			Name        string `json:"name"`
			ReferenceID string `json:"reference_id"`
			Local       bool   `json:"local"`
		}
		if err := json.NewDecoder(r.Body).Decode(&v); err != nil {
			writeJSON(w, 400, map[string]string{"message": "vm: " + err.Error()})
			return
		}
		id, err := s.AddVM(v.Cloudspace, v.Name, v.ReferenceID, v.Local)
		if err != nil {
			writeJSON(w, 400, map[string]string{"message": err.Error()})
			return
		}
		writeJSON(w, 200, map[string]int64{"vm_id": id})
	})
	s.mux.HandleFunc("PUT /admin/capacity", func(w http.ResponseWriter, r *http.Request) {
		var c map[string]int64 // location -> storage units
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil {
			writeJSON(w, 400, map[string]string{"message": "capacity: " + err.Error()})
			return
		}
		for loc, su := range c {
			s.SetCapacity(loc, su)
		}
		writeJSON(w, 200, c)
	})
	s.mux.HandleFunc("GET /admin/state", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, s.Snapshot())
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// wrap applies authentication, faults, the state lock and persistence.
func (s *Server) wrap(op string, h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f := s.Faults()
		if f.Latency > 0 {
			select {
			case <-time.After(time.Duration(f.Latency)):
			case <-r.Context().Done():
				return
			}
		}
		auth := r.Header.Get("Authorization")
		tok, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok || tok == "" || (s.opts.Token != "" && tok != s.opts.Token) {
			writeJSON(w, 401, map[string]string{"message": "missing or invalid bearer token"})
			return
		}
		if r.PathValue("customer") != s.opts.Customer {
			writeJSON(w, 404, map[string]string{"message": "customer " + r.PathValue("customer") + " not found"})
			return
		}
		if f.ErrorRate > 0 && rand.Float64() < f.ErrorRate {
			writeJSON(w, 503, map[string]string{"message": "simulated outage"})
			return
		}
		s.mu.Lock()
		s.calls[op]++
		out, herr := h(w, r)
		if herr == nil && r.Method != http.MethodGet {
			s.changes++
		}
		seen := s.changes
		s.mu.Unlock()
		serr := s.persist(seen)
		if herr == nil && serr != nil && r.Method != http.MethodGet {
			// A read answers what it read; the change whose save failed
			// answered 500 itself, and the next change saves it again.
			herr = errf(500, "saving state: %v", serr)
		}
		if herr != nil {
			s.opts.Logger.Info("api error", "op", op, "path", r.URL.Path, "code", herr.code, "message", herr.msg)
			writeJSON(w, herr.code, map[string]string{"message": herr.msg})
			return
		}
		writeJSON(w, 200, out)
	}
}

// persist returns once the state file holds the first seen changes: an
// answer leaves only when what it changed or saw is saved. Requests that
// wait together share one write (a group commit): the platform takes
// concurrent changes side by side, and a file written once per change,
// one change at a time, made the simulator's own bookkeeping the cost of
// a batch of requests instead of the API's latency.
func (s *Server) persist(seen uint64) error {
	if s.opts.StateFile == "" {
		return nil
	}
	if s.saved.Load() >= seen {
		// What it changed or saw is in the file: it need not wait for
		// the write under way, which saves later changes.
		return nil
	}
	s.saveMu.Lock()
	defer s.saveMu.Unlock()
	if s.saved.Load() >= seen {
		return nil
	}
	s.mu.Lock()
	b, err := s.st.marshal()
	upto := s.changes
	s.mu.Unlock()
	if err != nil {
		return err
	}
	if err := writeState(s.opts.StateFile, b); err != nil {
		return err
	}
	s.saved.Store(upto)
	return nil
}

var success = map[string]bool{"success": true}

func intParam(r *http.Request, name string) (int64, *httpError) {
	v := r.PathValue(name)
	if v == "" {
		v = r.URL.Query().Get(name)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, errf(400, "%s %q is not an integer", name, v)
	}
	return n, nil
}

func (s *Server) location(r *http.Request) (string, *httpError) {
	loc := r.PathValue("loc")
	if !s.st.hasLocation(loc) {
		return "", errf(404, "location %s not found", loc)
	}
	return loc, nil
}

func (s *Server) disk(r *http.Request) (*DiskState, *httpError) {
	loc, herr := s.location(r)
	if herr != nil {
		return nil, herr
	}
	id, herr := intParam(r, "disk")
	if herr != nil {
		return nil, herr
	}
	d := s.st.Disks[id]
	if d == nil || d.Location != loc {
		return nil, errf(404, "disk %d not found in location %s", id, loc)
	}
	return d, nil
}

func (s *Server) listLocations(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	type loc struct {
		Location  string             `json:"location"`
		Resources map[string]float64 `json:"resources"`
	}
	out := struct {
		Currency  string `json:"currency"`
		Locations []loc  `json:"locations"`
	}{Currency: "EUR"}
	for _, l := range s.st.Locations {
		out.Locations = append(out.Locations, loc{Location: l, Resources: map[string]float64{"su": 0.1}})
	}
	return out, nil
}

// locationCapacity answers the location capacity endpoint in the
// CapacityModel's shape. su is the storage units the customer can still
// allocate there: the capacity less every disk of the location, rounded
// down; the other units are not modelled and answer 0.
func (s *Server) locationCapacity(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	loc := r.PathValue("loc")
	if !slices.Contains(s.st.Locations, loc) {
		return nil, errf(403, "Forbidden: Customer has no access to location %s", loc)
	}
	return map[string]int64{"su": s.st.freeGiB(loc) >> 10, "cu": 0, "mu": 0, "vcu": 0, "piu": 0, "ou": 0}, nil
}

// SetCapacity sets a location's vdisk capacity in storage units (1 TiB).
func (s *Server) SetCapacity(loc string, su int64) {
	s.mu.Lock()
	if s.st.CapacitySU == nil {
		s.st.CapacitySU = map[string]int64{}
	}
	s.st.CapacitySU[loc] = su
	s.changes++
	seen := s.changes
	s.mu.Unlock()
	_ = s.persist(seen) // kept for a restart; the next change saves again
}

// diskJSON renders a disk in the shape of the disk endpoints.
func (s *Server) diskJSON(d *DiskState) map[string]any {
	m := map[string]any{
		"disk_id": d.ID, "disk_name": d.Name, "description": d.Description, "disk_size": d.SizeGiB,
		"disk_type": d.Type, "status": "ASSIGNED", "iotune": map[string]any{"iops": float64(d.IOPS)},
		"exposed": false, "order": "", "port": 0,
	}
	if len(d.Attachments) == 0 {
		m["status"] = "CREATED"
	} else if vm := s.st.vmByID(d.Attachments[0].VMID); vm != nil {
		m["vm_id"], m["vm_name"], m["cloudspace_id"] = vm.ID, vm.Name, vm.Cloudspace
	}
	return m
}

func (s *Server) listDisks(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	loc, herr := s.location(r)
	if herr != nil {
		return nil, herr
	}
	res := []map[string]any{}
	for _, d := range s.st.sortedDisks(loc) {
		res = append(res, s.diskJSON(d))
	}
	return map[string]any{"result": res}, nil
}

func (s *Server) createDisk(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	loc, herr := s.location(r)
	if herr != nil {
		return nil, herr
	}
	if s.faults.ForbidCreate {
		return nil, errf(403, "access denied: no role on location %s permits disk creation", loc)
	}
	q := r.URL.Query()
	name := q.Get("disk_name")
	if name == "" || !q.Has("description") {
		return nil, errf(400, "disk_name and description are required")
	}
	size, herr := intParam(r, "disk_size")
	if herr != nil {
		return nil, herr
	}
	if size < 1 {
		return nil, errf(400, "disk_size must be at least 1 GB")
	}
	iops := int64(2000)
	if v := q.Get("iops"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < MinIOPS {
			return nil, errf(400, "iops %q is not an integer of at least %d", v, MinIOPS)
		}
		iops = n
	}
	if size*1_000_000_000>>30 > s.st.freeGiB(loc) {
		return nil, errf(400, "not enough vdisk capacity in location %s for %d GB", loc, size)
	}
	typ := q.Get("disk_type")
	if typ == "" {
		typ = "DATA"
	}
	if typ != "DATA" && typ != "PHYSICAL" {
		return nil, errf(400, "disk_type %q is not DATA or PHYSICAL", typ)
	}
	// disk_size is in GB here, as the create call documents (resize takes
	// GiB). The disk holds size GB; the disk endpoints report it in whole
	// GiB, rounded down; a backend that cannot make such a disk gets it
	// rounded up to whole GiB.
	bytes := size * 1_000_000_000
	id := s.st.nextID()
	var err error
	if b, ok := s.opts.Backend.(ByteSizer); ok {
		err = b.CreateDiskBytes(id, bytes)
	} else {
		err = s.opts.Backend.CreateDisk(id, (bytes+1<<30-1)>>30)
	}
	if err != nil {
		return nil, errf(500, "creating disk %d: %v", id, err)
	}
	s.st.Disks[id] = &DiskState{ID: id, Name: name, Description: q.Get("description"), Location: loc,
		SizeGiB: bytes >> 30, Bytes: bytes, Type: typ, IOPS: iops}
	return map[string]int64{"disk_id": id}, nil
}

func (s *Server) getDisk(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	return s.diskJSON(d), nil
}

func (s *Server) deleteDisk(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	detach := r.URL.Query().Get("detach") != "false"
	if len(d.Attachments) > 0 {
		if !detach {
			return nil, errf(409, "disk %d is attached to VM %d", d.ID, d.Attachments[0].VMID)
		}
		for _, a := range d.Attachments {
			if err := s.opts.Backend.Detach(s.st.vmByID(a.VMID), d.ID, a.Device); err != nil {
				return nil, errf(500, "%v", err)
			}
		}
		d.Attachments = nil
	}
	for _, sn := range s.st.Snapshots {
		if sn.DiskID == d.ID {
			return nil, errf(409, "disk %d has snapshot %s; delete its snapshots first", d.ID, sn.ID)
		}
	}
	if err := s.opts.Backend.DeleteDisk(d.ID); err != nil {
		return nil, errf(500, "%v", err)
	}
	delete(s.st.Disks, d.ID)
	return success, nil
}

func (s *Server) resizeDisk(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	size, herr := intParam(r, "disk_size")
	if herr != nil {
		return nil, herr
	}
	if size<<30 < d.bytes() {
		return nil, errf(400, "disk %d cannot shrink from %d bytes to %d GiB", d.ID, d.bytes(), size)
	}
	if size-d.SizeGiB > s.st.freeGiB(d.Location) {
		return nil, errf(400, "not enough vdisk capacity in location %s to grow disk %d to %d GiB", d.Location, d.ID, size)
	}
	if err := s.opts.Backend.ResizeDisk(d.ID, size); err != nil {
		return nil, errf(500, "%v", err)
	}
	d.SizeGiB, d.Bytes = size, 0
	return success, nil
}

func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	res := []map[string]any{}
	for _, sn := range s.sortedSnaps(d.ID) {
		created := sn.Created
		if sn.pendingRead() {
			created = 0
		}
		res = append(res, map[string]any{"snapshot_id": sn.ID, "snapshot_name": sn.Name,
			"creation_time": created, "is_automatic": false})
	}
	return map[string]any{"result": res}, nil
}

func (s *Server) sortedSnaps(diskID int64) []*SnapState {
	var out []*SnapState
	for _, sn := range s.st.Snapshots {
		if sn.DiskID == diskID {
			out = append(out, sn)
		}
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j].ID < out[j-1].ID; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

func (s *Server) takeSnapshot(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	name := r.URL.Query().Get("snapshot_name")
	if name == "" {
		return nil, errf(400, "snapshot_name is required")
	}
	id := fmt.Sprintf("snap-%d", s.st.nextID())
	if err := s.opts.Backend.Snapshot(d.ID, id); err != nil {
		return nil, errf(500, "%v", err)
	}
	s.st.Snapshots[id] = &SnapState{ID: id, Name: name, DiskID: d.ID, Location: d.Location,
		SizeGiB: d.SizeGiB, Bytes: d.Bytes, Created: time.Now().Unix(), PendingReads: s.faults.SnapshotPendingReads} // s.mu is held
	return id, nil
}

func (s *Server) snapshot(r *http.Request) (*DiskState, *SnapState, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, nil, herr
	}
	sn := s.st.Snapshots[r.PathValue("snap")]
	if sn == nil || sn.DiskID != d.ID {
		return nil, nil, errf(404, "snapshot %s of disk %d not found", r.PathValue("snap"), d.ID)
	}
	return d, sn, nil
}

func (s *Server) getSnapshot(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, sn, herr := s.snapshot(r)
	if herr != nil {
		return nil, herr
	}
	created := strconv.FormatInt(sn.Created, 10)
	if sn.pendingRead() {
		created = ""
	}
	return map[string]any{"snapshot_id": sn.ID, "snapshot_name": sn.Name,
		"creation_time": created, "disks": []map[string]int64{{"disk_id": d.ID}}}, nil
}

func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	_, sn, herr := s.snapshot(r)
	if herr != nil {
		return nil, herr
	}
	if err := s.opts.Backend.DeleteSnapshot(sn.ID); err != nil {
		return nil, errf(500, "%v", err)
	}
	delete(s.st.Snapshots, sn.ID)
	return success, nil
}

func (s *Server) cloneSnapshot(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, sn, herr := s.snapshot(r)
	if herr != nil {
		return nil, herr
	}
	if s.faults.ForbidCreate {
		return nil, errf(403, "access denied: no role on location %s permits disk creation", d.Location)
	}
	name := r.URL.Query().Get("name")
	if name == "" {
		return nil, errf(400, "name is required")
	}
	if sn.SizeGiB > s.st.freeGiB(d.Location) {
		return nil, errf(400, "not enough vdisk capacity in location %s for a copy of %d GiB", d.Location, sn.SizeGiB)
	}
	id := s.st.nextID()
	if err := s.opts.Backend.CloneSnapshot(sn.ID, id); err != nil {
		return nil, errf(500, "%v", err)
	}
	s.st.Disks[id] = &DiskState{ID: id, Name: name, Description: r.URL.Query().Get("description"),
		Location: d.Location, SizeGiB: sn.SizeGiB, Bytes: sn.Bytes, Type: d.Type, IOPS: d.IOPS}
	return map[string]any{"result": []map[string]int64{{"original_disk_id": d.ID, "new_disk_id": id}}}, nil
}

func (s *Server) listNotes(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	res := []map[string]any{}
	for _, n := range d.Notes {
		res = append(res, map[string]any{"id": n.ID, "title": n.Title, "content": n.Content,
			"creation_time": n.Created, "last_update_time": n.Created, "created_by": "sim", "modified_by": "sim"})
	}
	return map[string]any{"result": res}, nil
}

type noteInput struct {
	Title   string `json:"title"`
	Content string `json:"content"`
}

func (s *Server) addNote(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	var in noteInput
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Title == "" {
		return nil, errf(400, "a note needs a title and content")
	}
	s.st.NoteSeq++
	d.Notes = append(d.Notes, &NoteState{ID: strconv.FormatInt(s.st.NoteSeq, 10), Title: in.Title,
		Content: in.Content, Created: float64(time.Now().Unix())})
	return success, nil
}

func (s *Server) updateNote(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	d, herr := s.disk(r)
	if herr != nil {
		return nil, herr
	}
	var in noteInput
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Title == "" {
		return nil, errf(400, "a note needs a title and content")
	}
	for _, n := range d.Notes {
		if n.ID == r.PathValue("note") {
			n.Title, n.Content = in.Title, in.Content
			return success, nil
		}
	}
	return nil, errf(404, "note %s of disk %d not found", r.PathValue("note"), d.ID)
}

func (s *Server) listCloudspaces(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	res := []map[string]any{}
	for _, c := range s.st.Cloudspaces {
		res = append(res, map[string]any{"cloudspace_id": c.ID, "name": c.Name, "location": c.Location,
			"status": "DEPLOYED"})
	}
	return map[string]any{"result": res}, nil
}

func (s *Server) listVMs(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	cs := r.PathValue("cs")
	if s.st.cloudspace(cs) == nil {
		return nil, errf(404, "cloudspace %s not found", cs)
	}
	res := []map[string]any{}
	for _, v := range s.st.VMs {
		if v.Cloudspace != cs {
			continue
		}
		disks := []int64{}
		for _, d := range s.st.Disks {
			for _, a := range d.Attachments {
				if a.VMID == v.ID {
					disks = append(disks, d.ID)
				}
			}
		}
		res = append(res, map[string]any{"vm_id": v.ID, "name": v.Name, "status": "RUNNING",
			"reference_id": v.ReferenceID, "disks": disks})
	}
	return map[string]any{"result": res}, nil
}

func (s *Server) vmFromPath(r *http.Request) (*VMState, *httpError) {
	id, herr := intParam(r, "vm")
	if herr != nil {
		return nil, herr
	}
	vm := s.st.vm(r.PathValue("cs"), id)
	if vm == nil {
		return nil, errf(404, "VM %d not found in cloudspace %s", id, r.PathValue("cs"))
	}
	return vm, nil
}

func (s *Server) listVMDisks(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	vm, herr := s.vmFromPath(r)
	if herr != nil {
		return nil, herr
	}
	res := []map[string]any{}
	for _, d := range s.st.sortedDisksAll() {
		for _, a := range d.Attachments {
			if a.VMID == vm.ID {
				res = append(res, map[string]any{"disk_id": d.ID, "disk_name": d.Name, "disk_size": d.SizeGiB,
					"disk_type": d.Type, "status": "ASSIGNED", "pci_bus": a.PCIBus, "pci_slot": a.PCISlot,
					"exposed": false, "order": ""})
			}
		}
	}
	return map[string]any{"result": res}, nil
}

func (st *State) sortedDisksAll() []*DiskState {
	var out []*DiskState
	for _, l := range st.Locations {
		out = append(out, st.sortedDisks(l)...)
	}
	return out
}

// firstSlot is the first PCI slot data disks get.
const firstSlot = 6

// freeSlot picks the lowest free PCI slot on bus 0, from 6 up (the slots
// below are the VM's own devices), as a hot-plugging hypervisor would.
func (st *State) freeSlot(vmID int64) (int, int) {
	used := map[int]bool{}
	for _, d := range st.Disks {
		for _, a := range d.Attachments {
			if a.VMID == vmID {
				used[a.PCISlot] = true
			}
		}
	}
	for slot := firstSlot; ; slot++ {
		if !used[slot] {
			return 0, slot
		}
	}
}

func (s *Server) attach(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	vm, herr := s.vmFromPath(r)
	if herr != nil {
		return nil, herr
	}
	id, herr := intParam(r, "disk_id")
	if herr != nil {
		return nil, herr
	}
	d := s.st.Disks[id]
	cs := s.st.cloudspace(vm.Cloudspace)
	if d == nil || cs == nil || d.Location != cs.Location {
		return nil, errf(404, "disk %d not found in the location of VM %d", id, vm.ID)
	}
	for _, a := range d.Attachments {
		if a.VMID == vm.ID {
			return nil, errf(409, "disk %d is already attached to VM %d", id, vm.ID)
		}
		if !s.faults.AllowMultiAttach {
			return nil, errf(409, "disk %d is attached to VM %d", id, a.VMID)
		}
	}
	bus, slot := s.st.freeSlot(vm.ID)
	if slot >= firstSlot+s.opts.MaxDisksPerVM {
		return nil, errf(409, "VM %d has no free PCI slot for disk %d: it has %d data disks", vm.ID, id, s.opts.MaxDisksPerVM)
	}
	dev, err := s.opts.Backend.Attach(vm, id, bus, slot)
	if err != nil {
		return nil, errf(500, "%v", err)
	}
	d.Attachments = append(d.Attachments, &Attachment{VMID: vm.ID, PCIBus: bus, PCISlot: slot, Device: dev})
	return success, nil
}

func (s *Server) detach(w http.ResponseWriter, r *http.Request) (any, *httpError) {
	vm, herr := s.vmFromPath(r)
	if herr != nil {
		return nil, herr
	}
	id, herr := intParam(r, "disk")
	if herr != nil {
		return nil, herr
	}
	d := s.st.Disks[id]
	if d == nil {
		return nil, errf(404, "disk %d not found", id)
	}
	for i, a := range d.Attachments {
		if a.VMID == vm.ID {
			if err := s.opts.Backend.Detach(vm, id, a.Device); err != nil {
				return nil, errf(500, "%v", err)
			}
			d.Attachments = append(d.Attachments[:i], d.Attachments[i+1:]...)
			return success, nil
		}
	}
	return nil, errf(404, "disk %d is not attached to VM %d", id, vm.ID)
}

// Device returns the host device of disk id's attachment to the local VM.
func (s *Server) Device(id int64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d := s.st.Disks[id]; d != nil {
		for _, a := range d.Attachments {
			if vm := s.st.vmByID(a.VMID); vm != nil && vm.Local {
				return a.Device
			}
		}
	}
	return ""
}
