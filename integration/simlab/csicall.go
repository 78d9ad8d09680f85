package simlab

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

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
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
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
