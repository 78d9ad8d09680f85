// Package sanitytargets moves csi-sanity's publish targets to the shape
// the kubelet gives them. csi-sanity publishes a filesystem volume at
// <TargetPath>/target and <TargetPath>/other_target, which no kubelet
// does; the agent publishes only at the kubelet's
// pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount (package
// kubeletpath, docs/security.md). Both csi-sanity tiers put this between
// csi-sanity and the plugin: the in-process suite as a client interceptor,
// the csi-sanity binary tier as a proxy on its own socket. Raw block
// targets, <TargetPath>/<name> with TargetPath a kubelet
// volumeDevices/publish/<pv> directory, have the kubelet's shape already.
// Imported by tests only.
package sanitytargets

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// PV is the volume name of every moved target.
const PV = "sanity"

// Targets moves csi-sanity's targets in Dir to the kubelet's shape under
// Kubelet: <Dir>/<name> becomes <Kubelet>/pods/<name>/volumes/kubernetes.io~csi/sanity/mount,
// a pod named after csi-sanity's target. Any other path is left as it is.
type Targets struct{ Kubelet, Dir string }

// Path is where p, a path csi-sanity names, is moved.
func (t Targets) Path(p string) string {
	if p == "" || filepath.Dir(p) != filepath.Clean(t.Dir) {
		return p
	}
	return kubeletpath.Target(t.Kubelet, filepath.Base(p), PV)
}

// Kind says what is at p, moved (Path): "file", "directory", "not_found"
// or "other", as csi-sanity checks a target after a publish and an
// unpublish.
func (t Targets) Kind(p string) (string, error) {
	fi, err := os.Stat(t.Path(p))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "not_found", nil
	case err != nil:
		return "", err
	case fi.Mode().IsRegular():
		return "file", nil
	case fi.IsDir():
		return "directory", nil
	}
	return "other", nil
}

// CheckScript is Kind as a shell script taking the path as its argument,
// for the csi-sanity binary's --csi.checkpathcmd.
func (t Targets) CheckScript() string {
	dir := filepath.Clean(t.Dir)
	return fmt.Sprintf(`#!/bin/sh
p="$1"
case "${p#%[1]s/}" in
"$p"|*/*|"") ;;
*) p=%[2]s/pods/"${p#%[1]s/}"/volumes/kubernetes.io~csi/%[3]s/mount ;;
esac
if [ -f "$p" ]; then echo file; elif [ -d "$p" ]; then echo directory; elif [ -e "$p" ]; then echo other; else echo not_found; fi
`, dir, filepath.Clean(t.Kubelet), PV)
}

// Request returns req with its target or volume path moved (a copy), or
// req itself when it names none.
func (t Targets) Request(req any) any {
	m, ok := req.(proto.Message)
	if !ok {
		return req
	}
	switch r := proto.Clone(m).(type) {
	case *csi.NodePublishVolumeRequest:
		r.TargetPath = t.Path(r.TargetPath)
		return r
	case *csi.NodeUnpublishVolumeRequest:
		r.TargetPath = t.Path(r.TargetPath)
		return r
	case *csi.NodeGetVolumeStatsRequest:
		r.VolumePath = t.Path(r.VolumePath)
		return r
	case *csi.NodeExpandVolumeRequest:
		r.VolumePath = t.Path(r.VolumePath)
		return r
	}
	return req
}

// Interceptor is a client interceptor that moves the targets of the
// requests it passes on.
func (t Targets) Interceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(ctx, method, t.Request(req), reply, cc, opts...)
	}
}

// messages are the requests that name a target, by method.
var messages = map[string]func() proto.Message{
	"/csi.v1.Node/NodePublishVolume":   func() proto.Message { return &csi.NodePublishVolumeRequest{} },
	"/csi.v1.Node/NodeUnpublishVolume": func() proto.Message { return &csi.NodeUnpublishVolumeRequest{} },
	"/csi.v1.Node/NodeGetVolumeStats":  func() proto.Message { return &csi.NodeGetVolumeStatsRequest{} },
	"/csi.v1.Node/NodeExpandVolume":    func() proto.Message { return &csi.NodeExpandVolumeRequest{} },
}

// raw passes messages through as their wire bytes.
type raw struct{}

func (raw) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, errors.New("sanitytargets: not raw bytes")
	}
	return *b, nil
}

func (raw) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return errors.New("sanitytargets: not raw bytes")
	}
	*b = append([]byte(nil), data...)
	return nil
}

func (raw) Name() string { return "proto" }

// Proxy serves every unary call on ln by passing it to the CSI endpoint
// backend (unix:///path), the targets moved; it stops when ln is closed.
func (t Targets) Proxy(ln net.Listener, backend string) (stop func(), err error) {
	conn, err := grpc.NewClient(backend, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(raw{}), grpc.UnknownServiceHandler(t.pass(conn)))
	go srv.Serve(ln)
	return func() { srv.Stop(); conn.Close() }, nil
}

func (t Targets) pass(conn *grpc.ClientConn) grpc.StreamHandler {
	return func(_ any, ss grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(ss)
		var in []byte
		if err := ss.RecvMsg(&in); err != nil {
			return err
		}
		if newMsg, ok := messages[method]; ok {
			m := newMsg()
			if err := proto.Unmarshal(in, m); err != nil {
				return err
			}
			b, err := proto.Marshal(t.Request(m).(proto.Message))
			if err != nil {
				return err
			}
			in = b
		}
		md, _ := metadata.FromIncomingContext(ss.Context())
		var out []byte
		if err := conn.Invoke(metadata.NewOutgoingContext(ss.Context(), md), method, &in, &out, grpc.ForceCodec(raw{})); err != nil {
			return err
		}
		return ss.SendMsg(&out)
	}
}
