package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/drivername"
	"github.com/whitesky-cloud/vco-storage/csi/health"
	"github.com/whitesky-cloud/vco-storage/csi/kubeevents"
	"github.com/whitesky-cloud/vco-storage/csi/metrics"
	"github.com/whitesky-cloud/vco-storage/csi/registration"
	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
)

// runPlugin serves the CSI services of the chosen mode.
func runPlugin(args []string) int {
	f, err := parsePluginFlags(args)
	if err != nil {
		return 2
	}
	if err := f.run(slog.New(slog.NewTextHandler(os.Stderr, nil))); err != nil {
		fmt.Fprintf(os.Stderr, "vco-csi: %v\n", err)
		return 1
	}
	return 0
}

// pluginFlags are the plugin's command line.
type pluginFlags struct {
	mode            string
	endpoint        string
	name            string
	apiURL          string
	portalURL       string
	customer        string
	cloudspace      string
	tokenFile       string
	caFile          string
	defLoc          string
	attachWait      time.Duration
	agentSock       string
	kubelet         string
	allowUnfenced   bool
	loopDir         string
	vaultAddr       string
	transitMount    string
	transitKey      string
	vaultRole       string
	vaultAuthMount  string
	vaultNamespace  string
	vaultCA         string
	keyBackendDir   string
	vaultTokenFile  string
	healthAddr      string
	locMap          string
	locWriteDir     string
	locDir          string
	maxVols         int64
	httpEndpoint    string
	regDir          string
	regPath         string
	metricsAddr     string
	agentMetrics    string
	kubeEvents      bool
	kubeEventsState string
	nodeName        string
	insecureHTTP    bool
}

func parsePluginFlags(args []string) (*pluginFlags, error) {
	f := &pluginFlags{}
	fs := flag.NewFlagSet("vco-csi", flag.ContinueOnError)
	fs.StringVar(&f.mode, "mode", "all", "controller, node or all")
	fs.StringVar(&f.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint")
	fs.StringVar(&f.name, "driver-name", "", "CSI driver name (default: derived from the portal host, try.whitesky.cloud -> cloud.whitesky.csi)")
	fs.StringVar(&f.apiURL, "api-url", "", "whitesky.cloud API root, e.g. https://try.whitesky.cloud/api/1 (controller; or --portal-url)")
	fs.StringVar(&f.portalURL, "portal-url", "", "portal base URL, scheme://host, e.g. https://try.whitesky.cloud; the API root is <portal-url>/api/1 (controller; key url of the Secret csi-driver-secret)")
	fs.StringVar(&f.customer, "customer", "", "customer id (controller)")
	fs.StringVar(&f.cloudspace, "cloudspace", "", "cloudspace of the cluster's VMs, checked and logged at start (controller; key cloudspace of the Secret csi-driver-secret)")
	fs.StringVar(&f.tokenFile, "token-file", "/etc/vco-csi/token", "file holding the API's JWT; re-read when it changes (controller)")
	fs.StringVar(&f.caFile, "ca-file", "", "PEM CA bundle for the API instead of the system roots (controller)")
	fs.StringVar(&f.defLoc, "default-location", "", "location for volumes requested without topology (controller; default: the first listed)")
	fs.DurationVar(&f.attachWait, "attach-timeout", 2*time.Minute, "longest wait for an attached disk to appear on its VM (controller)")
	fs.StringVar(&f.agentSock, "agent-socket", "/run/vco-agent/agent.sock", "vco-agent socket (node)")
	fs.StringVar(&f.kubelet, "kubelet-root", "/var/lib/kubelet", "the host's kubelet directory, which staging and target paths must lie under; checked by their text, the plugin need not see it (node)")
	fs.BoolVar(&f.allowUnfenced, "allow-unfenced", false, "ask the agent to stage disks that offer no fencing method, e.g. loop devices; the agent must allow it too (node; tests and the simulator only)")
	fs.StringVar(&f.loopDir, "sim-disk-dir", "", "find volumes as loop devices in `dir`, the disk directory of the simulator's host backend (<vco-lab sim --dir>/disks), instead of by PCI address and serial (node; simulator only)")
	fs.StringVar(&f.vaultAddr, "vault-addr", "", "Vault/OpenBao address whose transit engine wraps encrypted volumes' passphrases; empty: encrypted volumes are refused (node)")
	fs.StringVar(&f.transitMount, "vault-transit-mount", "transit", "transit engine mount path (node)")
	fs.StringVar(&f.transitKey, "vault-transit-key", "vco-volumes", "transit key that wraps new volumes' passphrases (node)")
	fs.StringVar(&f.vaultRole, "vault-role", "vco-node", "Vault Kubernetes auth role of the node plugin's ServiceAccount (node)")
	fs.StringVar(&f.vaultAuthMount, "vault-auth-mount", "kubernetes", "Vault Kubernetes auth mount path (node)")
	fs.StringVar(&f.vaultNamespace, "vault-namespace", "", "Vault/OpenBao namespace (node)")
	fs.StringVar(&f.vaultCA, "vault-ca-file", "", "PEM CA bundle for Vault instead of the system roots (node)")
	fs.StringVar(&f.keyBackendDir, "key-backend-dir", "", "directory holding the keys of the ConfigMaps csi-key-backend-config and openbao-ca and a ServiceAccount token (audience vault), as the node DaemonSet projects them; replaces the --vault-* flags (node)")
	fs.StringVar(&f.vaultTokenFile, "vault-token-file", "", "file holding a Vault token to use instead of Kubernetes auth (node; operators and tests)")
	fs.StringVar(&f.healthAddr, "health-addr", "", "serve GET /readyz on this address: 503 with the reason while the key backend's settings are unusable, else 200 (node; e.g. :9810)")
	fs.StringVar(&f.locMap, "node-locations-configmap", "", "keep the map of the customer's VMs (reference_id) to their locations in this ConfigMap of the pod's namespace, for the node plugins (controller; deploy: "+driver.NodeLocationsConfigMap+")")
	fs.StringVar(&f.locWriteDir, "node-locations-write-dir", "", "keep that map as one file per reference_id in this directory instead (controller; the lab, without Kubernetes)")
	fs.StringVar(&f.locDir, "node-locations-dir", "", "directory where the controller's map of reference_ids to locations is projected; the node's location is its VM's entry, node.location in the agent's configuration an optional override that must agree (node)")
	fs.Int64Var(&f.maxVols, "max-volumes-per-node", driver.DefaultMaxVolumesPerNode, "data disks the platform attaches to a VM (virtio, one hot-plug PCI slot each); the controller publishes each VM's limit as this less the VM's data disks that are not volumes of this driver, which the node reports; a node without that entry reports this (controller, node)")
	fs.StringVar(&f.httpEndpoint, "http-endpoint", "", "host:port of the HTTP server whose /healthz calls the plugin's CSI Probe, for the kubelet's liveness probe (e.g. :9808); empty: none")
	fs.StringVar(&f.regDir, "registration-dir", "", "the kubelet's plugins_registry directory, or a directory of the plugin's own in it, as mounted in the container; the plugin registers itself with the kubelet through a socket there (node); empty: no registration")
	fs.StringVar(&f.regPath, "kubelet-registration-path", "", "the CSI socket's path on the host, as the kubelet dials it (node; default <kubelet-root>/plugins/<driver-name>/csi.sock)")
	fs.StringVar(&f.metricsAddr, "metrics-address", "", "host:port to serve Prometheus /metrics on (CSI calls, API requests; on the node also vco-agent's series); empty: off")
	fs.StringVar(&f.agentMetrics, "agent-metrics-socket", "/run/vco-agent/metrics.sock", "vco-agent's metrics socket, whose series the node plugin re-exports on --metrics-address; empty: none (node)")
	fs.BoolVar(&f.kubeEvents, "kube-events", true, "post vco-agent's refusals, fence losses, takeovers and re-established claims as Kubernetes Events about this node, and about the claim and pods of the volume they name, through the pod's ServiceAccount (node; off outside a pod)")
	fs.StringVar(&f.kubeEventsState, "kube-events-state", "", "file that keeps the claim and pods of each volume staged on this node across restarts of the plugin, for --kube-events (node; deploy: /csi/kube-events.json); empty: memory only")
	fs.StringVar(&f.nodeName, "node-name", os.Getenv("NODE_NAME"), "this node's Kubernetes name, which the Events of --kube-events are about (node; default $NODE_NAME, which the DaemonSet sets from spec.nodeName)")
	fs.BoolVar(&f.insecureHTTP, strings.TrimPrefix(cleartext.Option, "--"), false, "let the cloud API URL (--portal-url, --api-url) and the key backend address (--vault-addr, key address of csi-key-backend-config) be plain http to any host, not only to a loopback address: the cloud JWT, the node's ServiceAccount token, the Vault token and the passphrases then travel in clear; warned about at start (the simulator's and the lab's set-ups only)")

	if err := fs.Parse(args); err != nil {
		return f, err
	}
	// A word the flags do not take (a mistyped command, or the simulator,
	// which is `vco-lab sim`) is refused, not ignored by a plugin that
	// starts anyway.
	if fs.NArg() > 0 {
		err := fmt.Errorf("unexpected argument %q: vco-csi takes flags, or one of the commands version, plugin-dirs and rewrap; the API simulator is `vco-lab sim`", fs.Arg(0))
		fmt.Fprintf(fs.Output(), "vco-csi: %v\n", err)
		return f, err
	}
	return f, nil
}

// run makes the driver of the flags' mode, opens its listeners, starts
// what runs beside CSI and serves until a signal or a failure.
func (f *pluginFlags) run(log *slog.Logger) error {
	mx := metrics.New()
	cfg, agentAPI, err := f.driverConfig(log, mx)
	if err != nil {
		return err
	}
	// The claims and pods of the volumes staged here, for the Events.
	var users *kubeevents.Users
	if agentAPI != nil && f.kubeEvents {
		users = &kubeevents.Users{File: f.kubeEventsState, Log: log}
		cfg.Users = users
	}
	d, err := driver.New(cfg)
	if err != nil {
		return err
	}
	if f.healthAddr != "" {
		hs, err := serveReadiness(f.healthAddr, cfg.KeyBackendProblem)
		if err != nil {
			return err
		}
		defer hs.Close()
	}
	var hl net.Listener
	if f.httpEndpoint != "" {
		if hl, err = health.Listen(f.httpEndpoint); err != nil {
			return err
		}
		defer hl.Close()
	}
	ln, err := driver.Listen(f.endpoint)
	if err != nil {
		return err
	}
	srv := d.NewGRPCServer(log, mx.Interceptor())
	if f.metricsAddr != "" {
		if stopMetrics := f.serveMetrics(cfg.Mode, mx, log); stopMetrics != nil {
			defer stopMetrics()
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.Mode != driver.ModeNode {
		if err := f.startNodeLocations(ctx, d, log); err != nil {
			return err
		}
	}
	if users != nil {
		startKubeEvents(ctx, log, mx, agentAPI, f.nodeName, kubeevents.ServiceAccountDir, users)
	}
	return f.serve(ctx, srv, ln, hl, cfg, log)
}

// driverConfig is the driver's configuration from the flags: the cloud
// API for the controller, the key backend and the agent for the node, and
// the driver's name. It fills in the registration path.
func (f *pluginFlags) driverConfig(log *slog.Logger, mx *metrics.Metrics) (driver.Config, kubeevents.Agent, error) {
	if f.insecureHTTP {
		log.Warn("INSECURE: "+cleartext.Option+" is set: the cloud API URL and the key backend address may be plain http to any host, "+
			"and the cloud JWT, the node's ServiceAccount token, the Vault token and the passphrases then travel in clear; for the simulator's and the lab's set-ups only",
			"mode", f.mode)
	}
	cfg := driver.Config{Name: f.name, Version: version, Mode: driver.Mode(f.mode), DefaultLocation: f.defLoc, Log: log,
		AttachTimeout: f.attachWait, KubeletRoot: f.kubelet, MaxVolumesPerNode: f.maxVols, NodeLocationsDir: f.locDir}
	if cfg.Mode != driver.ModeNode {
		if err := f.controllerCloud(&cfg, mx, log); err != nil {
			return cfg, nil, err
		}
	}
	if cfg.Name == "" && f.apiURL != "" {
		if u, err := url.Parse(f.apiURL); err == nil {
			cfg.Name = drivername.FromPortal(u.Hostname())
		}
	}
	var agentAPI kubeevents.Agent
	if cfg.Mode != driver.ModeController {
		if err := f.nodeKeyBackend(&cfg, log); err != nil {
			return cfg, nil, err
		}
		// After the settings, so a wrong ConfigMap is reported even on a
		// node whose agent is not up yet.
		a, err := newAgent(f.agentSock, agentnode.Options{AllowUnfenced: f.allowUnfenced, LoopDiskDir: f.loopDir})
		if err != nil {
			return cfg, nil, err
		}
		cfg.Agent, agentAPI = a, a.API()
	}
	if cfg.Name == "" {
		return cfg, nil, errors.New("no driver name: set --driver-name (it is derived from --api-url only when that names a host in a domain)")
	}
	if f.regDir != "" && cfg.Mode == driver.ModeController {
		return cfg, nil, errors.New("--registration-dir is for the node plugin (--mode=node or all); the controller is not registered with a kubelet")
	}
	if f.regPath == "" {
		f.regPath = filepath.Join(f.kubelet, "plugins", cfg.Name, "csi.sock")
	}
	return cfg, agentAPI, nil
}

// controllerCloud sets the controller's cloud API client, its root from
// --api-url or derived from --portal-url, and the driver's name from the
// API's host when none was given.
func (f *pluginFlags) controllerCloud(cfg *driver.Config, mx *metrics.Metrics, log *slog.Logger) error {
	if f.portalURL != "" {
		if f.apiURL != "" {
			return errors.New("--portal-url and --api-url both given; the API root is derived from --portal-url, give only one")
		}
		root, err := credential{PortalURL: f.portalURL, Customer: f.customer, Cloudspace: f.cloudspace, TokenFile: f.tokenFile,
			InsecureAllowHTTP: f.insecureHTTP}.apiURL()
		if err != nil {
			return err
		}
		f.apiURL = root
	} else if u, err := url.Parse(f.apiURL); err == nil && u.Scheme == "http" && !cleartext.Allowed(u, f.insecureHTTP) {
		return fmt.Errorf("--api-url %q is plain http to %s, not a loopback address: the cloud JWT would travel in clear; give the https:// API root (%s allows http for test set-ups)",
			f.apiURL, u.Hostname(), cleartext.Option)
	}
	c, err := cloud.New(cloud.Config{BaseURL: f.apiURL, InsecureAllowHTTP: f.insecureHTTP, Customer: f.customer, TokenFile: f.tokenFile,
		CAFile: f.caFile, WrapTransport: mx.Transport})
	if err != nil {
		return err
	}
	warnCleartext(log, "the cloud API", "the cloud JWT", f.apiURL)
	cfg.Cloud = c
	if cfg.Name == "" {
		cfg.Name = drivername.FromPortal(c.Host())
	}
	return nil
}

// nodeKeyBackend sets the node's transit engine, from --key-backend-dir
// or the --vault-* flags; with neither, encrypted volumes are refused.
func (f *pluginFlags) nodeKeyBackend(cfg *driver.Config, log *slog.Logger) error {
	if f.keyBackendDir != "" {
		if f.vaultAddr != "" || f.vaultTokenFile != "" {
			return errors.New("--key-backend-dir and --vault-addr/--vault-token-file both given; give only one")
		}
		f.keyBackendFromDir(cfg, log)
		return nil
	}
	if f.vaultAddr == "" {
		return nil
	}
	if u, err := url.Parse(f.vaultAddr); err == nil && u.Scheme == "http" && !cleartext.Allowed(u, f.insecureHTTP) {
		return fmt.Errorf("--vault-addr %q is plain http to %s, not a loopback address: the Vault token and the passphrases would travel in clear; give the https:// address (%s allows http for test set-ups)",
			f.vaultAddr, u.Hostname(), cleartext.Option)
	}
	tc := transit.Config{Address: f.vaultAddr, InsecureAllowHTTP: f.insecureHTTP, Mount: f.transitMount, Namespace: f.vaultNamespace, CACertFile: f.vaultCA,
		KubernetesRole: f.vaultRole, KubernetesMount: f.vaultAuthMount}
	if f.vaultTokenFile != "" {
		b, err := os.ReadFile(f.vaultTokenFile)
		if err != nil {
			return fmt.Errorf("reading the Vault token: %w", err)
		}
		tc.Token = strings.TrimSpace(string(b))
	}
	w, err := transit.New(tc)
	if err != nil {
		return err
	}
	warnCleartext(log, "the key backend", "the Vault token and the passphrases", f.vaultAddr)
	cfg.Transit, cfg.TransitKey = w, crypt.TransitKey{Mount: f.transitMount, Name: f.transitKey}
	return nil
}

// keyBackendFromDir sets the transit engine from --key-backend-dir. A
// wrong or partial key-backend setting must not stop the plugin: plain
// volumes are served, the problem is logged and answered on
// --health-addr, and encrypted stages are refused naming it
// (docs/encryption.md).
func (f *pluginFlags) keyBackendFromDir(cfg *driver.Config, log *slog.Logger) {
	w, kb, err := nodeKeyBackend(f.keyBackendDir, f.insecureHTTP)
	switch {
	case err != nil:
		cfg.KeyBackendProblem = err
		log.Error("key backend configuration problem: encrypted volumes are refused on this node until it is fixed and the node plugin restarted; plain volumes are served",
			"problem", err.Error(), "dir", f.keyBackendDir)
	case kb == nil:
		log.Info("no key backend configured: encrypted volumes will be refused", "dir", f.keyBackendDir, "configmap", "csi-key-backend-config")
	default:
		cfg.Transit, cfg.TransitKey = w, kb.Key
		warnCleartext(log, "the key backend", "the node's ServiceAccount token, the Vault token and the passphrases", kb.Transit.Address)
		log.Info("key backend configured", "address", kb.Transit.Address, "transit_mount", kb.Key.Mount, "transit_key", kb.Key.Name,
			"k8s_auth_path", kb.Transit.KubernetesMount, "role", kb.Transit.KubernetesRole, "ca_ref", kb.CARef, "ca", kb.CASource)
	}
}

// warnCleartext logs, as a warning, that what (the cloud API, the key
// backend) is reached over plain http at raw, not a loopback address,
// which only --insecure-allow-http lets through: secrets travel in clear.
func warnCleartext(log *slog.Logger, what, secrets, raw string) {
	if u, err := url.Parse(raw); err == nil && cleartext.Clear(u) {
		log.Warn("INSECURE: "+what+" is reached over plain http, not at a loopback address: "+secrets+" travel in clear ("+cleartext.Option+")",
			"url", u.Scheme+"://"+u.Host)
	}
}

// serveReadiness answers the node pod's readiness probe on addr.
func serveReadiness(addr string, keyBackendProblem error) (*http.Server, error) {
	hl, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--health-addr: %w", err)
	}
	hs := &http.Server{Handler: readiness(keyBackendProblem), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(hl) }()
	return hs, nil
}

// serveMetrics serves /metrics and returns what stops it, or nil when it
// did not start. Metrics are an aid: a listener that cannot start is
// reported and the plugin serves CSI without it.
func (f *pluginFlags) serveMetrics(mode driver.Mode, mx *metrics.Metrics, log *slog.Logger) func() {
	if mode != driver.ModeController && f.agentMetrics != "" {
		mx.WithAgent(f.agentMetrics)
	}
	stopMetrics, err := mx.Serve(f.metricsAddr, log)
	if err != nil {
		log.Error("the metrics listener did not start; serving CSI without it", "address", f.metricsAddr, "err", err)
		return nil
	}
	log.Info("metrics served", "address", f.metricsAddr, "agent_metrics_socket", f.agentMetrics)
	return stopMetrics
}

// startNodeLocations keeps the map of the customer's VMs to their
// locations, in a ConfigMap or a directory, for the node plugins.
func (f *pluginFlags) startNodeLocations(ctx context.Context, d *driver.Driver, log *slog.Logger) error {
	var write func(context.Context, map[string]string) error
	switch {
	case f.locMap != "" && f.locWriteDir != "":
		return errors.New("--node-locations-configmap and --node-locations-write-dir both given; give only one")
	case f.locMap != "":
		// Without it nodes that set no node.location report no
		// location; volumes are served all the same.
		if w, err := inClusterConfigMap(f.locMap); err != nil {
			log.Error("the node location map cannot be written; nodes whose agent sets no node.location will not register", "configmap", f.locMap, "err", err)
		} else {
			write = w.write
		}
	case f.locWriteDir != "":
		write = func(_ context.Context, m map[string]string) error {
			return driver.WriteNodeLocationDir(f.locWriteDir, m)
		}
	}
	if write != nil {
		go d.RunNodeLocations(ctx, log, time.Minute, write)
	}
	return nil
}

// serve serves CSI on ln until ctx ends or serving fails. Once the socket
// accepts calls the plugin registers with the kubelet and answers the
// liveness probe on hl.
func (f *pluginFlags) serve(ctx context.Context, srv *grpc.Server, ln, hl net.Listener, cfg driver.Config, log *slog.Logger) error {
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.Info("serving CSI", "driver", cfg.Name, "mode", cfg.Mode, "endpoint", f.endpoint, "version", version, "cloudspace", f.cloudspace)

	// Registered only once the CSI socket accepts calls: the kubelet
	// calls NodeGetInfo on it before it accepts the plugin.
	var checks []health.Check
	var reg *registration.Server
	var err error
	if f.regDir != "" {
		if reg, err = registration.Start(registration.Config{DriverName: cfg.Name, Endpoint: f.regPath, Dir: f.regDir, Log: log}); err != nil {
			srv.Stop()
			return err
		}
		checks = append(checks, reg.Check)
	}
	if hl != nil {
		h, err := f.serveHealth(ctx, hl, log, checks)
		if err != nil {
			srv.Stop()
			return err
		}
		defer h.Close()
	}
	select {
	case err := <-served:
		if reg != nil {
			reg.Stop()
		}
		return err
	case <-ctx.Done():
	}
	// Deregister first, so the kubelet stops sending calls to a plugin
	// that is going away.
	if reg != nil {
		reg.Stop()
	}
	srv.GracefulStop()
	<-served
	return nil
}

// serveHealth answers the kubelet's liveness probe on hl with the
// plugin's CSI Probe and checks.
func (f *pluginFlags) serveHealth(ctx context.Context, hl net.Listener, log *slog.Logger, checks []health.Check) (*health.Handler, error) {
	h, err := health.New(f.endpoint, log, checks...)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(health.Path, h)
	go func() {
		if err := health.Serve(ctx, hl, mux); err != nil {
			log.Error("health endpoint stopped", "address", f.httpEndpoint, "error", err)
		}
	}()
	log.Info("serving health", "address", hl.Addr().String(), "path", health.Path)
	return h, nil
}

// startKubeEvents posts the agent's events as Kubernetes Events about the
// node, and through users about the claims and pods of the volumes they
// name, with the ServiceAccount token and CA in saDir, on goroutines of
// their own until ctx ends. Whatever is missing (not in a pod, no node
// name, no CA) is logged once and leaves the plugin serving as before
// (docs/events.md, "In Kubernetes").
func startKubeEvents(ctx context.Context, log *slog.Logger, mx *metrics.Metrics, agent kubeevents.Agent, node, saDir string, users *kubeevents.Users) {
	off := "vco-agent's events are not posted as Kubernetes Events; they are in the node's journal and `vco-agent events`"
	p, err := kubeevents.InCluster(node, saDir, kubeevents.Config{Log: log,
		Observe: func(result string) { mx.KubeEvent(result, 1) }})
	switch {
	case errors.Is(err, kubeevents.ErrNotInCluster):
		log.Info(off, "reason", err.Error())
		return
	case err != nil:
		log.Warn(off, "reason", err.Error())
		return
	}
	go p.Run(ctx)
	users.To = p
	f := &kubeevents.Follower{Agent: agent, To: users, Log: log, Missed: func(n uint64) { mx.KubeEvent("missed", n) }}
	go f.Run(ctx)
	log.Info("posting vco-agent's events as Kubernetes Events", "node", node, "namespace", kubeevents.Namespace)
}

// readiness answers the node pod's readiness probe. A key-backend problem
// makes the pod not ready, which kubectl shows with the reason, while the
// CSI socket keeps serving plain volumes: the kubelet reaches the plugin
// through its registration, not through the pod's readiness.
func readiness(keyBackendProblem error) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if keyBackendProblem != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "key backend: %v; plain volumes are served, encrypted volumes are refused\n", keyBackendProblem)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}
