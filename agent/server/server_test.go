package server

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/fencecaps"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// TestMain doubles as an API caller running as another user: it drops to
// the uid/gid/groups it is given, calls GetIdentity, and prints the code.
func TestMain(m *testing.M) {
	if sock := os.Getenv("VCO_API_CHILD_SOCKET"); sock != "" {
		var groups []int
		for _, g := range strings.Fields(os.Getenv("VCO_API_CHILD_GROUPS")) {
			n, _ := strconv.Atoi(g)
			groups = append(groups, n)
		}
		gid, _ := strconv.Atoi(os.Getenv("VCO_API_CHILD_GID"))
		if err := syscall.Setgroups(groups); err != nil {
			fmt.Println("setgroups:", err)
			os.Exit(3)
		}
		if err := syscall.Setgid(gid); err != nil {
			fmt.Println("setgid:", err)
			os.Exit(3)
		}
		if err := syscall.Setuid(65534); err != nil {
			fmt.Println("setuid:", err)
			os.Exit(3)
		}
		c, err := client.Dial(sock)
		if err != nil {
			fmt.Println("dial:", err)
			os.Exit(3)
		}
		_, err = c.GetIdentity(context.Background(), &api.GetIdentityRequest{})
		fmt.Printf("uid=%d code=%s msg=%s\n", os.Getuid(), status.Code(err), status.Convert(err).Message())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type fixture struct {
	sock string
	bus  *events.Bus
	logs *bytes.Buffer
	c    *client.Client
}

// serve runs the service on a real unix socket in a world-searchable temp
// dir with a world-writable socket, so that only the peer check stands
// between another user and the API.
func serve(t *testing.T, policy peercred.Policy) *fixture {
	t.Helper()
	dir, err := os.MkdirTemp("", "vco-api-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	_ = os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(sock, 0o666)
	logs := &bytes.Buffer{}
	bus := events.NewBus(8, 8, nil)
	s := New(Options{
		Version: "1.2.3-test", Bus: bus, Policy: policy,
		Log: slog.New(slog.NewTextHandler(logs, nil)),
		Identity: NodeIdentity{SystemUUID: "4c4c4544-0042-3510-8052-b4c04f4e4d32", NodeName: "node-a", Location: "ch-lug-1",
			Source: "sysfs", Fencing: func() []fencecaps.Capability {
				return []fencecaps.Capability{{Method: fence.MethodPR, Available: true, Detail: "SG_IO-capable SCSI disks: sdb"}}
			}},
		Runtime: Runtime{SocketPath: sock},
	})
	g := s.NewGRPC()
	go g.Serve(l)
	t.Cleanup(func() { bus.Close(); g.Stop() })
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &fixture{sock: sock, bus: bus, logs: logs, c: c}
}

func TestRootGetsIdentityAndStatus(t *testing.T) {
	hosttest.NeedRoot(t, "runs as root to be the allowed caller")
	f := serve(t, peercred.Policy{GID: -1})
	ctx := context.Background()
	id, err := f.c.GetIdentity(ctx, &api.GetIdentityRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if id.SystemUuid != "4c4c4544-0042-3510-8052-b4c04f4e4d32" || id.NodeName != "node-a" || id.Location != "ch-lug-1" ||
		id.AgentVersion != "1.2.3-test" || len(id.Fencing) != 1 || id.Fencing[0].Method != api.FencingMethod_FENCING_METHOD_SCSI3_PR || !id.Fencing[0].Available {
		t.Fatalf("identity %+v", id)
	}
	f.bus.Publish(events.Event{Type: events.DiskClaimed})
	st, err := f.c.GetStatus(ctx, &api.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.EventsPublished != 1 || st.EventsRecent != 1 || st.EventsRingCapacity != 8 || st.NodeName != "node-a" || st.SocketPath != f.sock || st.Uptime.AsDuration() < 0 {
		t.Fatalf("status %+v", st)
	}
}

func runCaller(t *testing.T, sock string, gid int, groups string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "VCO_API_CHILD_SOCKET="+sock, "VCO_API_CHILD_GID="+strconv.Itoa(gid), "VCO_API_CHILD_GROUPS="+groups)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("caller: %v\n%s", err, out)
	}
	return string(out)
}

func TestOtherUIDRefusedAndGroupMembersAdmitted(t *testing.T) {
	hosttest.NeedRoot(t, "needs root to start callers as another user")
	const group = 4242 // not a gid the caller has unless given
	f := serve(t, peercred.Policy{GID: group, GroupName: "vco-test"})

	out := runCaller(t, f.sock, 65534, "")
	if !strings.Contains(out, "uid=65534 code=PermissionDenied") {
		t.Fatalf("nobody was not refused: %s", out)
	}
	if !strings.Contains(out, "neither root nor a member of group vco-test (gid 4242)") {
		t.Errorf("refusal does not say why: %s", out)
	}
	logs := f.logs.String()
	if !strings.Contains(logs, "API call refused") || !strings.Contains(logs, "uid=65534") || !strings.Contains(logs, "/vco.agent.v1.Agent/GetIdentity") {
		t.Errorf("no log line for the refusal: %s", logs)
	}

	if out := runCaller(t, f.sock, 65534, strconv.Itoa(group)); !strings.Contains(out, "uid=65534 code=OK") {
		t.Errorf("member by supplementary group refused: %s", out)
	}
	if out := runCaller(t, f.sock, group, ""); !strings.Contains(out, "uid=65534 code=OK") {
		t.Errorf("member by primary gid refused: %s", out)
	}
}

func TestWatchEventsReplayThenLive(t *testing.T) {
	hosttest.NeedRoot(t, "runs as root to be the allowed caller")
	f := serve(t, peercred.Policy{GID: -1})
	f.bus.Publish(events.Event{Type: events.DiskClaimed, Volume: "v1"})
	f.bus.Publish(events.Event{Type: events.DiskReleased, Volume: "v1"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := f.c.WatchEvents(ctx, &api.WatchEventsRequest{ReplayRecent: true})
	if err != nil {
		t.Fatal(err)
	}
	recvReplayed(t, stream, api.EventType_EVENT_TYPE_DISK_CLAIMED, api.EventType_EVENT_TYPE_DISK_RELEASED)
	// The subscription is registered before the replay is sent.
	f.bus.Publish(events.Event{Type: events.DiskRefused, Volume: "v2", Device: "/dev/sdc", HolderKey: 0x5643000000000abc, HolderNode: "node-b", Reason: "held-elsewhere", Message: "held by node-b"})
	recvLiveRefusal(t, stream)
	recent, err := f.c.ListRecentEvents(ctx, &api.ListRecentEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(recent.Events) != 3 || recent.Events[0].Sequence != 1 || recent.Events[2].HolderNode != "node-b" {
		t.Fatalf("recent events %+v", recent.Events)
	}
	// Stopping the bus (agent shutdown) ends the stream cleanly.
	f.bus.Close()
	if _, err := stream.Recv(); err == nil {
		t.Fatal("stream still open after the bus closed")
	}
}

// recvReplayed receives the replayed events of the types want, numbered
// from 1.
func recvReplayed(t *testing.T, stream grpc.ServerStreamingClient[api.Event], want ...api.EventType) {
	t.Helper()
	for i, want := range want {
		e, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if e.Type != want || !e.Replayed || e.Sequence != uint64(i+1) {
			t.Fatalf("replayed event %d: %+v", i, e)
		}
	}
}

// recvLiveRefusal receives the live (not replayed) third event, a refusal
// of v2 on /dev/sdc held by node-b, with every field as published.
func recvLiveRefusal(t *testing.T, stream grpc.ServerStreamingClient[api.Event]) {
	t.Helper()
	e, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if e.Type != api.EventType_EVENT_TYPE_DISK_REFUSED || e.Replayed || e.Sequence != 3 || e.Volume != "v2" || e.Device != "/dev/sdc" ||
		e.HolderKey != "5643000000000abc" || e.HolderNode != "node-b" || e.Reason != "held-elsewhere" || e.Message != "held by node-b" {
		t.Fatalf("live event %+v", e)
	}
}

func TestEventTypeNumbersMatchAPI(t *testing.T) {
	for _, ty := range events.Types {
		name := api.EventType(ty).String()
		want := "EVENT_TYPE_" + strings.ToUpper(camelToSnake(ty.String()))
		if name != want {
			t.Errorf("events.%s is %s in the API, want %s", ty, name, want)
		}
	}
}

func camelToSnake(s string) string {
	var b strings.Builder
	for i, r := range s {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return b.String()
}

func TestDialExplainsAgentNotRunning(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	_, err := client.Dial(sock)
	if err == nil || !strings.Contains(err.Error(), "vco-agent is not running: there is no socket at "+sock) || !strings.Contains(err.Error(), "systemctl status vco-agent.socket") {
		t.Fatalf("got %v", err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	_, err = client.Dial(sock)
	if err == nil || !strings.Contains(err.Error(), "nothing is listening on "+sock) {
		t.Fatalf("stale socket: %v", err)
	}
}

// A stream reader that stops reading must not hold up the bus: its
// events are dropped and counted, and it is told how many it missed.
func TestStalledStreamDoesNotBlockBus(t *testing.T) {
	hosttest.NeedRoot(t, "runs as root to be the allowed caller")
	f := serve(t, peercred.Policy{GID: -1})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream, err := f.c.WatchEvents(ctx, &api.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for f.bus.Stats().Subscribers == 0 {
		time.Sleep(time.Millisecond)
	}
	// Far more than the subscriber buffer (8) plus what gRPC's flow-control
	// windows absorb; each event carries a 1 KiB message.
	msg := strings.Repeat("x", 1024)
	done := make(chan struct{})
	go func() {
		for i := 0; i < 20000; i++ {
			f.bus.Publish(events.Event{Type: events.DiskClaimed, Message: msg})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("Publish blocked behind a stream nobody reads")
	}
	st, err := f.c.GetStatus(ctx, &api.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.EventsDropped == 0 {
		t.Fatal("no drops counted for a stalled reader")
	}
	// Read what was queued, then publish one more event: it arrives
	// carrying the count of everything missed since the last delivery.
	type recv struct {
		e   *api.Event
		err error
	}
	in := make(chan recv, 64)
	go func() {
		for {
			e, err := stream.Recv()
			in <- recv{e, err}
			if err != nil {
				return
			}
		}
	}()
	var got, missed, last uint64
	marker := false
	for {
		select {
		case r := <-in:
			if r.err != nil {
				t.Fatalf("after %d received and %d missed: %v", got, missed, r.err)
			}
			e := r.e
			got++
			missed += e.MissedBefore
			if e.Sequence != last+1+e.MissedBefore {
				t.Fatalf("sequence %d after %d with %d reported missed", e.Sequence, last, e.MissedBefore)
			}
			last = e.Sequence
		case <-time.After(300 * time.Millisecond):
			if marker {
				t.Fatalf("marker event never arrived; got %d, missed %d, last seq %d", got, missed, last)
			}
			f.bus.Publish(events.Event{Type: events.DiskReleased})
			marker = true
			continue
		}
		if last == 20001 {
			break
		}
	}
	if got+missed != 20001 {
		t.Fatalf("received %d + missed %d != 20001 published", got, missed)
	}
	if missed == 0 || missed != st.EventsDropped {
		t.Fatalf("reader told of %d missed events, status counts %d dropped", missed, st.EventsDropped)
	}
}
