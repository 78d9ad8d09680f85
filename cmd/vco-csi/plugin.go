package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/metrics"
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
	maxVols := fs.Int64("max-volumes-per-node", driver.DefaultMaxVolumesPerNode, "volumes a node can take (node)")
	metricsAddr := fs.String("metrics-address", "", "host:port to serve Prometheus /metrics on (CSI calls, API requests; on the node also vco-agent's series); empty: off")
	agentMetrics := fs.String("agent-metrics-socket", "/run/vco-agent/metrics.sock", "vco-agent's metrics socket, whose series the node plugin re-exports on --metrics-address; empty: none (node)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	fail := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "vco-csi: "+format+"\n", a...)
		return 1
	}
	mx := metrics.New()
	cfg := driver.Config{Name: *name, Version: version, Mode: driver.Mode(*mode), DefaultLocation: *defLoc,
		AttachTimeout: *attachWait, KubeletRoot: *kubelet, MaxVolumesPerNode: *maxVols}
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
			kb, err := loadKeyBackend(*keyBackendDir)
			if err != nil {
				return fail("%v", err)
			}
			if kb == nil {
				log.Info("no key backend configured: encrypted volumes will be refused", "dir", *keyBackendDir, "configmap", "csi-key-backend-config")
			} else {
				w, err := transit.New(kb.Transit)
				if err != nil {
					return fail("%s: %v", keyBackendConfig, err)
				}
				cfg.Transit, cfg.TransitKey = w, kb.Key
				log.Info("key backend configured", "address", kb.Transit.Address, "transit_key", kb.Key.Name, "role", kb.Transit.KubernetesRole)
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
		cfg.Agent = a
	}
	if cfg.Name == "" {
		return fail("no driver name: set --driver-name (it is derived from --api-url only when that names a host in a domain)")
	}
	d, err := driver.New(cfg)
	if err != nil {
		return fail("%v", err)
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
	go func() { <-ctx.Done(); srv.GracefulStop() }()
	log.Info("serving CSI", "driver", cfg.Name, "mode", cfg.Mode, "endpoint", *endpoint, "version", version, "cloudspace", *cloudspace)
	if err := srv.Serve(ln); err != nil {
		return fail("%v", err)
	}
	return 0
}
