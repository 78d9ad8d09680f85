package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Listen opens a CSI endpoint: unix:///path (a stale socket is removed) or
// tcp://127.0.0.1:port for tests.
func Listen(endpoint string) (net.Listener, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	switch u.Scheme {
	case "unix":
		p := u.Path
		if p == "" {
			p = u.Opaque
		}
		if p == "" {
			return nil, fmt.Errorf("endpoint %q names no socket path", endpoint)
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			return nil, err
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("removing stale socket %s: %w", p, err)
		}
		return net.Listen("unix", p)
	case "tcp":
		return net.Listen("tcp", u.Host)
	}
	return nil, fmt.Errorf("endpoint %q: use unix:///path/to/csi.sock", endpoint)
}

// NewGRPCServer registers the services of the driver's mode on a gRPC
// server whose every error goes through CodeForError. Requests are logged
// with secrets stripped. The outer interceptors (metrics) run first and
// see the code the caller gets.
func (d *Driver) NewGRPCServer(log *slog.Logger, outer ...grpc.UnaryServerInterceptor) *grpc.Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	logging := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		method := info.FullMethod[strings.LastIndexByte(info.FullMethod, '/')+1:]
		if err != nil {
			log.Warn("CSI call failed", "method", method, "code", status.Code(err).String(), "error", status.Convert(err).Message(),
				"request", protosanitizer.StripSecrets(req).String())
		} else if method != "Probe" && method != "NodeGetCapabilities" && method != "GetPluginInfo" {
			log.Info("CSI call", "method", method, "request", protosanitizer.StripSecrets(req).String())
		}
		return resp, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(append(outer, logging, StatusInterceptor)...))
	csi.RegisterIdentityServer(srv, d)
	if d.controller() {
		csi.RegisterControllerServer(srv, d)
	}
	if d.node() {
		csi.RegisterNodeServer(srv, d)
	}
	return srv
}
