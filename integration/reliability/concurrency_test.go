package reliability

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode/agentnodetest"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/drivername"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// stormEnv is a whole volume stack on this host: the simulator in host
// mode (a disk attached to this machine's VM is a real loop device), the
// CSI controller and the CSI node plugin as two servers on their own unix
// sockets (as the Deployment and the DaemonSet run them: each with its own
// per-volume locks), and vco-agent's API with its real volume manager and
// claim check loop, mounting for real. The vault transit engine is the
// FAKE from transittest, and the dm-crypt mapping of encrypted volumes is
// faked by a loop device at the data offset (agentnodetest.LoopLUKS): this
// host has no device-mapper.
type stormEnv struct {
	dir, kubelet string
	sim          *sim.Server
	overlap      *overlapProxy
	backend      *sim.HostBackend
	ctrl         csi.ControllerClient
	node         csi.NodeClient
	mgr          *volume.Manager
	nodeA, nodeB string // node ids: this host, and a VM with no node here
	vmA          int64
}

func newStormEnv(t *testing.T) *stormEnv {
	t.Helper()
	needRoot(t)
	dir, err := os.MkdirTemp("", "vco-storm-")
	if err != nil {
		t.Fatal(err)
	}
	e := &stormEnv{dir: dir, kubelet: filepath.Join(dir, "kubelet"), backend: &sim.HostBackend{Dir: filepath.Join(dir, "disks")}, nodeA: hostUUID}
	// Runs last: whatever a failed run left goes before the directory.
	t.Cleanup(func() {
		unmountUnder(dir)
		for _, l := range loopsUnder(t, dir) {
			exec.Command("losetup", "-d", strings.Fields(l)[0]).Run()
		}
		os.RemoveAll(dir)
	})
	os.MkdirAll(e.kubelet, 0o750)
	logs := &strings.Builder{}
	logMu := &sync.Mutex{}
	log := slog.New(slog.NewTextHandler(lockedWriter{logMu, logs}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	t.Cleanup(func() {
		if t.Failed() {
			logMu.Lock()
			t.Logf("plugin and agent log:\n%s", logs.String())
			logMu.Unlock()
		}
	})

	seed := sim.DefaultSeed()
	seed.HostVM.ReferenceID, seed.HostVM.Location = hostUUID, hostLoc
	e.sim, err = sim.New(sim.Options{Customer: "acme", Token: testJWT, StateFile: filepath.Join(dir, "sim.json"), Seed: seed, Backend: e.backend})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range e.sim.Snapshot().VMs {
		switch {
		case vm.Local:
			e.vmA = vm.ID
		case vm.Cloudspace == "cs-"+hostLoc && e.nodeB == "":
			e.nodeB = vm.ReferenceID
		}
	}
	e.overlap = &overlapProxy{next: e.sim, inflight: map[int64]string{}}
	hs := httptest.NewServer(e.overlap)
	t.Cleanup(hs.Close)
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte(testJWT), 0o600)
	api, err := cloud.New(cloud.Config{BaseURL: hs.URL + "/api/1", Customer: "acme", TokenFile: tok,
		BackoffBase: time.Millisecond, BackoffMax: 20 * time.Millisecond, MaxAttempts: 5})
	if err != nil {
		t.Fatal(err)
	}

	// The agent, in this process so that -race sees its code too.
	key, err := fence.KeyFromUUID(hostUUID)
	if err != nil {
		t.Fatal(err)
	}
	e.mgr, err = volume.New(volume.Options{
		Config: config.Volumes{KubeletRoot: e.kubelet, DevRoot: "/dev", CheckInterval: 50 * time.Millisecond,
			AllowUnfenced: true, AllowLoopDevices: true},
		StateDir: filepath.Join(dir, "agent-state"), SysfsRoot: "/sys", Log: log.With("part", "agent"),
		Fencers: &volume.Fencing{Key: key, Node: hostUUID}, Crypt: agentnodetest.NewLoopLUKS(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	checks, stopChecks := context.WithCancel(context.Background())
	checked := make(chan struct{})
	go func() { e.mgr.Run(checks); close(checked) }()
	t.Cleanup(func() { stopChecks(); <-checked; e.mgr.Close() })
	agent := agentnodetest.ServeAgent(t, filepath.Join(dir, "agent.sock"), e.mgr,
		server.NodeIdentity{SystemUUID: hostUUID, Location: hostLoc}, log.With("part", "agent-api"),
		agentnode.Options{AllowUnfenced: true, LoopDiskDir: e.backend.Dir})
	tc, _ := agentnodetest.Transit(t)

	name := drivername.FromPortal("try.whitesky.cloud")
	serve := func(mode driver.Mode, cfg driver.Config) *grpc.ClientConn {
		cfg.Name, cfg.Version, cfg.Mode = name, "test", mode
		d, err := driver.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		sock := filepath.Join(dir, string(mode)+".sock")
		l, err := driver.Listen("unix://" + sock)
		if err != nil {
			t.Fatal(err)
		}
		srv := d.NewGRPCServer(log.With("part", string(mode)))
		go srv.Serve(l)
		t.Cleanup(srv.Stop)
		conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	e.ctrl = csi.NewControllerClient(serve(driver.ModeController, driver.Config{Cloud: api, DefaultLocation: hostLoc,
		AttachPoll: 5 * time.Millisecond, AttachTimeout: 5 * time.Second}))
	e.node = csi.NewNodeClient(serve(driver.ModeNode, driver.Config{Agent: agent, KubeletRoot: e.kubelet,
		Transit: tc, TransitKey: crypt.TransitKey{Mount: "transit", Name: "vco-volumes"}}))
	return e
}

// overlapProxy stands between the controller and the simulator and
// records every request that changes a disk while another request that
// changes the same disk is in flight: the controller's per-volume lock
// must keep them apart.
type overlapProxy struct {
	next http.Handler

	mu       sync.Mutex
	inflight map[int64]string
	checked  int
	overlaps []string
}

var diskInPath = regexp.MustCompile(`/disks/(\d+)`)

func (p *overlapProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var disk int64
	if m := diskInPath.FindStringSubmatch(r.URL.Path); m != nil {
		disk, _ = strconv.ParseInt(m[1], 10, 64)
	} else if v := r.URL.Query().Get("disk_id"); v != "" {
		disk, _ = strconv.ParseInt(v, 10, 64)
	}
	if r.Method == http.MethodGet || disk == 0 {
		p.next.ServeHTTP(w, r)
		return
	}
	what := r.Method + " " + r.URL.Path
	p.mu.Lock()
	p.checked++
	other, busy := p.inflight[disk]
	if busy {
		p.overlaps = append(p.overlaps, fmt.Sprintf("%s while %s was in flight", what, other))
	} else {
		p.inflight[disk] = what
	}
	p.mu.Unlock()
	p.next.ServeHTTP(w, r)
	if !busy {
		p.mu.Lock()
		delete(p.inflight, disk)
		p.mu.Unlock()
	}
}

func (p *overlapProxy) take() (checked int, overlaps []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	checked, overlaps = p.checked, p.overlaps
	p.checked, p.overlaps = 0, nil
	return checked, overlaps
}

// Paths the kubelet would use for a volume id.
func pathName(id string) string { return strings.ReplaceAll(id, "/", "_") }

func (e *stormEnv) staging(id string) string {
	return filepath.Join(e.kubelet, "plugins", "kubernetes.io", "csi", "cloud.whitesky.csi", pathName(id), "globalmount")
}

func (e *stormEnv) target(id string) string {
	return filepath.Join(e.kubelet, "pods", "pod-"+pathName(id), "volumes", "kubernetes.io~csi", pathName(id), "mount")
}

// stormVolume is what the test knows about one volume name.
type stormVolume struct {
	name      string
	encrypted bool
	fs        string

	mu     sync.Mutex
	id     string            // from the last CreateVolume that succeeded
	ids    map[string]bool   // every id a CreateVolume returned for the name
	volCtx map[string]string // the volume context CreateVolume returned
	pubCtx map[string]map[string]string
}

func (v *stormVolume) current() (string, map[string]string, map[string]string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	pc := v.pubCtx[v.id]
	if pc == nil {
		// The kubelet passes what the attacher recorded; before any
		// publish to this node there is none but the disk id.
		_, disk, _ := strings.Cut(v.id, "/")
		pc = map[string]string{driver.PubDiskID: disk}
	}
	return v.id, v.volCtx, pc
}

func (v *stormVolume) created(r *csi.CreateVolumeResponse) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.id, v.volCtx = r.GetVolume().GetVolumeId(), r.GetVolume().GetVolumeContext()
	v.ids[v.id] = true
}

func (v *stormVolume) published(id string, pc map[string]string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.pubCtx[id] = pc
}

// copyName is the name of the volume's copies in the storm.
func (v *stormVolume) copyName() string { return v.name + "-copy" }

func (v *stormVolume) capability() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: v.fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

func (e *stormEnv) createReq(v *stormVolume) *csi.CreateVolumeRequest {
	r := createReq(v.name, 1)
	r.VolumeCapabilities = []*csi.VolumeCapability{v.capability()}
	if v.encrypted {
		r.Parameters = map[string]string{"encryption": "true"}
	}
	return r
}

// stormCall is one CSI call of the storm, and what came of it.
type stormCall struct {
	method string
	vol    int    // index of the volume name
	node   string // for controller publish and unpublish
	gib    int64  // for expand
	snap   string // for snapshot
	delay  time.Duration

	id         string // the volume id it was made with
	src        string // a copy's source volume id
	start, end time.Time
	err        error
}

// Weights of the methods in the storm: every call the CO makes on a
// volume's way in and out, with DeleteVolume rarer, as in a cluster.
var stormMethods = []struct {
	name   string
	weight int
}{
	{"CreateVolume", 10}, {"DeleteVolume", 5}, {"ControllerPublishVolume", 15}, {"ControllerUnpublishVolume", 9},
	{"ControllerExpandVolume", 6}, {"CreateSnapshot", 6}, {"NodeStageVolume", 15}, {"NodeUnstageVolume", 9},
	{"NodePublishVolume", 13}, {"NodeUnpublishVolume", 8}, {"NodeExpandVolume", 4},
	// A copy of the volume (CreateVolume with it as the source), by a
	// name of its own: made through a snapshot of the source.
	{"CreateVolume copy", 4},
	// Reads, which take no lock, racing with the changes.
	{"ControllerGetVolume", 3}, {"NodeGetVolumeStats", 4},
}

func stormPlan(rng *rand.Rand, n, vols int, nodes [2]string) []*stormCall {
	total := 0
	for _, m := range stormMethods {
		total += m.weight
	}
	var out []*stormCall
	for range n {
		r := rng.IntN(total)
		var method string
		for _, m := range stormMethods {
			if r < m.weight {
				method = m.name
				break
			}
			r -= m.weight
		}
		c := &stormCall{method: method, vol: rng.IntN(vols), node: nodes[rng.IntN(3)/2], gib: 2 + int64(rng.IntN(2))}
		c.snap = fmt.Sprintf("snap-%d-%d", c.vol, rng.IntN(2))
		// Spread over 400 ms, so calls land on operations in flight,
		// not only on each other's locks at the first instant.
		c.delay = time.Duration(rng.IntN(400)) * time.Millisecond
		out = append(out, c)
	}
	return out
}

// do makes one call; the CO's timeout for a call is 30 s.
func (e *stormEnv) do(c *stormCall, v *stormVolume) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, vctx, pc := v.current()
	c.id = id
	c.start = time.Now()
	defer func() { c.end = time.Now() }()
	var err error
	switch c.method {
	case "CreateVolume":
		c.id = v.name
		var r *csi.CreateVolumeResponse
		if r, err = e.ctrl.CreateVolume(ctx, e.createReq(v)); err == nil {
			v.created(r)
			c.id = r.GetVolume().GetVolumeId()
		}
	case "CreateVolume copy":
		r := e.createReq(v)
		r.Name = v.copyName()
		r.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
		c.id, c.src = r.Name, id
		_, err = e.ctrl.CreateVolume(ctx, r)
	case "DeleteVolume":
		_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	case "ControllerPublishVolume":
		var r *csi.ControllerPublishVolumeResponse
		r, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: c.node, VolumeCapability: v.capability(), VolumeContext: vctx})
		if err == nil && c.node == e.nodeA {
			v.published(id, r.GetPublishContext())
		}
	case "ControllerUnpublishVolume":
		_, err = e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: c.node})
	case "ControllerExpandVolume":
		_, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: c.gib << 30}, VolumeCapability: v.capability()})
	case "CreateSnapshot":
		_, err = e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: c.snap + "-" + pathName(id), SourceVolumeId: id})
	case "NodeStageVolume":
		_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id), VolumeCapability: v.capability(), PublishContext: pc, VolumeContext: vctx})
	case "NodeUnstageVolume":
		_, err = e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)})
	case "NodePublishVolume":
		_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id), TargetPath: e.target(id), VolumeCapability: v.capability(), VolumeContext: vctx, PublishContext: pc})
	case "NodeUnpublishVolume":
		_, err = e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: e.target(id)})
	case "ControllerGetVolume":
		_, err = e.ctrl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
	case "NodeGetVolumeStats":
		_, err = e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: e.target(id)})
	case "NodeExpandVolume":
		_, err = e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: e.staging(id), CapacityRange: &csi.CapacityRange{RequiredBytes: c.gib << 30}, VolumeCapability: v.capability()})
	}
	c.err = err
}

// stormCodes are the answers that are right for each method while other
// calls race with it on the same volumes; stormJudge narrows them to the
// situation. ABORTED is a volume busy with another call (the per-volume
// lock of the controller, of the node plugin, or of the agent).
var stormCodes = map[string][]codes.Code{
	"CreateVolume": {codes.OK, codes.Aborted},
	// The source deleted; the copy's name taken by a copy of the
	// source's earlier disk, before a delete and create of the name.
	"CreateVolume copy": {codes.OK, codes.Aborted, codes.NotFound, codes.AlreadyExists},
	// Attached, or holding snapshots.
	"DeleteVolume": {codes.OK, codes.Aborted, codes.FailedPrecondition},
	// Attached to the other node; deleted.
	"ControllerPublishVolume":   {codes.OK, codes.Aborted, codes.FailedPrecondition, codes.NotFound},
	"ControllerUnpublishVolume": {codes.OK, codes.Aborted},
	"ControllerExpandVolume":    {codes.OK, codes.Aborted, codes.NotFound},
	"CreateSnapshot":            {codes.OK, codes.Aborted, codes.NotFound},
	// The disk is not attached here (NOT_FOUND), or is, but not as the
	// device it was staged on (FAILED_PRECONDITION).
	"NodeStageVolume": {codes.OK, codes.Aborted, codes.NotFound, codes.FailedPrecondition},
	// Still published.
	"NodeUnstageVolume": {codes.OK, codes.Aborted, codes.FailedPrecondition},
	// Not staged (yet, or any more), or staged and lost its disk.
	"NodePublishVolume":   {codes.OK, codes.Aborted, codes.FailedPrecondition},
	"NodeUnpublishVolume": {codes.OK, codes.Aborted},
	// Not staged; the grown disk not there (detached).
	"NodeExpandVolume": {codes.OK, codes.Aborted, codes.NotFound, codes.FailedPrecondition},
	// Deleted.
	"ControllerGetVolume": {codes.OK, codes.NotFound},
	// Not staged, or not published at the path.
	"NodeGetVolumeStats": {codes.OK, codes.NotFound},
}

// stormJudge says what is wrong with a call's answer, or "".
func stormJudge(c *stormCall, deletes []*stormCall, v *stormVolume) string {
	st := status.Convert(c.err)
	if !slices.Contains(stormCodes[c.method], st.Code()) {
		return fmt.Sprintf("code %s is not one of %v", st.Code(), stormCodes[c.method])
	}
	if c.err == nil {
		return ""
	}
	// The message names the volume (its id; its name before it has one).
	if !strings.Contains(st.Message(), c.id) && !strings.Contains(st.Message(), v.name) {
		return fmt.Sprintf("%s without naming volume %s", st.Code(), c.id)
	}
	if st.Code() == codes.NotFound && (strings.HasPrefix(c.method, "Controller") || c.method == "CreateSnapshot" || c.method == "CreateVolume copy") {
		return stormJudgeNotFound(c, deletes)
	}
	for _, r := range stormRefusals {
		if c.method == r.method && st.Code() == r.code && !r.says(st.Message()) {
			return r.wrong
		}
	}
	return ""
}

// stormJudgeNotFound: only a volume some DeleteVolume removed before this
// call answered is gone.
func stormJudgeNotFound(c *stormCall, deletes []*stormCall) string {
	for _, d := range deletes {
		if (d.id == c.id || d.id == c.src) && d.err == nil && d.start.Before(c.end) {
			return ""
		}
	}
	return "NOT_FOUND for a volume no DeleteVolume had removed"
}

// stormRefusals are what a refusal of a method with a code must say, and
// what is wrong with it when it does not.
var stormRefusals = []struct {
	method string
	code   codes.Code
	says   func(msg string) bool
	wrong  string
}{
	{"CreateVolume copy", codes.AlreadyExists,
		func(m string) bool { return strings.Contains(m, "source differ") },
		"ALREADY_EXISTS for a copy that is not of another source"},
	{"ControllerPublishVolume", codes.FailedPrecondition,
		func(m string) bool { return strings.Contains(m, "attached to") },
		"FAILED_PRECONDITION that does not name the node the volume is attached to"},
	{"NodeUnstageVolume", codes.FailedPrecondition,
		func(m string) bool { return strings.Contains(m, "still published") },
		"FAILED_PRECONDITION that does not say the volume is still published"},
	{"DeleteVolume", codes.FailedPrecondition,
		func(m string) bool { return strings.Contains(m, "attached") || strings.Contains(m, "snapshot") },
		"FAILED_PRECONDITION that says neither attached nor snapshot"},
}

// stormEnvInt reads a positive number from the environment: `make soak`
// sets VCO_STORM_ROUNDS, and a failure is repeated with VCO_STORM_SEED.
func stormEnvInt(t *testing.T, name string, def int) int {
	if s := os.Getenv(name); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q is not a positive number", name, s)
		}
		return n
	}
	return def
}

// TestConcurrentCSICalls fires 100 CSI calls at once (VCO_STORM_CALLS) at
// five volumes that overlap (VCO_STORM_VOLUMES): CreateVolume with the
// same names, publish and unpublish to two nodes, stage, publish,
// unpublish and unstage on the same paths, expand, snapshot, copies
// (CreateVolume from the volume), reads that take no lock, and
// DeleteVolume among them, through the real controller and node plugin to
// the simulator and the agent. Every answer must be a code right for the
// call's situation with a message naming the volume. Then the volumes are
// settled the way the kubelet and the external-attacher would, retrying,
// to a defined end state, and the simulator's disks and attachments, the
// plugin's view, the host's mounts and loop devices and the agent's claim
// records must all agree with it; finally everything is torn down and
// nothing may be left. The plan (which call, on which volume, when) comes
// from a seed, printed and taken from VCO_STORM_SEED, so a failure's plan
// repeats; the interleaving within it is the scheduler's.
func TestConcurrentCSICalls(t *testing.T) {
	e := newStormEnv(t)
	calls := stormEnvInt(t, "VCO_STORM_CALLS", 100)
	nvols := stormEnvInt(t, "VCO_STORM_VOLUMES", 5)
	rounds := stormEnvInt(t, "VCO_STORM_ROUNDS", 1)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("VCO_STORM_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("VCO_STORM_SEED=%q is not a number", s)
		}
	}
	t.Logf("storm: %d rounds of %d concurrent calls on %d volumes, seed %d (VCO_STORM_SEED=%d repeats the plan)", rounds, calls, nvols, seed, seed)
	if !volume.CanGrowExt4Online() {
		t.Logf("storm: every volume is XFS: this process lacks CAP_SYS_RESOURCE, without which a mounted ext4 cannot grow")
	}
	rng := rand.New(rand.NewPCG(seed, 0x5707))
	a := &stormAnswers{tally: map[string]map[codes.Code]int{}, examples: map[string]string{}}
	changes, overlapped := 0, 0
	for round := 1; round <= rounds; round++ {
		vols := e.stormSetup(t, round, nvols)
		plan := stormPlan(rng, calls, nvols, [2]string{e.nodeA, e.nodeB})
		e.storm(t, plan, vols)
		n, overlaps := e.overlap.take()
		changes, overlapped = changes+n, overlapped+len(overlaps)
		for _, o := range overlaps {
			t.Errorf("round %d: two calls changed one disk at once: %s", round, o)
		}
		e.checkOneDiskPerName(t, round)
		a.judge(t, round, plan, vols)
		end := e.settle(t, rng, vols)
		e.checkEndState(t, vols, end)
		for _, v := range vols {
			end[v.name] = false
		}
		e.settle(t, nil, vols)
		e.checkEndState(t, vols, end)
	}
	byMethod, n := a.byMethod()
	t.Logf("storm: %d calls by method and code (seed %d):%s", n, seed, byMethod)
	t.Logf("storm: a message of each refusal:%s", a.messages())
	unexpected := a.unexpected
	figures.add("concurrent CSI calls on overlapping volumes", n)
	figures.add("concurrent CSI calls answered with an unexpected code", unexpected)
	figures.add("concurrent CSI calls: API changes to a disk checked for overlap", changes)
	figures.add("concurrent CSI calls: API changes to a disk that overlapped another", overlapped)
	t.Logf("storm: %d API requests changing a disk, %d of them while another changing the same disk was in flight", changes, overlapped)
	figures.note("Concurrent CSI calls", fmt.Sprintf("%d rounds of %d calls fired at once on %d overlapping volumes (seed %d), answers by method:\n\n```%s\n```\n\n"+
		"%d unexpected answers; %d API requests that change a disk, %d of them while another changing the same disk was in flight. "+
		"Checked after each round, once settled to a mixed end state and once torn down: one disk per name, no attachment "+
		"the plugin does not report, mounts, loop devices and agent claim records exactly those of the volumes in use. "+
		"A ControllerUnpublishVolume that lands while this node still has the volume staged (the attacher never sends one then) "+
		"detaches the disk under its mount: the agent marks the claim missing, and refuses a second device of the same disk "+
		"with FAILED_PRECONDITION, until the volume is unstaged. "+
		"`make soak` first runs the test under the race detector as well.",
		rounds, calls, nvols, seed, byMethod, unexpected, changes, overlapped))
}

// checkOneDiskPerName: after the storm the simulator holds at most one
// disk of each name.
func (e *stormEnv) checkOneDiskPerName(t *testing.T, round int) {
	t.Helper()
	names := map[string]int{}
	for _, d := range e.sim.Snapshot().Disks {
		names[d.Name]++
	}
	for name, k := range names {
		if k > 1 {
			t.Errorf("round %d: after the storm the simulator holds %d disks named %s", round, k, name)
		}
	}
}

// stormAnswers tallies the storm's answers across rounds.
type stormAnswers struct {
	tally      map[string]map[codes.Code]int
	examples   map[string]string // the first message of each method and code
	unexpected int
}

// judge tallies a round's answers and fails on each stormJudge finds
// wrong.
func (a *stormAnswers) judge(t *testing.T, round int, plan []*stormCall, vols []*stormVolume) {
	t.Helper()
	var deletes []*stormCall
	for _, c := range plan {
		if c.method == "DeleteVolume" {
			deletes = append(deletes, c)
		}
	}
	for _, c := range plan {
		code := status.Code(c.err)
		if a.tally[c.method] == nil {
			a.tally[c.method] = map[codes.Code]int{}
		}
		a.tally[c.method][code]++
		if k := c.method + " " + code.String(); c.err != nil && a.examples[k] == "" {
			a.examples[k] = status.Convert(c.err).Message()
		}
		if why := stormJudge(c, deletes, vols[c.vol]); why != "" {
			a.unexpected++
			t.Errorf("round %d: %s of %s: %s: %v", round, c.method, c.id, why, c.err)
		}
	}
}

// byMethod is the tally as lines of method and codes, and the number of
// calls.
func (a *stormAnswers) byMethod() (string, int) {
	var b strings.Builder
	methods := make([]string, 0, len(a.tally))
	for m := range a.tally {
		methods = append(methods, m)
	}
	sort.Strings(methods)
	n := 0
	for _, m := range methods {
		var cs []string
		for code, k := range a.tally[m] {
			cs = append(cs, fmt.Sprintf("%s %d", code, k))
			n += k
		}
		sort.Strings(cs)
		fmt.Fprintf(&b, "\n  %-26s %s", m, strings.Join(cs, ", "))
	}
	return b.String(), n
}

// messages are the first message of each method and code, a line each.
func (a *stormAnswers) messages() string {
	ks := make([]string, 0, len(a.examples))
	for k := range a.examples {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	var ex strings.Builder
	for _, k := range ks {
		fmt.Fprintf(&ex, "\n  %s: %s", k, a.examples[k])
	}
	return ex.String()
}

// stormSetup creates the round's volumes and brings them to a mix of
// states, so the storm starts with something to unpublish and unstage:
// free, attached here, staged here, in use here, attached to node B.
func (e *stormEnv) stormSetup(t *testing.T, round, n int) []*stormVolume {
	t.Helper()
	var vols []*stormVolume
	for i := range n {
		fs := "xfs"
		if i%2 == 0 && volume.CanGrowExt4Online() {
			fs = "ext4"
		}
		v := &stormVolume{name: fmt.Sprintf("pvc-storm-r%d-%d", round, i), encrypted: i%5 == 2, fs: fs, ids: map[string]bool{}, pubCtx: map[string]map[string]string{}}
		vols = append(vols, v)
		e.bringTo(t, v, i%5)
	}
	return vols
}

// The states bringTo knows, each a step further: 0 created, 1 attached
// to this node, 2 staged, 3 published in a pod; 4 attached to node B.
func (e *stormEnv) bringTo(t *testing.T, v *stormVolume, state int) {
	t.Helper()
	retry(t, "create "+v.name, func(ctx context.Context) error {
		r, err := e.ctrl.CreateVolume(ctx, e.createReq(v))
		if err == nil {
			v.created(r)
		}
		return err
	})
	id, vctx, _ := v.current()
	node := e.nodeA
	if state == 4 {
		node = e.nodeB
	}
	if state >= 1 {
		retry(t, "publish "+id+" to "+node, func(ctx context.Context) error {
			r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: v.capability(), VolumeContext: vctx})
			if err == nil && node == e.nodeA {
				v.published(id, r.GetPublishContext())
			}
			return err
		})
	}
	if state == 4 {
		return
	}
	_, _, pc := v.current()
	if state >= 2 {
		retry(t, "stage "+id, func(ctx context.Context) error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id), VolumeCapability: v.capability(), PublishContext: pc, VolumeContext: vctx})
			return err
		})
	}
	if state >= 3 {
		retry(t, "node publish "+id, func(ctx context.Context) error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id), TargetPath: e.target(id), VolumeCapability: v.capability(), VolumeContext: vctx, PublishContext: pc})
			return err
		})
	}
}

// storm starts every call at once and waits for all; a call that never
// answers is a deadlock, reported with every goroutine's stack.
func (e *stormEnv) storm(t *testing.T, plan []*stormCall, vols []*stormVolume) {
	t.Helper()
	var ready, done sync.WaitGroup
	gate := make(chan struct{})
	for _, c := range plan {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ready.Done()
			<-gate
			time.Sleep(c.delay)
			e.do(c, vols[c.vol])
		}()
	}
	ready.Wait()
	close(gate)
	finished := make(chan struct{})
	go func() { done.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(60 * time.Second):
		buf := make([]byte, 4<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("storm: calls still running after 60 s (deadlock?); goroutines:\n%s", buf)
	}
}

// retry makes a call until it succeeds, as the kubelet and the sidecars
// do; in the settle phase nothing else runs, so it must succeed soon.
func retry(t *testing.T, what string, fn func(ctx context.Context) error) {
	t.Helper()
	var err error
	for range 30 {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = fn(ctx)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: still failing after 30 tries: %v", what, err)
}

// settle drives every volume to an end state as the kubelet and the
// external-attacher would, retrying each step until it succeeds: ids a
// recreate replaced are unpublished and unstaged here; then each name is
// either in use in a pod on this node (end true) or deleted with its
// snapshots. With rng nil every volume is deleted.
func (e *stormEnv) settle(t *testing.T, rng *rand.Rand, vols []*stormVolume) map[string]bool {
	t.Helper()
	end := map[string]bool{}
	copies := map[string]bool{}
	for _, v := range vols {
		copies[v.copyName()] = true
	}
	// The copies go first, and their temporary snapshots with them, so
	// that nothing holds a source: the provisioner knows their ids from
	// the create it retried; here they are read from the simulator.
	for _, d := range e.sim.Snapshot().Disks {
		if copies[d.Name] {
			e.tearDown(t, hostLoc+"/"+strconv.FormatInt(d.ID, 10))
		}
	}
	for _, v := range vols {
		inUse := rng != nil && rng.IntN(2) == 0
		end[v.name] = inUse
		id, _, _ := v.current()
		var old []string
		for o := range v.ids {
			if o != id {
				old = append(old, o)
			}
		}
		sort.Strings(old)
		for _, o := range old {
			e.tearDown(t, o)
		}
		if !inUse {
			e.tearDown(t, id)
			continue
		}
		// Down on the node and detached everywhere, as after a pod
		// moved; the storm may have detached a disk under its mount, or
		// deleted the name's disk, which the provisioner makes again.
		e.detach(t, id)
		e.bringTo(t, v, 3)
	}
	return end
}

// tearDown takes a volume id all the way out: detach, then its
// snapshots and its disk.
func (e *stormEnv) tearDown(t *testing.T, id string) {
	t.Helper()
	e.detach(t, id)
	retry(t, "delete the snapshots of "+id, func(ctx context.Context) error {
		r, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: id})
		if err != nil {
			return err
		}
		for _, s := range r.GetEntries() {
			if _, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: s.GetSnapshot().GetSnapshotId()}); err != nil {
				return err
			}
		}
		return nil
	})
	retry(t, "delete "+id, func(ctx context.Context) error {
		_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		return err
	})
}

// detach unmounts a volume from the pod, unstages it and detaches it from
// both nodes, in the kubelet's and the attacher's order.
func (e *stormEnv) detach(t *testing.T, id string) {
	t.Helper()
	retry(t, "node unpublish "+id, func(ctx context.Context) error {
		_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: e.target(id)})
		return err
	})
	retry(t, "unstage "+id, func(ctx context.Context) error {
		_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)})
		return err
	})
	for _, node := range []string{e.nodeA, e.nodeB} {
		retry(t, "unpublish "+id+" from "+node, func(ctx context.Context) error {
			_, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node})
			return err
		})
	}
}

// endCheck gathers the failures of one checkEndState.
type endCheck struct {
	t   *testing.T
	bad bool
}

func (c *endCheck) fail(format string, a ...any) {
	c.t.Helper()
	c.bad = true
	c.t.Errorf(format, a...)
}

// checkEndState compares the simulator, the plugin, the host and the
// agent with the end state: the names end marks true are in use in a pod
// on this node, the others are gone.
func (e *stormEnv) checkEndState(t *testing.T, vols []*stormVolume, end map[string]bool) {
	t.Helper()
	c := &endCheck{t: t}
	st := e.sim.Snapshot()
	want := e.checkSimulatorDisks(c, st, vols, end)
	e.checkPluginReportsAttachments(c, st)
	e.checkHostMountsAndLoops(c, want)
	e.checkAgentClaims(c, want)
	if c.bad {
		t.FailNow()
	}
}

// checkSimulatorDisks: the simulator holds one disk per name in use,
// attached to this node's VM only, the one the plugin answered, and no
// disk of a deleted name or of a name no volume has; no snapshot outlives
// its disk. It returns the volumes in use by id.
func (e *stormEnv) checkSimulatorDisks(c *endCheck, st sim.State, vols []*stormVolume, end map[string]bool) map[string]*stormVolume {
	c.t.Helper()
	byName := map[string][]*sim.DiskState{}
	for _, d := range st.Disks {
		byName[d.Name] = append(byName[d.Name], d)
	}
	want := map[string]*stormVolume{} // volume id -> in use
	for _, v := range vols {
		ds := byName[v.name]
		delete(byName, v.name)
		id, _, _ := v.current()
		switch {
		case !end[v.name] && len(ds) != 0:
			c.fail("%s was deleted, but the simulator holds %d disks of that name (first: %d)", v.name, len(ds), ds[0].ID)
		case !end[v.name]:
		case len(ds) != 1:
			c.fail("%s is in use, but the simulator holds %d disks of that name, not 1", v.name, len(ds))
		case hostLoc+"/"+strconv.FormatInt(ds[0].ID, 10) != id:
			c.fail("%s: the simulator's disk is %d, but the plugin answered %s", v.name, ds[0].ID, id)
		default:
			want[id] = v
			d := ds[0]
			if len(d.Attachments) != 1 || d.Attachments[0].VMID != e.vmA {
				c.fail("volume %s (%s) should be attached to VM %d (node %s) only; attachments %+v", id, v.name, e.vmA, e.nodeA, d.Attachments)
			}
		}
	}
	for name, ds := range byName {
		c.fail("the simulator holds %d disks named %q, a name no volume has (first: %d)", len(ds), name, ds[0].ID)
	}
	for _, s := range st.Snapshots {
		if st.Disks[s.DiskID] == nil {
			c.fail("snapshot %s (%s) outlived its disk %d", s.ID, s.Name, s.DiskID)
		}
	}
	return want
}

// checkPluginReportsAttachments: the plugin reports every attachment the
// simulator has, and no other.
func (e *stormEnv) checkPluginReportsAttachments(c *endCheck, st sim.State) {
	c.t.Helper()
	lv, err := e.ctrl.ListVolumes(context.Background(), &csi.ListVolumesRequest{})
	if err != nil {
		c.t.Fatalf("ListVolumes: %v", err)
	}
	reported := map[string][]string{}
	for _, en := range lv.GetEntries() {
		reported[en.GetVolume().GetVolumeId()] = en.GetStatus().GetPublishedNodeIds()
	}
	for _, d := range st.Disks {
		id := hostLoc + "/" + strconv.FormatInt(d.ID, 10)
		var nodes []string
		for _, a := range d.Attachments {
			for _, vm := range st.VMs {
				if vm.ID == a.VMID {
					nodes = append(nodes, vm.ReferenceID)
				}
			}
		}
		if got, ok := reported[id]; !ok || !slices.Equal(got, nodes) {
			c.fail("volume %s: the simulator has it attached to %v, ListVolumes reports %v (listed: %v)", id, nodes, got, ok)
		}
		delete(reported, id)
	}
	for id := range reported {
		c.fail("ListVolumes reports %s, which the simulator does not have", id)
	}
}

// checkHostMountsAndLoops: the host has one mount at the staging path and
// one at the pod's target per volume in use, each of its disk's loop
// device; loop devices only for the disks attached here.
func (e *stormEnv) checkHostMountsAndLoops(c *endCheck, want map[string]*stormVolume) {
	c.t.Helper()
	var wantMounts, wantLoops []string
	for id, v := range want {
		wantMounts = append(wantMounts, e.staging(id), e.target(id))
		_, disk, _ := strings.Cut(id, "/")
		n, _ := strconv.ParseInt(disk, 10, 64)
		wantLoops = append(wantLoops, e.backend.DiskFile(n))
		// An encrypted volume's mapping is a loop device stacked on its
		// disk's.
		if dev := e.sim.Device(n); v.encrypted && dev != "" {
			wantLoops = append(wantLoops, dev)
		}
	}
	sort.Strings(wantMounts)
	sort.Strings(wantLoops)
	gotMounts, gotLoops := e.settledMountsAndLoops(c.t, wantMounts, wantLoops)
	if !slices.Equal(wantMounts, gotMounts) {
		c.fail("mounts under the test directory:\n  got  %v\n  want %v", gotMounts, wantMounts)
	}
	if !slices.Equal(wantLoops, gotLoops) {
		c.fail("loop devices of the test's disks (by backing file):\n  got  %v\n  want %v", gotLoops, wantLoops)
	}
}

// settledMountsAndLoops reads the mounts under the test directory and the
// backing files of its loop devices, sorted, until they are those wanted
// or five seconds have passed. A loop device detached while open (the disk
// detached under its mount) goes when its last user closes it, which the
// kernel finishes in the background: the host gets a moment to agree.
func (e *stormEnv) settledMountsAndLoops(t *testing.T, wantMounts, wantLoops []string) (gotMounts, gotLoops []string) {
	t.Helper()
	start := time.Now()
	for deadline := start.Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		gotMounts, gotLoops = nil, nil
		for _, m := range mounts() {
			if strings.HasPrefix(m[0], e.dir+"/") {
				gotMounts = append(gotMounts, m[0])
			}
		}
		for _, l := range loopsUnder(t, e.dir) {
			gotLoops = append(gotLoops, strings.SplitN(l, " ", 2)[1])
		}
		sort.Strings(gotMounts)
		sort.Strings(gotLoops)
		if slices.Equal(wantMounts, gotMounts) && slices.Equal(wantLoops, gotLoops) || time.Now().After(deadline) {
			break
		}
	}
	if waited := time.Since(start); waited > 100*time.Millisecond {
		t.Logf("the host's mounts and loop devices took %v to settle", waited.Round(time.Millisecond))
	}
	return gotMounts, gotLoops
}

// checkAgentClaims: the agent's claim records are one per volume in use,
// staged at its path, published at its target, on the device the disk is
// attached as.
func (e *stormEnv) checkAgentClaims(c *endCheck, want map[string]*stormVolume) {
	c.t.Helper()
	claims, errs := e.mgr.Store().List()
	for _, err := range errs {
		c.fail("reading the agent's claims: %v", err)
	}
	seen := map[string]bool{}
	for _, cl := range claims {
		seen[cl.Volume] = true
		v, ok := want[cl.Volume]
		if !ok {
			c.fail("the agent holds a claim on %s (%s at %s), which is not in use", cl.Volume, cl.Phase, cl.StagingPath)
			continue
		}
		_, disk, _ := strings.Cut(cl.Volume, "/")
		n, _ := strconv.ParseInt(disk, 10, 64)
		if cl.Phase != volume.PhaseStaged || cl.Abnormal() || cl.StagingPath != e.staging(cl.Volume) ||
			!slices.Equal(cl.Publications, []string{e.target(cl.Volume)}) || cl.Device != e.sim.Device(n) || cl.Encrypted != v.encrypted {
			c.fail("the agent's claim on %s: phase %s, abnormal %v (%s), staged at %s, published at %v, device %s, encrypted %v; want staged at %s, published at %s, on %s",
				cl.Volume, cl.Phase, cl.Abnormal(), cl.Detail, cl.StagingPath, cl.Publications, cl.Device, cl.Encrypted, e.staging(cl.Volume), e.target(cl.Volume), e.sim.Device(n))
		}
	}
	for id := range want {
		if !seen[id] {
			c.fail("volume %s is in use, but the agent has no claim on it", id)
		}
	}
}
