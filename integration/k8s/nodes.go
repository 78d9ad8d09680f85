package k8s

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// PortalHost is the registry host of the vco-csi image in the lab, as an
// operator's portal would serve it: the add-on derives the driver name
// (cloud.whitesky.csi) from it, and containerd takes it, like
// registry.k8s.io, from the lab's registry.
const PortalHost = "try.whitesky.cloud"

// GuestRegistry is the lab registry as the workers reach it, host:port:
// the storage suite's registry list (images.RepoList) names it, and
// containerd speaks plain HTTP to it.
var GuestRegistry = fmt.Sprintf("%s:%d", HostInGuest, GuestRegistryPort)

// Image is the vco-csi image reference the add-on is rendered with.
const Image = PortalHost + "/csi-driver:latest"

// nodeNetScript configures a worker's network at each boot, before
// containerd starts: the pod network state of the boot before goes (no
// network namespace outlives a boot, and a hard reset can leave the CNI
// plugins' cached results empty, on which every teardown of the boot's
// old sandboxes fails, and the kubelet never starts their pods again),
// then its NIC, the kubernetes service address sent to the API server's
// forward in place of kube-proxy, and the partition a scenario left in
// PartitionFile (a partition outlives the node's reboots).
var nodeNetScript = fmt.Sprintf(`set -e
rm -rf /var/lib/cni/results /var/lib/cni/networks
dev=$(ip -o link | awk -F': ' '/link\/ether 52:54:00:12:34:56/ {print $2; exit}')
[ -n "$dev" ] || { ip -o link; echo "no NIC with the lab's MAC address"; exit 1; }
ip link set "$dev" up
ip addr replace %[1]s/24 dev "$dev"
ip route replace default via 10.0.2.2
sysctl -qw net.ipv4.ip_forward=1
for chain in OUTPUT PREROUTING; do
	rule="-d %[2]s/32 -p tcp --dport 443 -j DNAT --to-destination %[3]s:%[4]d"
	iptables -t nat -C $chain $rule 2>/dev/null || iptables -t nat -A $chain $rule
done
if [ -f %[5]s ]; then sh %[5]s; fi
`, NodeIP, KubernetesSvc, HostInGuest, GuestAPIPort, PartitionFile)

// PartitionFile, when a worker has it, holds the commands that cut the
// worker off; its network applies them at each boot.
const PartitionFile = "/etc/vco-lab/partition.sh"

// The worker's files that are the same on every node. Per-node ones (its
// kubelet's credentials, its pod network) are written at boot (joinNode).
func workerFiles() map[string]string {
	mirror := fmt.Sprintf(`["http://%s:%d"]`, HostInGuest, GuestRegistryPort)
	return map[string]string{
		// The CRI writes each sandbox's hosts file from this one.
		"/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
		// No name server: nothing in the lab resolves names.
		"/etc/resolv.conf":                  "# the lab's workers resolve no names\n",
		"/etc/sysctl.d/90-vco-lab-k8s.conf": "net.ipv4.ip_forward = 1\n",
		"/etc/containerd/config.toml": `version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.1"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."registry.k8s.io"]
    endpoint = ` + mirror + `
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."` + PortalHost + `"]
    endpoint = ` + mirror + `
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."` + GuestRegistry + `"]
    endpoint = ` + mirror + `
`,
		"/etc/kubernetes/kubelet.yaml": `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: systemd
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
resolvConf: /etc/resolv.conf
clusterDomain: cluster.local
serializeImagePulls: false
# The workers' disks are small and TCG is slow: no eviction for space,
# and status reported often enough for the scenarios' waits.
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%"}
nodeStatusUpdateFrequency: 5s
`,
		"/usr/local/lib/vco-lab/node-net.sh": nodeNetScript,
		"/etc/systemd/system/vco-lab-node-net.service": `[Unit]
Description=vco-lab worker network (its NIC, the kubernetes service address)
Before=containerd.service kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh /usr/local/lib/vco-lab/node-net.sh

[Install]
WantedBy=multi-user.target
`,
		"/etc/systemd/system/kubelet.service": `[Unit]
Description=kubelet (vco-lab worker)
After=containerd.service vco-agent.socket vco-lab-node-net.service
Wants=containerd.service vco-lab-node-net.service
ConditionPathExists=/etc/kubernetes/kubelet.kubeconfig

[Service]
# KUBELET_EXTRA_ARGS: --cloud-provider=external on a cluster whose node
# addresses the lab sets (Options.ExternalAddresses).
EnvironmentFile=-/etc/default/kubelet
ExecStart=/usr/local/bin/kubelet --config=/etc/kubernetes/kubelet.yaml --kubeconfig=/etc/kubernetes/kubelet.kubeconfig --node-ip=` + NodeIP + ` --node-labels=cloud.whitesky/vco-agent=true --v=1 $KUBELET_EXTRA_ARGS
Restart=always
RestartSec=2s

[Install]
WantedBy=multi-user.target
`,
	}
}

// agentConfig is the agent's configuration when no cloud-init seed writes
// it: what the seed writes, with the location override on.
func agentConfig(location string) string {
	return "socket:\n  path: /run/vco-agent/agent.sock\n  group: vco-agent\nnode:\n  location: \"" + location + "\"\nlog:\n  level: info\n"
}

// nodeUserData is the package's cloud-init seed (packaging/cloud-init/
// user-data.yaml) as a node image would carry it, with its commented
// location override turned on: the workers' vco-agent is configured and
// enabled by cloud-init on first boot, and their cloud.whitesky/location
// comes from it.
func nodeUserData(location string) (string, error) {
	b, err := os.ReadFile(filepath.Join(repoRoot(), "packaging", "cloud-init", "user-data.yaml"))
	if err != nil {
		return "", err
	}
	s := string(b)
	for _, r := range [][2]string{
		{"\n      # node:\n", "\n      node:\n"},
		{"\n      #   location: ch-lug-1\n", "\n        location: \"" + location + "\"\n"},
	} {
		if !strings.Contains(s, r[0]) {
			return "", fmt.Errorf("packaging/cloud-init/user-data.yaml has no line %q to turn the location override on", strings.TrimSpace(r[0]))
		}
		s = strings.Replace(s, r[0], r[1], 1)
	}
	return s, nil
}

// workerForwards are a worker's ways to the host: the API server, the
// registry, the cloud API simulator and the transit engine.
func workerForwards(apiPort, registryPort, cloudPort, transitPort int) []lab.Forward {
	f := []lab.Forward{
		{GuestAddr: fmt.Sprintf("%s:%d", HostInGuest, GuestAPIPort), HostPort: apiPort},
		{GuestAddr: fmt.Sprintf("%s:%d", HostInGuest, GuestRegistryPort), HostPort: registryPort},
		{GuestAddr: fmt.Sprintf("%s:%d", HostInGuest, GuestCloudPort), HostPort: cloudPort},
	}
	if transitPort != 0 {
		f = append(f, lab.Forward{GuestAddr: fmt.Sprintf("%s:%d", HostInGuest, GuestTransitPort), HostPort: transitPort})
	}
	return f
}

// joinNode gives a booted worker its pod network (a bridge of its own)
// and its kubelet's credentials, and enables and starts its network
// (nodeNetScript) and its kubelet, so that a reboot starts both again.
func joinNode(ctx context.Context, g *lab.Guest, cp *controlPlane, index int, external bool) error {
	kc, err := cp.pki.kubeconfig("node-"+g.Name, fmt.Sprintf("https://%s:%d", HostInGuest, GuestAPIPort))
	if err != nil {
		return err
	}
	ca, err := os.ReadFile(cp.pki.path("ca.crt"))
	if err != nil {
		return err
	}
	cni := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "vco-lab",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.%d.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, index)
	files := map[string]string{
		"/etc/kubernetes/kubelet.kubeconfig": kc,
		"/etc/kubernetes/pki/ca.crt":         string(ca),
		"/etc/cni/net.d/10-vco-lab.conflist": cni,
	}
	if external {
		// The node's addresses are left to a cloud controller, which the
		// lab plays (Cluster.setNodeAddresses).
		files["/etc/default/kubelet"] = "KUBELET_EXTRA_ARGS=--cloud-provider=external\n"
	}
	for path, content := range files {
		r, err := g.Exec().RunInput(ctx, 0, []byte(content), "/bin/sh", "-c", fmt.Sprintf("mkdir -p $(dirname %[1]s) && umask 077 && cat >%[1]s", path))
		if err == nil && r.Exit != 0 {
			err = fmt.Errorf("exit %d: %s", r.Exit, strings.TrimSpace(r.Stderr))
		}
		if err != nil {
			return fmt.Errorf("%s: writing %s: %w", g.Name, path, err)
		}
	}
	if _, err := g.MustSh(ctx, "systemctl enable --now vco-lab-node-net.service && systemctl enable --now kubelet.service"); err != nil {
		return fmt.Errorf("%s: joining the cluster: %w", g.Name, err)
	}
	return nil
}

// WaitFor polls f until it returns true, an error, or limit passes.
func WaitFor(ctx context.Context, limit time.Duration, what string, f func() (bool, string, error)) error {
	deadline := time.Now().Add(limit)
	var last string
	for {
		ok, state, err := f()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		last = state
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not after %s (last: %s)", what, limit, last)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w (last: %s)", what, ctx.Err(), last)
		case <-time.After(time.Second):
		}
	}
}
