package kubeevents

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
)

// agent serves vco-agent's real API server and event bus on a unix socket,
// as the daemon does; no volume manager runs (the events are published on
// the bus directly, as the manager would).
type agent struct {
	t       *testing.T
	sock    string
	bus     *events.Bus
	started time.Time
	srv     *grpc.Server
}

func newAgentSocket(t *testing.T) string {
	dir, err := os.MkdirTemp("", "ke")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

// start serves a new agent process with a ring of ring events.
func startAgent(t *testing.T, sock string, ring int) *agent {
	a := &agent{t: t, sock: sock, bus: events.NewBus(ring, 64, nil), started: time.Now()}
	a.serve()
	a.bus.Publish(events.Event{Type: events.AgentStarted, Message: "vco-agent test serving"})
	t.Cleanup(a.stop)
	return a
}

// serve (again) serves the same process's bus: after stop, this is a
// broken connection, not a restart.
func (a *agent) serve() {
	ln, err := net.Listen("unix", a.sock)
	if err != nil {
		a.t.Fatal(err)
	}
	a.srv = server.New(server.Options{Version: "test", Bus: a.bus, Started: a.started, Policy: peercred.Policy{GID: -1},
		Log: slog.New(slog.DiscardHandler)}).NewGRPC()
	go a.srv.Serve(ln)
}

func (a *agent) stop() { a.srv.Stop() }

func (a *agent) refuse(volume string) events.Event {
	return a.bus.Publish(events.Event{Type: events.DiskRefused, Volume: volume, Device: "/dev/sdb", Serial: "S1",
		HolderKey: 0xabcdef, HolderNode: "worker-2", Reason: "held-by-another-node",
		Message: "volume " + volume + ": disk /dev/sdb is held by worker-2"})
}

type collected struct {
	mu sync.Mutex
	r  []Report
}

func (c *collected) Record(r Report) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.r = append(c.r, r)
}

func (c *collected) all() []Report {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Report(nil), c.r...)
}

func dialAgent(t *testing.T, sock string) api.AgentClient {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.5, MaxDelay: 50 * time.Millisecond}}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return api.NewAgentClient(conn)
}

type followed struct {
	got    *collected
	missed *uint64
	log    *lockedBuffer
	mu     *sync.Mutex
}

func (f followed) missedN() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return *f.missed
}

func follow(t *testing.T, sock string) followed {
	fl := followed{got: &collected{}, missed: new(uint64), log: &lockedBuffer{}, mu: &sync.Mutex{}}
	f := &Follower{Agent: dialAgent(t, sock), To: fl.got, Log: slog.New(slog.NewTextHandler(fl.log, nil)),
		Missed: func(n uint64) { fl.mu.Lock(); *fl.missed += n; fl.mu.Unlock() },
		Retry:  10 * time.Millisecond, MaxRetry: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return fl
}

func seqs(rs []Report) []uint64 {
	var out []uint64
	for _, r := range rs {
		out = append(out, r.Seq)
	}
	return out
}

func TestFollowerHandsOnWhatOperatorsMustSee(t *testing.T) {
	sock := newAgentSocket(t)
	a := startAgent(t, sock, 256)
	a.bus.Publish(events.Event{Type: events.DiskClaimed, Volume: "pvc-1", Device: "/dev/sdb", Reason: "staged", Message: "volume pvc-1: staged"})
	refused := a.refuse("pvc-2") // before the follower: from the ring's replay
	fl := follow(t, sock)
	eventually(t, "the replayed refusal", func() bool { return len(fl.got.all()) == 1 })
	fenced := a.bus.Publish(events.Event{Type: events.DiskFenced, Volume: "pvc-3", Device: "/dev/sdc", Serial: "4711", HolderKey: 0x42, HolderNode: "worker-3",
		Reason: "claim-lost", Message: "volume pvc-3: the reservation on /dev/sdc was lost"})
	taken := a.bus.Publish(events.Event{Type: events.TakeoverGranted, Volume: "pvc-4", Device: "/dev/sdd", HolderKey: 0x43, Reason: "takeover-granted",
		Message: "volume pvc-4: took disk /dev/sdd over from key(s) 0000000000000043 with the controller's grant"})
	a.bus.Publish(events.Event{Type: events.DiskReleased, Volume: "pvc-1", Reason: "unstaged", Message: "volume pvc-1: released"})
	back := a.bus.Publish(events.Event{Type: events.DiskClaimed, Volume: "pvc-5", Device: "/dev/sde", Reason: "reservation-reestablished",
		Message: "volume pvc-5: the storage target forgot every reservation on /dev/sde"})
	retaken := a.bus.Publish(events.Event{Type: events.DiskClaimed, Volume: "pvc-6", Device: "/dev/vdb", Reason: "lease-retaken",
		Message: "volume pvc-6: the host was down longer than the lease's fail bound"})
	a.bus.Publish(events.Event{Type: events.AgentStopping, Message: "stopping"})
	eventually(t, "five reports", func() bool { return len(fl.got.all()) == 5 })
	time.Sleep(50 * time.Millisecond)
	got := fl.got.all()
	if len(got) != 5 {
		t.Fatalf("reports %+v", got)
	}
	want := []struct {
		e           events.Event
		reason, typ string
	}{{refused, "DiskRefused", "Warning"}, {fenced, "DiskFenced", "Warning"}, {taken, "TakeoverGranted", "Warning"}, {back, "DiskClaimed", "Normal"}, {retaken, "DiskClaimed", "Normal"}}
	for i, w := range want {
		r := got[i]
		if r.Seq != w.e.Seq || r.Reason != w.reason || r.Type != w.typ || r.Volume != w.e.Volume || r.Device != w.e.Device ||
			r.HolderNode != w.e.HolderNode || r.HolderKey != w.e.HolderKeyString() || r.Serial != w.e.Serial || r.Message != w.e.Message ||
			!r.AgentStarted.Equal(a.started) || !r.Time.Equal(w.e.Time) {
			t.Errorf("report %d: %+v, want from %+v (%s, %s, agent started %v)", i, r, w.e, w.reason, w.typ, a.started)
		}
	}
}

// The stream breaks while the agent keeps running (the same process): the
// replay on reconnecting repeats what was read, and only the events
// published meanwhile are handed on, once.
func TestFollowerResumesWithoutDuplicates(t *testing.T) {
	sock := newAgentSocket(t)
	a := startAgent(t, sock, 256)
	fl := follow(t, sock)
	a.refuse("pvc-1")
	a.refuse("pvc-2")
	eventually(t, "two reports", func() bool { return len(fl.got.all()) == 2 })
	a.stop()
	a.refuse("pvc-3")
	a.refuse("pvc-4")
	a.serve()
	eventually(t, "four reports", func() bool { return len(fl.got.all()) == 4 })
	a.refuse("pvc-5")
	eventually(t, "five reports", func() bool { return len(fl.got.all()) == 5 })
	time.Sleep(50 * time.Millisecond)
	got := fl.got.all()
	if s := seqs(got); len(s) != 5 || s[0] != 2 || s[4] != 6 || got[2].Volume != "pvc-3" || got[3].Volume != "pvc-4" {
		t.Errorf("sequences %v (%+v); want 2..6 once each", s, got)
	}
	if fl.missedN() != 0 {
		t.Errorf("missed %d", fl.missedN())
	}
	if n := strings.Count(fl.log.String(), "following vco-agent's events"); n != 1 {
		t.Errorf("the same agent process announced %d times:\n%s", n, fl.log)
	}
}

// The agent restarts (upgrade): the new process numbers its events from 1
// again, and they are handed on although their numbers are lower.
func TestFollowerFollowsARestartedAgent(t *testing.T) {
	sock := newAgentSocket(t)
	a := startAgent(t, sock, 256)
	fl := follow(t, sock)
	for range 5 {
		a.refuse("pvc-1")
	}
	eventually(t, "five reports", func() bool { return len(fl.got.all()) == 5 })
	a.stop()
	b := startAgent(t, sock, 256)
	b.refuse("pvc-1")
	eventually(t, "the new process's refusal", func() bool { return len(fl.got.all()) == 6 })
	time.Sleep(50 * time.Millisecond)
	got := fl.got.all()
	if len(got) != 6 || got[5].Seq != 2 || !got[5].AgentStarted.Equal(b.started) {
		t.Errorf("reports %+v; want the new process's event 2 last", got)
	}
}

// Events that left the ring while the stream was down are counted as
// missed; those still in it are handed on.
func TestFollowerCountsMissedEvents(t *testing.T) {
	sock := newAgentSocket(t)
	a := startAgent(t, sock, 4)
	fl := follow(t, sock)
	a.refuse("pvc-0")
	eventually(t, "the first report", func() bool { return len(fl.got.all()) == 1 })
	a.stop()
	for range 10 {
		a.refuse("pvc-1") // sequences 3..12; the ring keeps 9..12
	}
	a.serve()
	eventually(t, "the ring's four", func() bool { return len(fl.got.all()) == 5 })
	if s := seqs(fl.got.all()); s[1] != 9 || s[4] != 12 {
		t.Errorf("sequences %v, want 2, 9..12", s)
	}
	if fl.missedN() != 6 {
		t.Errorf("missed %d, want 6 (3..8)", fl.missedN())
	}
	if !strings.Contains(fl.log.String(), "missed=6") {
		t.Errorf("log:\n%s", fl.log)
	}
}

// An agent that is not there yet is waited for, with one log line.
func TestFollowerWaitsForTheAgent(t *testing.T) {
	sock := newAgentSocket(t)
	fl := follow(t, sock)
	time.Sleep(300 * time.Millisecond) // several attempts at 10..50 ms
	a := startAgent(t, sock, 256)
	a.refuse("pvc-1")
	eventually(t, "the refusal", func() bool { return len(fl.got.all()) == 1 })
	if n := strings.Count(fl.log.String(), "event stream ended"); n != 1 {
		t.Errorf("the outage is logged %d times, want once:\n%s", n, fl.log)
	}
}

// The whole path with both ends restarting: the agent's events reach the
// (fake) API server once each, counted on one Event per report.
func TestAgentToKubernetes(t *testing.T) {
	sock := newAgentSocket(t)
	a := startAgent(t, sock, 256)
	r := newRig(t)
	plugin := func() context.CancelFunc {
		p, stop := r.poster(t, time.Millisecond)
		f := &Follower{Agent: dialAgent(t, sock), To: p, Retry: 10 * time.Millisecond}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { f.Run(ctx); close(done) }()
		return func() { cancel(); <-done; stop() }
	}
	stop := plugin()
	for range 3 {
		a.refuse("pvc-1")
	}
	a.bus.Publish(events.Event{Type: events.DiskFenced, Volume: "pvc-2", Device: "/dev/sdc", Reason: "claim-lost", Message: "volume pvc-2: lost"})
	counts := func() map[string]int32 {
		ev, _ := r.api.snapshot()
		out := map[string]int32{}
		for _, e := range ev {
			out[e.Reason] += e.Count
		}
		return out
	}
	eventually(t, "3 refusals and a fence", func() bool { c := counts(); return c["DiskRefused"] == 3 && c["DiskFenced"] == 1 })
	eventually(t, "the writes answered", func() bool { return r.res.get("created") == 2 })
	stop()
	stop = plugin() // the node plugin restarted: the ring is replayed
	eventually(t, "the replay reconciled", func() bool { return r.res.get("already_posted") == 4 })
	a.stop()
	b := startAgent(t, sock, 256) // and the agent
	_ = b.refuse("pvc-1")
	eventually(t, "4 refusals", func() bool { return counts()["DiskRefused"] == 4 })
	time.Sleep(50 * time.Millisecond)
	stop()
	ev, _ := r.api.snapshot()
	if c := counts(); len(ev) != 2 || c["DiskRefused"] != 4 || c["DiskFenced"] != 1 {
		t.Errorf("Events %v (%d objects); want one refusal counted 4 times and one fence", c, len(ev))
	}
	if r.res.get("created") != 2 {
		t.Errorf("created %d, want 2", r.res.get("created"))
	}
}
