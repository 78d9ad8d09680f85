// Package health serves the plugin's HTTP /healthz for the kubelet's
// liveness probe, the job the livenessprobe sidecar does in other CSI
// drivers: each request calls the driver's CSI Probe over its own socket,
// so a plugin whose socket is gone or whose gRPC server is stuck fails
// too, and any extra checks (the node's registration with the kubelet).
// See docs/csi-addon.md, "Node registration and health".
package health

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// Path is where the handler is served.
const Path = "/healthz"

// MaxWait bounds one check, whatever the prober's own timeout.
const MaxWait = 15 * time.Second

// Check is a further condition of health; its error is the reason.
type Check func(context.Context) error

// Handler answers the liveness probe.
type Handler struct {
	conn   *grpc.ClientConn
	id     csi.IdentityClient
	checks []Check
	log    *slog.Logger

	mu      sync.Mutex
	failing string // the last failure's reason, "" while healthy
}

// New dials the CSI endpoint (unix:///path or tcp://host:port, as the
// plugin's --endpoint) lazily; nothing is connected until the first probe.
func New(endpoint string, log *slog.Logger, checks ...Check) (*Handler, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("health: endpoint %q: %w", endpoint, err)
	}
	var target string
	switch u.Scheme {
	case "unix":
		p := u.Path
		if p == "" {
			p = u.Opaque
		}
		target = "unix://" + p
	case "tcp":
		target = "passthrough:///" + u.Host
	default:
		return nil, fmt.Errorf("health: endpoint %q: use unix:///path/to/csi.sock", endpoint)
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("health: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Handler{conn: conn, id: csi.NewIdentityClient(conn), checks: checks, log: log}, nil
}

// Close drops the connection to the plugin.
func (h *Handler) Close() error { return h.conn.Close() }

// Check runs the probe and the extra checks once.
func (h *Handler) Check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, MaxWait)
	defer cancel()
	// Without WaitForReady: a missing socket fails at once, naming it.
	r, err := h.id.Probe(ctx, &csi.ProbeRequest{})
	switch {
	case err != nil:
		return fmt.Errorf("CSI Probe failed: %s", status.Convert(err).Message())
	case r.GetReady() != nil && !r.GetReady().GetValue():
		// An absent ready field means ready (CSI spec).
		return errors.New("CSI Probe answered: not ready")
	}
	for _, c := range h.checks {
		if err := c(ctx); err != nil {
			return err
		}
	}
	return nil
}

// ServeHTTP answers 200 "ok" when healthy and 503 with the reason when
// not. The kubelet's probe event shows only the status code, so the
// plugin's log says why, once each time health changes.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "use GET", http.StatusMethodNotAllowed)
		return
	}
	err := h.Check(r.Context())
	h.mu.Lock()
	switch {
	case err != nil && h.failing != err.Error():
		h.log.Warn("health check failing; the kubelet restarts the container if it keeps failing", "reason", err.Error())
		h.failing = err.Error()
	case err == nil && h.failing != "":
		h.log.Info("health check passing again", "was", h.failing)
		h.failing = ""
	}
	h.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, err.Error())
		return
	}
	fmt.Fprintln(w, "ok")
}

// Listen opens the HTTP endpoint (host:port, ":9808" for every address of
// the pod) so a taken port fails the start, not later.
func Listen(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("health endpoint --http-endpoint=%s: %w", addr, err)
	}
	return ln, nil
}

// Serve serves mux on ln until ctx ends.
func Serve(ctx context.Context, ln net.Listener, mux http.Handler) error {
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
