// Package k8s runs a Kubernetes cluster in the lab, built from upstream
// sources: etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler on the host on loopback, and workers that are QEMU guests
// of the lab's Debian 12 root with the vco-agent package, containerd,
// runc, the CNI plugins and a kubelet. The simulator of the whitesky.cloud
// API hot-plugs the disks into the workers, as in the rest of the lab.
// It also installs the add-on the release way, runs Kubernetes' storage
// suite against the cluster (RunStorageSuite), and keeps the parts the
// scenarios ask of a cluster (the Vault key backend, Cluster API's
// manager); the scenarios themselves are package story.
// docs/development.md ("The Kubernetes lab") says what it takes and costs.
package k8s

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s/images"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// Options shape a cluster.
type Options struct {
	// Lab is the lab's configuration (its Binaries hold the exec server).
	Lab lab.Config
	// Workers are the worker names (default node-a, node-b).
	Workers []string
	// Kind is how the simulator shows disks to the workers (default
	// scsi-block).
	Kind lab.DiskKind
	// MemMB and CPUs of each worker (default 2048 and 2).
	MemMB, CPUs int
	// CloudInit has the workers' vco-agent configured and enabled by the
	// package's cloud-init seed, as on a node image
	// (packaging/cloud-init/user-data.yaml); without it the package's
	// postinst enabled it and the lab writes its configuration. cloud-init
	// adds a minute or more of Python to each worker's boot under TCG.
	CloudInit bool
	// Addon is how the add-on's core bundle is applied, both ways seed
	// 001 gives operators: AddonMake (`make csi-addon ... | kubectl apply
	// -f -`, the default) or AddonRelease (deploy/csi.yaml through
	// envsubst, as from a release).
	Addon string
	// CSIImage is the vco-csi image archive `make image` writes; default
	// the newest dist/vco-csi-*.oci.tar of the repository.
	CSIImage string
	// E2EImages adds the test images of Kubernetes' storage suite to the
	// registry (images.E2EImages), for RunStorageSuite.
	E2EImages bool
	// ExternalAddresses has the kubelets leave their node's addresses to a
	// cloud controller (--cloud-provider=external), and the lab set them
	// as one would, with an ExternalIP of each worker's own; the storage
	// suite reaches the workers over SSH to those addresses through the
	// lab's bastion (nodeSSH), for its disruptive patterns.
	ExternalAddresses bool
	// Log receives progress lines.
	Log io.Writer
}

// Cluster is a running cluster.
type Cluster struct {
	Env  *simlab.Env
	Bins *Binaries
	// Kubeconfig is the administrator's kubeconfig on the host.
	Kubeconfig string
	// SetupTime is how long Up took.
	SetupTime time.Duration

	// Registry serves the cluster's images; registry.k8s.io and
	// PortalHost are mirrored to it on the workers.
	Registry *images.Registry
	// keyBackendPort is the host port the workers reach as
	// HostInGuest:GuestTransitPort; K7 starts its key backend there.
	KeyBackendPort int
	KeyBackend     *KeyBackend

	// kubelets is how the API server reaches the workers' kubelets.
	kubelets *kubeletProxy
	// ssh is the storage suite's SSH way into the workers
	// (ExternalAddresses).
	ssh *nodeSSH

	// Opts are the options the cluster was started with.
	Opts Options

	cp  *controlPlane
	log io.Writer
}

// Up builds what is not cached and starts the cluster: the control plane,
// the simulator, the workers (joined, Ready).
func Up(ctx context.Context, o Options) (_ *Cluster, err error) {
	start := time.Now()
	o.setDefaults()
	c := &Cluster{Opts: o, log: o.Log}
	if c.Bins, err = Build(ctx, o.Lab.CacheDir, o.Log); err != nil {
		return nil, err
	}
	base, err := lab.FindDebianRoot()
	if err != nil {
		return nil, err
	}
	root, err := NodeRoot(ctx, base, o.Log)
	if err != nil {
		return nil, err
	}
	if err := c.serveImages(ctx, o); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Registry.Stop()
		}
	}()
	regPort, err := portOf(c.Registry.Host)
	if err != nil {
		return nil, err
	}
	if c.KeyBackendPort, err = lab.FreePort(); err != nil {
		return nil, err
	}
	transitPort := c.KeyBackendPort
	kubeletPorts := map[string]int{}
	for _, n := range o.Workers {
		if kubeletPorts[n], err = lab.FreePort(); err != nil {
			return nil, err
		}
	}
	defer func() {
		if err != nil && c.kubelets != nil {
			c.kubelets.Stop()
		}
	}()
	boot := func(ctx context.Context, l *lab.Lab, apiPort int) error {
		return c.bootWorkers(ctx, l, apiPort, root, regPort, transitPort, kubeletPorts)
	}
	c.Env, err = simlab.Start(ctx, simlab.Options{Lab: o.Lab, Kind: o.Kind, Boot: boot, Log: o.Log})
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	fmt.Fprintf(o.Log, "k8s: waiting for the workers to be Ready\n")
	if err := c.waitWorkersReady(ctx); err != nil {
		return nil, c.WithLogs(err)
	}
	if o.ExternalAddresses {
		if err := c.setNodeAddresses(ctx); err != nil {
			return nil, c.WithLogs(err)
		}
	}
	c.SetupTime = time.Since(start)
	fmt.Fprintf(o.Log, "k8s: cluster up in %s; kubeconfig %s\n", c.SetupTime.Round(time.Second), c.Kubeconfig)
	return c, nil
}

// setDefaults fills in the options left zero.
func (o *Options) setDefaults() {
	if len(o.Workers) == 0 {
		o.Workers = []string{"node-a", "node-b"}
	}
	if o.MemMB == 0 {
		o.MemMB = 2048
	}
	if o.CPUs == 0 {
		o.CPUs = 2
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	if o.Lab.CacheDir == "" {
		o.Lab.CacheDir = lab.DefaultCacheDir()
	}
}

// bootWorkers is the simulator's boot of the lab l (its API on apiPort):
// the control plane, the worker image with the node's root root, and the
// workers booted and joined, reaching the registry and the transit engine
// on the host's regPort and transitPort, their kubelets reached by the
// API server on the host's kubeletPorts (by node name) through the
// kubelet proxy.
func (c *Cluster) bootWorkers(ctx context.Context, l *lab.Lab, apiPort int, root *lab.DebianRoot, regPort, transitPort int, kubeletPorts map[string]int) error {
	dir := filepath.Join(l.Dir(), "k8s")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	kp, err := startKubeletProxy(filepath.Join(dir, "kubelets.sock"), kubeletPorts)
	if err != nil {
		return err
	}
	c.kubelets = kp
	egress, err := kp.egressConfig(dir)
	if err != nil {
		return err
	}
	if c.cp, err = startControlPlane(ctx, l, c.Bins, dir, c.Opts.Workers, egress, c.Opts.Log); err != nil {
		return err
	}
	c.Kubeconfig = c.cp.Kubeconfig
	fmt.Fprintf(c.Opts.Log, "k8s: making the worker image (kubelet %s, containerd, the vco-agent package)\n", Version)
	img, files := *root, workerFiles()
	if c.Opts.CloudInit {
		if img.UserData, err = nodeUserData(simlab.Location); err != nil {
			return err
		}
	} else {
		files["/etc/vco-agent/config.yaml"] = agentConfig(simlab.Location)
	}
	busybox, err := hostBusybox()
	if err != nil {
		return err
	}
	sb, err := l.DebianImageWith(ctx, "debian-k8s", &img, files, map[string]string{"/usr/local/bin/kubelet": c.Bins.Kubelet, GuestBusybox: busybox})
	if err != nil {
		return err
	}
	var cfgs []lab.GuestConfig
	for _, n := range c.Opts.Workers {
		cfgs = append(cfgs, lab.GuestConfig{Name: n, MemMB: c.Opts.MemMB, CPUs: c.Opts.CPUs,
			Forwards: workerForwards(c.cp.apiPort, regPort, apiPort, transitPort),
			Inbound:  []lab.Inbound{{HostPort: kubeletPorts[n], GuestPort: KubeletPort}},
			Reboots:  true})
	}
	fmt.Fprintf(c.Opts.Log, "k8s: booting %s\n", strings.Join(c.Opts.Workers, ", "))
	gs, err := l.StartSystemGuests(ctx, sb, cfgs...)
	if err != nil {
		return err
	}
	for i, g := range gs {
		if err := joinNode(ctx, g, c.cp, i+1, c.Opts.ExternalAddresses); err != nil {
			return err
		}
	}
	return nil
}

// setNodeAddresses does what a cloud controller does for a node the
// kubelet registered with --cloud-provider=external: it sets the node's
// addresses (its InternalIP, an ExternalIP of its own, its name) and
// removes the taint that keeps pods off an uninitialised node; it then
// serves the SSH bastion that reaches the workers at those ExternalIPs.
func (c *Cluster) setNodeAddresses(ctx context.Context) error {
	var gs []*lab.Guest
	for i, n := range c.Opts.Workers {
		var g *lab.Guest
		for _, lg := range c.Env.Lab.Guests {
			if lg.Name == n {
				g = lg
			}
		}
		if g == nil {
			return fmt.Errorf("worker %s has no guest", n)
		}
		gs = append(gs, g)
		patch := fmt.Sprintf(`{"status":{"addresses":[{"type":"InternalIP","address":%q},{"type":"ExternalIP","address":%q},{"type":"Hostname","address":%q}]}}`,
			NodeIP, externalIP(i), n)
		if _, err := c.Kubectl(ctx, "patch", "node", n, "--subresource=status", "--type=merge", "-p", patch); err != nil {
			return fmt.Errorf("setting the addresses of node %s: %w", n, err)
		}
		if _, err := c.Kubectl(ctx, "taint", "node", n, "node.cloudprovider.kubernetes.io/uninitialized-"); err != nil && !strings.Contains(err.Error(), "not found") {
			return fmt.Errorf("removing the uninitialised taint of node %s: %w", n, err)
		}
	}
	s, err := startNodeSSH(filepath.Join(c.Env.Lab.Dir(), "k8s"), gs, c.Opts.Log)
	if err != nil {
		return err
	}
	c.ssh = s
	fmt.Fprintf(c.Opts.Log, "k8s: node addresses set (ExternalIP %s...); the storage suite's SSH bastion on %s\n", externalIP(0), s.Addr)
	return nil
}

// waitWorkersReady waits until every worker is a Ready node.
func (c *Cluster) waitWorkersReady(ctx context.Context) error {
	return WaitFor(ctx, 5*time.Minute, "workers Ready", func() (bool, string, error) {
		out, err := c.Kubectl(ctx, "get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{" "}{end}`)
		if err != nil {
			return false, err.Error(), nil
		}
		ready := 0
		for _, f := range strings.Fields(out) {
			if strings.HasSuffix(f, "=True") {
				ready++
			}
		}
		return ready == len(c.Opts.Workers), out, nil
	})
}

// Kubectl runs kubectl with the administrator's kubeconfig and returns its
// standard output; a failure's error carries its standard error.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	return c.KubectlInput(ctx, nil, args...)
}

// KubectlInput is Kubectl with stdin.
func (c *Cluster) KubectlInput(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, c.Bins.Kubectl, append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Stdin = stdin
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// WithLogs adds the end of each worker's kubelet journal to err.
func (c *Cluster) WithLogs(err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msg := err.Error()
	for _, g := range c.Env.Lab.Guests {
		if out, e := g.MustSh(ctx, "journalctl -u kubelet -u containerd --no-pager -n 40 2>&1"); e == nil {
			msg += fmt.Sprintf("\n--- %s: kubelet and containerd\n%s", g.Name, out)
		}
	}
	return errors.New(msg)
}

// Close stops everything the cluster started.
func (c *Cluster) Close() error {
	if c.Registry != nil {
		c.Registry.Stop()
	}
	if c.KeyBackend != nil {
		c.KeyBackend.Srv.Stop()
	}
	if c.kubelets != nil {
		c.kubelets.Stop()
	}
	if c.ssh != nil {
		c.ssh.Stop()
	}
	if c.Env == nil {
		return nil
	}
	return c.Env.Close()
}

// serveImages builds (or finds cached) the images the cluster runs, adds
// the vco-csi image of o.CSIImage under Image, and serves them on
// loopback.
func (c *Cluster) serveImages(ctx context.Context, o Options) error {
	logf := func(f string, a ...any) { fmt.Fprintf(o.Log, "k8s: images: "+f+"\n", a...) }
	cache := filepath.Join(o.Lab.CacheDir, "k8s-images")
	imgs, err := images.Build(ctx, cache, logf)
	if err != nil {
		return err
	}
	if o.E2EImages {
		e2e, err := images.E2EImages(ctx, cache, buildDir(), logf)
		if err != nil {
			return err
		}
		maps.Copy(imgs, e2e)
	}
	archive := o.CSIImage
	if archive == "" {
		if archive, err = newest(filepath.Join(repoRoot(), "dist", "vco-csi-*.oci.tar")); err != nil {
			return fmt.Errorf("the vco-csi image: %w ('make image' writes it)", err)
		}
	}
	csiImg, err := images.LoadArchive(cache, archive)
	if err != nil {
		return err
	}
	imgs[Image] = csiImg
	// The registry lives as long as the cluster (Close stops it), not as
	// long as the context Up was given.
	if c.Registry, err = images.Serve(context.WithoutCancel(ctx), "127.0.0.1:0", imgs); err != nil {
		return err
	}
	fmt.Fprintf(o.Log, "k8s: registry on %s serves %d images (vco-csi from %s)\n", c.Registry.Host, len(imgs), archive)
	return nil
}

// newest is the most recently changed file matching glob.
func newest(glob string) (string, error) {
	m, _ := filepath.Glob(glob)
	var best string
	var at time.Time
	for _, f := range m {
		if st, err := os.Stat(f); err == nil && st.ModTime().After(at) {
			best, at = f, st.ModTime()
		}
	}
	if best == "" {
		return "", fmt.Errorf("no file %s", glob)
	}
	return best, nil
}

func portOf(hostport string) (int, error) {
	_, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(p)
}

// Prefetch builds, or finds cached, what Up needs before it boots
// anything: the Kubernetes binaries, the images (not vco-csi's) and, when
// the Debian root is there, the worker root.
func Prefetch(ctx context.Context, cacheDir string, log io.Writer) error {
	if _, err := Build(ctx, cacheDir, log); err != nil {
		return err
	}
	logf := func(f string, a ...any) { fmt.Fprintf(log, "k8s: images: "+f+"\n", a...) }
	if _, err := images.Build(ctx, filepath.Join(cacheDir, "k8s-images"), logf); err != nil {
		return err
	}
	base, err := lab.FindDebianRoot()
	if err != nil {
		fmt.Fprintf(log, "k8s: the worker root is made later: %v\n", err)
		return nil
	}
	_, err = NodeRoot(ctx, base, log)
	return err
}
