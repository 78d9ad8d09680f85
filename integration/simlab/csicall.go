package simlab

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// nodeMethods are the CSI node and identity calls a guest can be asked to
// make, with their request and reply types.
var nodeMethods = map[string]struct {
	full      string
	req, resp func() proto.Message
}{
	"NodeGetInfo":         {"/csi.v1.Node/NodeGetInfo", func() proto.Message { return &csi.NodeGetInfoRequest{} }, func() proto.Message { return &csi.NodeGetInfoResponse{} }},
	"NodeGetCapabilities": {"/csi.v1.Node/NodeGetCapabilities", func() proto.Message { return &csi.NodeGetCapabilitiesRequest{} }, func() proto.Message { return &csi.NodeGetCapabilitiesResponse{} }},
	"NodeStageVolume":     {"/csi.v1.Node/NodeStageVolume", func() proto.Message { return &csi.NodeStageVolumeRequest{} }, func() proto.Message { return &csi.NodeStageVolumeResponse{} }},
	"NodeUnstageVolume":   {"/csi.v1.Node/NodeUnstageVolume", func() proto.Message { return &csi.NodeUnstageVolumeRequest{} }, func() proto.Message { return &csi.NodeUnstageVolumeResponse{} }},
	"NodePublishVolume":   {"/csi.v1.Node/NodePublishVolume", func() proto.Message { return &csi.NodePublishVolumeRequest{} }, func() proto.Message { return &csi.NodePublishVolumeResponse{} }},
	"NodeUnpublishVolume": {"/csi.v1.Node/NodeUnpublishVolume", func() proto.Message { return &csi.NodeUnpublishVolumeRequest{} }, func() proto.Message { return &csi.NodeUnpublishVolumeResponse{} }},
	"NodeExpandVolume":    {"/csi.v1.Node/NodeExpandVolume", func() proto.Message { return &csi.NodeExpandVolumeRequest{} }, func() proto.Message { return &csi.NodeExpandVolumeResponse{} }},
	"NodeGetVolumeStats":  {"/csi.v1.Node/NodeGetVolumeStats", func() proto.Message { return &csi.NodeGetVolumeStatsRequest{} }, func() proto.Message { return &csi.NodeGetVolumeStatsResponse{} }},
	"NodeGetVolumeHealth": {"/csi.v1.Node/NodeGetVolumeHealth", func() proto.Message { return &csi.NodeGetVolumeHealthRequest{} }, func() proto.Message { return &csi.NodeGetVolumeHealthResponse{} }},
	"Probe":               {"/csi.v1.Identity/Probe", func() proto.Message { return &csi.ProbeRequest{} }, func() proto.Message { return &csi.ProbeResponse{} }},
}

// CallReply is what `vco-lab csi-call` prints: the reply, or the gRPC
// status of the failure.
type CallReply struct {
	OK      bool            `json:"ok"`
	Reply   json.RawMessage `json:"reply,omitempty"`
	Code    string          `json:"code,omitempty"`
	Message string          `json:"message,omitempty"`
}

// CallLocal sends one CSI request, given as protojson, to the plugin at
// endpoint (unix:///path) and returns the reply to print. An error means
// the call could not be made at all.
func CallLocal(ctx context.Context, endpoint, method, reqJSON string) (*CallReply, error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return invoke(ctx, conn, method, reqJSON)
}

// invoke makes one call on conn and returns the reply to print.
func invoke(ctx context.Context, conn *grpc.ClientConn, method, reqJSON string) (*CallReply, error) {
	m, ok := nodeMethods[method]
	if !ok {
		var names []string
		for n := range nodeMethods {
			names = append(names, n)
		}
		return nil, fmt.Errorf("unknown CSI method %q; known: %s", method, strings.Join(names, ", "))
	}
	req, resp := m.req(), m.resp()
	if err := protojson.Unmarshal([]byte(reqJSON), req); err != nil {
		return nil, fmt.Errorf("%s request: %w", method, err)
	}
	if err := conn.Invoke(ctx, m.full, req, resp); err != nil {
		// The plugin's own refusals and a plugin that does not answer
		// (UNAVAILABLE, "connection error") both come back as a status.
		st, _ := status.FromError(err)
		return &CallReply{Code: st.Code().String(), Message: st.Message()}, nil
	}
	b, err := protojson.Marshal(resp)
	if err != nil {
		return nil, err
	}
	return &CallReply{OK: true, Reply: b}, nil
}

// NodeCall makes a CSI node call in guest g, through `vco-lab csi-call` over
// the exec channel, as the kubelet on that node would. A refusal comes back
// as a gRPC status error with the plugin's code and message.
func NodeCall(ctx context.Context, g *lab.Guest, method string, req, resp proto.Message) error {
	b, err := protojson.Marshal(req)
	if err != nil {
		return err
	}
	r, err := g.Exec().Run(ctx, 5*time.Minute, "/bin/vco-lab", "csi-call", "-endpoint", "unix://"+CSISocket, method, string(b))
	return reply(g, method, r, err, resp)
}

// reply turns what a guest's call printed into resp or the call's status.
func reply(g *lab.Guest, method string, r *guestexec.Result, err error, resp proto.Message) error {
	if err != nil {
		return fmt.Errorf("%s on %s: %w", method, g.Name, err)
	}
	if r.Exit != 0 {
		return fmt.Errorf("%s on %s: csi-call failed: %s", method, g.Name, r)
	}
	var rep CallReply
	if err := json.Unmarshal([]byte(r.Stdout), &rep); err != nil {
		return fmt.Errorf("%s on %s: csi-call printed %q: %w", method, g.Name, r.Stdout, err)
	}
	if !rep.OK {
		code := codes.Unknown
		for c := codes.OK; c <= codes.Unauthenticated; c++ {
			if c.String() == rep.Code {
				code = c
			}
		}
		return status.Error(code, rep.Message)
	}
	if resp != nil {
		if err := protojson.Unmarshal(rep.Reply, resp); err != nil {
			return fmt.Errorf("%s on %s: reply: %w", method, g.Name, err)
		}
	}
	return nil
}

// KubeletCall is NodeCall retried as the kubelet retries a call answered
// ABORTED: the plugin says another operation on the volume (or the
// agent's periodic claim check) is in progress and the call must wait.
// It tries every 200 ms for up to a minute, then returns the last answer.
func KubeletCall(ctx context.Context, g *lab.Guest, method string, req, resp proto.Message) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := NodeCall(ctx, g, method, req, resp)
		if status.Code(err) != codes.Aborted || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// CallerDir is where a guest's standing caller (StartCaller) takes its
// calls: a request written into its "in" pipe, the reply read from "out".
const CallerDir = "/run/csi-caller"

// StartCaller starts a standing `vco-lab csi-call -serve` in guest g,
// connected to the plugin once. A call through it (CallerCall) costs the
// guest a shell and no Go program start, nearer to the kubelet's call on
// a connection it keeps than NodeCall is; the attach bench makes its
// stages that way. One caller serves one call at a time.
func StartCaller(ctx context.Context, g *lab.Guest) error {
	start := fmt.Sprintf("( /bin/vco-lab csi-call -endpoint unix://%s -serve %s >>/var/log/csi-caller.log 2>&1 & )", CSISocket, CallerDir)
	if _, err := g.MustSh(ctx, start); err != nil {
		return err
	}
	var info csi.NodeGetInfoResponse
	deadline := time.Now().Add(time.Minute)
	for {
		_, err := g.MustSh(ctx, "test -p "+CallerDir+"/out")
		if err == nil {
			return CallerCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &info)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: the standing CSI caller did not start: %w", g.Name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// CallerCall is NodeCall through the caller StartCaller started.
func CallerCall(ctx context.Context, g *lab.Guest, method string, req, resp proto.Message) error {
	b, err := protojson.Marshal(req)
	if err != nil {
		return err
	}
	r, err := g.Exec().Run(ctx, 5*time.Minute, "/bin/sh", "-c", `printf '%s %s\n' "$1" "$2" >`+CallerDir+`/in && cat `+CallerDir+`/out`, "call", method, string(b))
	return reply(g, method, r, err, resp)
}

// ServeCalls is the guest's standing caller: it makes the pipes in dir and
// answers each request line ("METHOD JSON") written into dir/in with its
// reply line on dir/out, on one connection to the plugin at endpoint,
// until ctx ends.
func ServeCalls(ctx context.Context, endpoint, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	for _, n := range []string{"in", "out"} {
		p := filepath.Join(dir, n)
		_ = os.Remove(p)
		if err := unix.Mkfifo(p, 0o600); err != nil {
			return fmt.Errorf("making %s: %w", p, err)
		}
	}
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.Connect()
	for ctx.Err() == nil {
		line, err := os.ReadFile(filepath.Join(dir, "in"))
		if err != nil {
			return err
		}
		method, reqJSON, _ := strings.Cut(strings.TrimSpace(string(line)), " ")
		if method == "" {
			continue
		}
		rep, err := invoke(ctx, conn, method, reqJSON)
		if err != nil {
			rep = &CallReply{Code: codes.InvalidArgument.String(), Message: err.Error()}
		}
		b, _ := json.Marshal(rep)
		if err := os.WriteFile(filepath.Join(dir, "out"), append(b, '\n'), 0); err != nil {
			return err
		}
	}
	return ctx.Err()
}
