// Package registration announces the node plugin to the kubelet through
// the kubelet's plugin-registration API (k8s.io/kubelet's
// pluginregistration/v1), the job node-driver-registrar does in other CSI
// drivers: a gRPC socket in the kubelet's plugins_registry directory that
// names the driver and the host path of its CSI socket. The kubelet finds
// the socket, calls GetInfo, checks the CSI socket (NodeGetInfo) and
// reports the outcome with NotifyRegistrationStatus. See
// docs/csi-addon.md, "Node registration and health".
package registration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	regv1 "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// SupportedVersions are the CSI versions the kubelet is told the plugin
// speaks. The kubelet only looks at the major version (1.x drivers are
// compatible with each other), so 1.0.0 stands for the CSI 1.x spec the
// driver implements.
var SupportedVersions = []string{"1.0.0"}

// Config says what the kubelet is told and where.
type Config struct {
	// DriverName is the CSI driver's name (= the CSIDriver object's).
	DriverName string
	// Endpoint is the CSI socket's path as the kubelet sees it, on the
	// host (/var/lib/kubelet/plugins/<driver>/csi.sock), not as the
	// plugin's container mounts it.
	Endpoint string
	// Dir is the kubelet's plugins_registry directory, or a directory in
	// it (the kubelet watches those too), as this process sees it; the
	// socket is <Dir>/<DriverName>-reg.sock.
	Dir string
	Log *slog.Logger
}

// Server serves the registration socket and remembers what the kubelet
// last said about it.
type Server struct {
	cfg  Config
	path string
	ino  uint64
	srv  *grpc.Server
	done chan struct{}

	mu       sync.Mutex
	notified bool  // the kubelet has called NotifyRegistrationStatus
	failure  error // its last report, when it refused the plugin

	regv1.UnimplementedRegistrationServer
}

// Start listens on the registration socket, replacing a stale one left by
// an earlier run, and serves it until Stop.
func Start(cfg Config) (*Server, error) {
	switch {
	case cfg.DriverName == "":
		return nil, errors.New("plugin registration: no driver name")
	case !filepath.IsAbs(cfg.Endpoint):
		return nil, fmt.Errorf("plugin registration: the CSI endpoint the kubelet is to dial, %q, is not an absolute host path; set --kubelet-registration-path", cfg.Endpoint)
	case cfg.Dir == "":
		return nil, errors.New("plugin registration: no registration directory")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if st, err := os.Stat(cfg.Dir); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("plugin registration: the kubelet's registration directory %s is not there (%v); mount the host's /var/lib/kubelet/plugins_registry, or a directory of the plugin's own in it, there", cfg.Dir, err)
	}
	s := &Server{cfg: cfg, path: filepath.Join(cfg.Dir, cfg.DriverName+"-reg.sock"), done: make(chan struct{})}
	if err := os.Remove(s.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("plugin registration: removing the stale socket %s: %w", s.path, err)
	}
	ln, err := net.Listen("unix", s.path)
	if err != nil {
		return nil, fmt.Errorf("plugin registration: %w", err)
	}
	// The socket is removed by Stop, and only while it is still ours.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ino, err := inode(s.path)
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("plugin registration: %w", err)
	}
	s.ino = ino
	s.srv = grpc.NewServer()
	regv1.RegisterRegistrationServer(s.srv, s)
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil {
			cfg.Log.Error("plugin registration socket stopped serving", "socket", s.path, "error", err)
		}
	}()
	cfg.Log.Info("waiting for the kubelet to register the plugin", "socket", s.path, "driver", cfg.DriverName, "endpoint", cfg.Endpoint)
	return s, nil
}

// SocketPath is where the registration socket is.
func (s *Server) SocketPath() string { return s.path }

// Stop stops serving and removes the socket, so the kubelet deregisters
// the plugin until a new one registers. A socket that is no longer ours
// (a newer plugin's) is left alone.
func (s *Server) Stop() {
	s.srv.Stop()
	<-s.done
	if ino, err := inode(s.path); err == nil && ino == s.ino {
		os.Remove(s.path)
	}
}

// GetInfo tells the kubelet which driver this is and where its CSI socket
// is on the host.
func (s *Server) GetInfo(context.Context, *regv1.InfoRequest) (*regv1.PluginInfo, error) {
	s.cfg.Log.Info("the kubelet asked for the plugin's registration info", "driver", s.cfg.DriverName, "endpoint", s.cfg.Endpoint)
	return &regv1.PluginInfo{
		Type:              regv1.CSIPlugin,
		Name:              s.cfg.DriverName,
		Endpoint:          s.cfg.Endpoint,
		SupportedVersions: SupportedVersions,
	}, nil
}

// NotifyRegistrationStatus records the kubelet's verdict. A refusal is
// logged with the kubelet's reason and reported by Check, which fails the
// health endpoint until the kubelet accepts a later attempt (it retries
// by itself); after failureThreshold probes the container is restarted.
func (s *Server) NotifyRegistrationStatus(_ context.Context, st *regv1.RegistrationStatus) (*regv1.RegistrationStatusResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.notified = true
	if st.GetPluginRegistered() {
		s.failure = nil
		s.cfg.Log.Info("the kubelet registered the plugin", "driver", s.cfg.DriverName, "endpoint", s.cfg.Endpoint)
	} else {
		s.failure = fmt.Errorf("the kubelet refused to register driver %s with CSI socket %s: %s", s.cfg.DriverName, s.cfg.Endpoint, st.GetError())
		s.cfg.Log.Error("the kubelet refused to register the plugin; check that the CSI socket's host path is right and the plugin answers NodeGetInfo",
			"driver", s.cfg.DriverName, "endpoint", s.cfg.Endpoint, "kubelet_error", st.GetError())
	}
	return &regv1.RegistrationStatusResponse{}, nil
}

// Registered says whether the kubelet's last word was that the plugin is
// registered.
func (s *Server) Registered() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.notified && s.failure == nil
}

// Check reports what keeps the kubelet from using the plugin: the
// kubelet's refusal, or the registration socket gone or replaced (the
// kubelet would never call again; a restart makes a new one). Not being
// registered yet is no failure: the kubelet may not have looked yet.
func (s *Server) Check(context.Context) error {
	ino, err := inode(s.path)
	switch {
	case err != nil:
		return fmt.Errorf("the plugin registration socket %s is gone (%v); the kubelet cannot find the plugin", s.path, err)
	case ino != s.ino:
		return fmt.Errorf("the plugin registration socket %s was replaced by another process", s.path)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failure
}

func inode(p string) (uint64, error) {
	fi, err := os.Lstat(p)
	if err != nil {
		return 0, err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return 0, fmt.Errorf("%s is not a socket", p)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, fmt.Errorf("%s: no inode number", p)
	}
	return st.Ino, nil
}
