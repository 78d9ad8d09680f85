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

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/health"
	"github.com/whitesky-cloud/vco-storage/csi/kubeevents"
	"github.com/whitesky-cloud/vco-storage/csi/metrics"
	"github.com/whitesky-cloud/vco-storage/csi/registration"
)

// runPlugin serves the CSI services of the chosen mode.
func runPlugin(args []string) int {
	fs := flag.NewFlagSet("vco-csi", flag.ContinueOnError)
	mode := fs.String("mode", "all", "controller, node or all")
	endpoint := fs.String("endpoint", "unix:///csi/csi.sock", "CSI endpoint")
	name := fs.String("driver-name", "", "CSI driver name (default: derived from the portal host, try.whitesky.cloud -> cloud.whitesky.csi)")
	apiURL := fs.String("api-url", "", "whitesky.cloud API root, e.g. https://try.whitesky.cloud/api/1 (controller; or --portal-url)")
	portalURL := fs.String("portal-url", "", "portal base URL, scheme://host, e.g. https://try.whitesky.cloud; the API root is <portal-url>/api/1 (controller; key url of the Secret csi-driver-secret)")
	customer := fs.String("customer", "", "customer id (controller)")
	cloudspace := fs.String("cloudspace", "", "cloudspace of the cluster's VMs, checked and logged at start (controller; key cloudspace of the Secret csi-driver-secret)")
	tokenFile := fs.String("token-file", "/etc/vco-csi/token", "file holding the API's JWT; re-read when it changes (controller)")
	caFile := fs.String("ca-file", "", "PEM CA bundle for the API instead of the system roots (controller)")
	defLoc := fs.String("default-location", "", "location for volumes requested without topology (controller; default: the first listed)")
	attachWait := fs.Duration("attach-timeout", 2*time.Minute, "longest wait for an attached disk to appear on its VM (controller)")
	agentSock := fs.String("agent-socket", "/run/vco-agent/agent.sock", "vco-agent socket (node)")
	kubelet := fs.String("kubelet-root", "/var/lib/kubelet", "staging and target paths must lie under this directory (node)")
	allowUnfenced := fs.Bool("allow-unfenced", false, "ask the agent to stage disks that offer no fencing method, e.g. loop devices; the agent must allow it too (node; tests and the simulator only)")
	loopDir := fs.String("sim-disk-dir", "", "find volumes as loop devices of this `vco-csi sim` host backend's disk directory (<sim --dir>/disks) instead of by PCI address and serial (node; simulator only)")
	vaultAddr := fs.String("vault-addr", "", "Vault/OpenBao address whose transit engine wraps encrypted volumes' passphrases; empty: encrypted volumes are refused (node)")
	transitMount := fs.String("vault-transit-mount", "transit", "transit engine mount path (node)")
	transitKey := fs.String("vault-transit-key", "vco-volumes", "transit key that wraps new volumes' passphrases (node)")
	vaultRole := fs.String("vault-role", "vco-node", "Vault Kubernetes auth role of the node plugin's ServiceAccount (node)")
	vaultAuthMount := fs.String("vault-auth-mount", "kubernetes", "Vault Kubernetes auth mount path (node)")
	vaultNamespace := fs.String("vault-namespace", "", "Vault/OpenBao namespace (node)")
	vaultCA := fs.String("vault-ca-file", "", "PEM CA bundle for Vault instead of the system roots (node)")
	keyBackendDir := fs.String("key-backend-dir", "", "directory holding the keys of the ConfigMaps csi-key-backend-config and openbao-ca and a ServiceAccount token (audience vault), as the node DaemonSet projects them; replaces the --vault-* flags (node)")
	vaultTokenFile := fs.String("vault-token-file", "", "file holding a Vault token to use instead of Kubernetes auth (node; operators and tests)")
	healthAddr := fs.String("health-addr", "", "serve GET /readyz on this address: 503 with the reason while the key backend's settings are unusable, else 200 (node; e.g. :9810)")
	locMap := fs.String("node-locations-configmap", "", "keep the map of the customer's VMs (reference_id) to their locations in this ConfigMap of the pod's namespace, for the node plugins (controller; deploy: "+driver.NodeLocationsConfigMap+")")
	locWriteDir := fs.String("node-locations-write-dir", "", "keep that map as one file per reference_id in this directory instead (controller; the lab, without Kubernetes)")
	locDir := fs.String("node-locations-dir", "", "directory where the controller's map of reference_ids to locations is projected; the node's location is its VM's entry, node.location in the agent's configuration an optional override that must agree (node)")
	maxVols := fs.Int64("max-volumes-per-node", driver.DefaultMaxVolumesPerNode, "data disks the platform attaches to a VM (virtio, one hot-plug PCI slot each); the controller publishes each VM's limit as this less the VM's data disks that are not volumes of this driver, which the node reports; a node without that entry reports this (controller, node)")
	httpEndpoint := fs.String("http-endpoint", "", "host:port of the HTTP server whose /healthz calls the plugin's CSI Probe, for the kubelet's liveness probe (e.g. :9808); empty: none")
	regDir := fs.String("registration-dir", "", "the kubelet's plugins_registry directory as mounted in the container; the plugin registers itself with the kubelet through a socket there (node); empty: no registration")
	regPath := fs.String("kubelet-registration-path", "", "the CSI socket's path on the host, as the kubelet dials it (node; default <kubelet-root>/plugins/<driver-name>/csi.sock)")
	metricsAddr := fs.String("metrics-address", "", "host:port to serve Prometheus /metrics on (CSI calls, API requests; on the node also vco-agent's series); empty: off")
	agentMetrics := fs.String("agent-metrics-socket", "/run/vco-agent/metrics.sock", "vco-agent's metrics socket, whose series the node plugin re-exports on --metrics-address; empty: none (node)")
	kubeEvents := fs.Bool("kube-events", true, "post vco-agent's refusals, fence losses, takeovers and re-established claims as Kubernetes Events about this node, and about the claim and pods of the volume they name, through the pod's ServiceAccount (node; off outside a pod)")
	kubeEventsState := fs.String("kube-events-state", "", "file that keeps the claim and pods of each volume staged on this node across restarts of the plugin, for --kube-events (node; deploy: /csi/kube-events.json); empty: memory only")
	nodeName := fs.String("node-name", os.Getenv("NODE_NAME"), "this node's Kubernetes name, which the Events of --kube-events are about (node; default $NODE_NAME, which the DaemonSet sets from spec.nodeName)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	fail := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "vco-csi: "+format+"\n", a...)
		return 1
	}
	mx := metrics.New()
	var agentAPI kubeevents.Agent
	cfg := driver.Config{Name: *name, Version: version, Mode: driver.Mode(*mode), DefaultLocation: *defLoc,
		AttachTimeout: *attachWait, KubeletRoot: *kubelet, MaxVolumesPerNode: *maxVols, NodeLocationsDir: *locDir}
	if cfg.Mode != driver.ModeNode {
		if *portalURL != "" {
			if *apiURL != "" {
				return fail("--portal-url and --api-url both given; the API root is derived from --portal-url, give only one")
			}
			root, err := credential{PortalURL: *portalURL, Customer: *customer, Cloudspace: *cloudspace, TokenFile: *tokenFile}.apiURL()
			if err != nil {
				return fail("%v", err)
			}
			*apiURL = root
		}
		c, err := cloud.New(cloud.Config{BaseURL: *apiURL, Customer: *customer, TokenFile: *tokenFile, CAFile: *caFile, WrapTransport: mx.Transport})
		if err != nil {
			return fail("%v", err)
		}
		cfg.Cloud = c
		if cfg.Name == "" {
			cfg.Name = driver.NameFromPortal(c.Host())
		}
	}
	if cfg.Name == "" && *apiURL != "" {
		if u, err := url.Parse(*apiURL); err == nil {
			cfg.Name = driver.NameFromPortal(u.Hostname())
		}
	}
	if cfg.Mode != driver.ModeController {
		if *keyBackendDir != "" {
			if *vaultAddr != "" || *vaultTokenFile != "" {
				return fail("--key-backend-dir and --vault-addr/--vault-token-file both given; give only one")
			}
			// A wrong or partial key-backend setting must not stop the
			// plugin: plain volumes are served, the problem is logged and
			// answered on --health-addr, and encrypted stages are refused
			// naming it (docs/encryption.md).
			w, kb, err := nodeKeyBackend(*keyBackendDir)
			switch {
			case err != nil:
				cfg.KeyBackendProblem = err
				log.Error("key backend configuration problem: encrypted volumes are refused on this node until it is fixed and the node plugin restarted; plain volumes are served",
					"problem", err.Error(), "dir", *keyBackendDir)
			case kb == nil:
				log.Info("no key backend configured: encrypted volumes will be refused", "dir", *keyBackendDir, "configmap", "csi-key-backend-config")
			default:
				cfg.Transit, cfg.TransitKey = w, kb.Key
				log.Info("key backend configured", "address", kb.Transit.Address, "transit_mount", kb.Key.Mount, "transit_key", kb.Key.Name,
					"k8s_auth_path", kb.Transit.KubernetesMount, "role", kb.Transit.KubernetesRole, "ca_ref", kb.CARef, "ca", kb.CASource)
			}
		} else if *vaultAddr != "" {
			tc := transit.Config{Address: *vaultAddr, Mount: *transitMount, Namespace: *vaultNamespace, CACertFile: *vaultCA,
				KubernetesRole: *vaultRole, KubernetesMount: *vaultAuthMount}
			if *vaultTokenFile != "" {
				b, err := os.ReadFile(*vaultTokenFile)
				if err != nil {
					return fail("reading the Vault token: %v", err)
				}
				tc.Token = strings.TrimSpace(string(b))
			}
			w, err := transit.New(tc)
			if err != nil {
				return fail("%v", err)
			}
			cfg.Transit, cfg.TransitKey = w, crypt.TransitKey{Mount: *transitMount, Name: *transitKey}
		}
	}
	if cfg.Mode != driver.ModeController {
		// After the settings, so a wrong ConfigMap is reported even on a
		// node whose agent is not up yet.
		a, err := newAgent(*agentSock, agentnode.Options{AllowUnfenced: *allowUnfenced, LoopDiskDir: *loopDir})
		if err != nil {
			return fail("%v", err)
		}
		cfg.Agent, agentAPI = a, a.API()
	}
	var users *kubeevents.Users
	if agentAPI != nil && *kubeEvents {
		users = &kubeevents.Users{File: *kubeEventsState, Log: log}
		cfg.Users = users
	}
	if cfg.Name == "" {
		return fail("no driver name: set --driver-name (it is derived from --api-url only when that names a host in a domain)")
	}
	if *regDir != "" && cfg.Mode == driver.ModeController {
		return fail("--registration-dir is for the node plugin (--mode=node or all); the controller is not registered with a kubelet")
	}
	if *regPath == "" {
		*regPath = filepath.Join(*kubelet, "plugins", cfg.Name, "csi.sock")
	}
	d, err := driver.New(cfg)
	if err != nil {
		return fail("%v", err)
	}
	if *healthAddr != "" {
		hl, err := net.Listen("tcp", *healthAddr)
		if err != nil {
			return fail("--health-addr: %v", err)
		}
		hs := &http.Server{Handler: readiness(cfg.KeyBackendProblem), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = hs.Serve(hl) }()
		defer hs.Close()
	}
	var hl net.Listener
	if *httpEndpoint != "" {
		if hl, err = health.Listen(*httpEndpoint); err != nil {
			return fail("%v", err)
		}
		defer hl.Close()
	}
	ln, err := driver.Listen(*endpoint)
	if err != nil {
		return fail("%v", err)
	}
	srv := d.NewGRPCServer(log, mx.Interceptor())
	if *metricsAddr != "" {
		if cfg.Mode != driver.ModeController && *agentMetrics != "" {
			mx.WithAgent(*agentMetrics)
		}
		// Metrics are an aid: a listener that cannot start is reported
		// and the plugin serves CSI without it.
		stopMetrics, err := mx.Serve(*metricsAddr, log)
		if err != nil {
			log.Error("the metrics listener did not start; serving CSI without it", "address", *metricsAddr, "err", err)
		} else {
			defer stopMetrics()
			log.Info("metrics served", "address", *metricsAddr, "agent_metrics_socket", *agentMetrics)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.Mode != driver.ModeNode {
		var write func(context.Context, map[string]string) error
		switch {
		case *locMap != "" && *locWriteDir != "":
			return fail("--node-locations-configmap and --node-locations-write-dir both given; give only one")
		case *locMap != "":
			// Without it nodes that set no node.location report no
			// location; volumes are served all the same.
			if w, err := inClusterConfigMap(*locMap); err != nil {
				log.Error("the node location map cannot be written; nodes whose agent sets no node.location will not register", "configmap", *locMap, "err", err)
			} else {
				write = w.write
			}
		case *locWriteDir != "":
			write = func(_ context.Context, m map[string]string) error {
				return driver.WriteNodeLocationDir(*locWriteDir, m)
			}
		}
		if write != nil {
			go d.RunNodeLocations(ctx, log, time.Minute, write)
		}
	}
	if users != nil {
		startKubeEvents(ctx, log, mx, agentAPI, *nodeName, kubeevents.ServiceAccountDir, users)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.Info("serving CSI", "driver", cfg.Name, "mode", cfg.Mode, "endpoint", *endpoint, "version", version, "cloudspace", *cloudspace)

	// Registered only once the CSI socket accepts calls: the kubelet
	// calls NodeGetInfo on it before it accepts the plugin.
	var checks []health.Check
	var reg *registration.Server
	if *regDir != "" {
		if reg, err = registration.Start(registration.Config{DriverName: cfg.Name, Endpoint: *regPath, Dir: *regDir, Log: log}); err != nil {
			srv.Stop()
			return fail("%v", err)
		}
		checks = append(checks, reg.Check)
	}
	if hl != nil {
		h, err := health.New(*endpoint, log, checks...)
		if err != nil {
			srv.Stop()
			return fail("%v", err)
		}
		defer h.Close()
		mux := http.NewServeMux()
		mux.Handle(health.Path, h)
		go func() {
			if err := health.Serve(ctx, hl, mux); err != nil {
				log.Error("health endpoint stopped", "address", *httpEndpoint, "error", err)
			}
		}()
		log.Info("serving health", "address", hl.Addr().String(), "path", health.Path)
	}
	select {
	case err := <-served:
		if reg != nil {
			reg.Stop()
		}
		return fail("%v", err)
	case <-ctx.Done():
	}
	// Deregister first, so the kubelet stops sending calls to a plugin
	// that is going away.
	if reg != nil {
		reg.Stop()
	}
	srv.GracefulStop()
	<-served
	return 0
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
