package simlab

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
)

// Guest paths of the node stack.
const (
	AgentSocket = "/run/vco-agent/agent.sock"
	CSISocket   = "/run/csi/csi.sock"
	KubeletRoot = "/var/lib/kubelet"
	DriverName  = "cloud.whitesky.csi"
	Customer    = "lab"
	Location    = "ch-lug-1"
	// Token is the simulator's only accepted credential. It is a fixed
	// lab value, not a secret of any real API.
	Token = "vco-lab-simulator-token"
)

// StagingPath is where the kubelet has a node plugin stage volume vol:
// a directory of its own under the driver's plugin directory.
func StagingPath(vol string) string {
	h := sha256.Sum256([]byte(vol))
	return fmt.Sprintf("%s/plugins/kubernetes.io/csi/%s/%x/globalmount", KubeletRoot, DriverName, h[:8])
}

// Options shape an Env.
type Options struct {
	// Lab is the lab configuration; its Binaries must include
	// /bin/vco-agent and /bin/vco-csi besides the exec server.
	Lab lab.Config
	// Guests are the node names (default node-a, node-b).
	Guests []string
	// MemMB per guest (default 320).
	MemMB int
	// Kind is how disks are shown (default scsi-block).
	Kind lab.DiskKind
	// NoNodeStack leaves the agent and node plugin out of the guests.
	NoNodeStack bool
	// Boot, if set, boots the guests in place of the lab's busybox
	// guests of Guests (and no node stack is started in them): it is
	// given the simulator's port on 127.0.0.1, for guests that reach it
	// through a forward. Each guest of the lab becomes a VM.
	Boot func(ctx context.Context, l *lab.Lab, apiPort int) error
	// Log receives progress lines (default discarded).
	Log io.Writer
}

// Env is a running simulator in lab mode with its guests.
type Env struct {
	Lab     *lab.Lab
	Backend *Backend
	Sim     *sim.Server
	// APIURL is the simulator's API root; Cloud a client of it.
	APIURL    string
	Cloud     *cloud.Client
	TokenFile string
	// VMs maps guest names to their simulator VM ids.
	VMs map[string]int64

	srv *http.Server
	log io.Writer
	mu  sync.Mutex
}

// Start boots the lab, serves the simulator on 127.0.0.1 with a VM per
// guest (reference_id = the guest's SMBIOS UUID), and starts vco-agent and
// the vco-csi node plugin in each guest.
func Start(ctx context.Context, o Options) (_ *Env, err error) {
	o.setDefaults()
	e := &Env{VMs: map[string]int64{}, log: o.Log}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	e.logf("starting tgtd and building the guests' initramfs in %s", o.Lab.Dir)
	if e.Lab, err = lab.New(ctx, o.Lab); err != nil {
		return nil, err
	}
	e.Backend = &Backend{Lab: e.Lab, Dir: filepath.Join(o.Lab.Dir, "disks"), Kind: o.Kind,
		Logf: func(f string, a ...any) { e.logf(f, a...) }}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer func() {
		if e.srv == nil {
			ln.Close()
		}
	}()
	if err := e.boot(ctx, &o, ln.Addr().(*net.TCPAddr).Port); err != nil {
		return nil, err
	}
	if err := e.startSim(); err != nil {
		return nil, err
	}
	if err := e.serveSim(ln, o.Lab.Dir); err != nil {
		return nil, err
	}
	e.logf("simulator (lab mode) serving %s", e.APIURL)
	if o.NoNodeStack {
		return e, nil
	}
	for _, g := range e.Lab.Guests {
		if err := StartNodeStack(ctx, g); err != nil {
			return nil, err
		}
		e.logf("%s: vco-agent and vco-csi (node) running", g.Name)
	}
	return e, nil
}

// setDefaults fills in the options left zero.
func (o *Options) setDefaults() {
	if len(o.Guests) == 0 {
		o.Guests = []string{"node-a", "node-b"}
	}
	if o.MemMB == 0 {
		o.MemMB = 320
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	if o.Lab.HostTools == nil {
		// util-linux losetup (busybox's lacks --find and offsets): the
		// guest tests map and list a leased disk's data area with it
		// (the agent uses the loop ioctls itself, internal/loopdev).
		o.Lab.HostTools = append(append([]string(nil), lab.DefaultHostTools...), "/usr/sbin/losetup")
	}
}

// boot boots the guests: through o.Boot, given the simulator's port
// (and then without the lab's node stack), or as the lab's own guests.
func (e *Env) boot(ctx context.Context, o *Options, port int) error {
	if o.Boot != nil {
		if err := o.Boot(ctx, e.Lab, port); err != nil {
			return err
		}
		o.NoNodeStack = true
	} else {
		var gcs []lab.GuestConfig
		for _, n := range o.Guests {
			gcs = append(gcs, lab.GuestConfig{Name: n, MemMB: o.MemMB})
		}
		e.logf("booting %s", strings.Join(o.Guests, ", "))
		if _, err := e.Lab.StartGuests(ctx, gcs...); err != nil {
			return err
		}
	}
	return nil
}

// startSim makes the simulator with a VM per guest.
func (e *Env) startSim() error {
	var err error
	e.Sim, err = sim.New(sim.Options{Customer: Customer, Token: Token, Backend: e.Backend,
		Seed:   sim.Seed{Locations: []string{Location, "ch-gen-1"}},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	for _, g := range e.Lab.Guests {
		id, err := e.Sim.AddVM("cs-"+Location, g.Name, g.UUID, false)
		if err != nil {
			return err
		}
		e.VMs[g.Name] = id
	}
	return nil
}

// serveSim serves the simulator on ln, writes its token into dir and
// makes the cloud client the controller uses.
func (e *Env) serveSim(ln net.Listener, dir string) error {
	e.srv = &http.Server{Handler: e.Sim, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = e.srv.Serve(ln) }()
	e.APIURL = "http://" + ln.Addr().String() + "/api/1"
	e.TokenFile = filepath.Join(dir, "sim-token")
	if err := os.WriteFile(e.TokenFile, []byte(Token+"\n"), 0o600); err != nil {
		return err
	}
	var err error
	if e.Cloud, err = cloud.New(cloud.Config{BaseURL: e.APIURL, Customer: Customer, TokenFile: e.TokenFile}); err != nil {
		return err
	}
	return nil
}

func (e *Env) logf(format string, a ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.log, "simlab: "+format+"\n", a...)
}

// StartController serves the vco-csi controller in this process on a
// unix socket in the lab directory and dials it, so controller calls go
// through the same gRPC server (and error-code mapping) as in a cluster.
func (e *Env) StartController() (csi.ControllerClient, func(), error) {
	d, err := driver.New(driver.Config{Name: DriverName, Version: "lab", Mode: driver.ModeController,
		Cloud: e.Cloud, AttachTimeout: 2 * time.Minute})
	if err != nil {
		return nil, nil, err
	}
	sock := filepath.Join(e.Lab.Dir(), "controller.sock")
	_ = os.Remove(sock)
	ln, err := driver.Listen("unix://" + sock)
	if err != nil {
		return nil, nil, err
	}
	srv := d.NewGRPCServer(slog.New(slog.DiscardHandler))
	go func() { _ = srv.Serve(ln) }()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		srv.Stop()
		return nil, nil, err
	}
	return csi.NewControllerClient(conn), func() { conn.Close(); srv.Stop() }, nil
}

// Guest returns the lab guest of the given name.
func (e *Env) Guest(name string) *lab.Guest { return e.Lab.Guest(name) }

// StackOptions change how StartNodeStackWith starts a guest's node stack.
type StackOptions struct {
	// AllowUnfenced is the explicit opt-in, on both the agent
	// (volumes.allow_unfenced) and the node plugin (--allow-unfenced), to
	// stage disks that offer no fencing method. For scenarios that are
	// about something other than fencing on such disks, and only those.
	AllowUnfenced bool
	// Supervise runs the agent under a shell loop that starts it again
	// whenever it exits with a failure, as the packaged unit's
	// Restart=on-failure has systemd do; the busybox guests have no
	// systemd. Each exit status is appended to SupervisorExits.
	Supervise bool
	// VaultAddr and VaultToken point the node plugin at a transit engine
	// (--vault-addr, and a token file holding VaultToken) for encrypted
	// volumes. A plain http VaultAddr to a host that is not a loopback
	// address (TransitGuestAddr) is given with --insecure-allow-http.
	// VaultCA, when set, is the PEM of the CA the engine's certificate
	// chains to (--vault-ca-file).
	VaultAddr, VaultToken string
	VaultCA               []byte
}

// ForEncryption makes o fit for encrypted volumes: the virtio-net module
// ConnectTransit's NIC needs, libgcc_s for cryptsetup (its argon2 threads
// load it at pthread_exit, so copying the tool's linked libraries misses
// it), and 512 MiB per guest, since unlocking LUKS2 with argon2id (64 MiB)
// beside the RAM-backed root gets the agent OOM-killed in the default
// 320 MiB. o.Lab.Binaries must be set.
func ForEncryption(o *Options) {
	mods := o.Lab.Modules
	if mods == nil {
		mods = lab.DefaultModules
	}
	o.Lab.Modules = append(append([]string{}, mods...), "virtio_net")
	const libgcc = "/lib/x86_64-linux-gnu/libgcc_s.so.1"
	o.Lab.Binaries[libgcc] = libgcc
	o.MemMB = max(o.MemMB, 512)
}

// TransitGuestAddr is where a guest given a transit link by
// ConnectTransit reaches the host's transit engine. It is plain http to
// an address that is not a loopback one, which the node plugin takes only
// with --insecure-allow-http: the link is QEMU's restricted user network,
// whose only way out is the forward to the host's 127.0.0.1, so nothing
// travels on a real network.
const TransitGuestAddr = "http://10.0.2.100:8200"

// TransitGuestTLSAddr is TransitGuestAddr for an engine that speaks TLS
// with a certificate for 10.0.2.100 (the lab's Vault server).
const TransitGuestTLSAddr = "https://10.0.2.100:8200"

// ConnectTransit gives g one way out: a virtio-net NIC on QEMU user
// networking with restrict=on (no route anywhere) whose only forward takes
// the guest's connections to 10.0.2.100:8200 to 127.0.0.1:port on the
// host, one `busybox nc` per connection. The guest needs the virtio_net
// module (add it to the lab's Modules).
func ConnectTransit(ctx context.Context, g *lab.Guest, port int) error {
	q := g.QMP()
	fwd := fmt.Sprintf("tcp:10.0.2.100:8200-cmd:busybox nc 127.0.0.1 %d", port)
	if _, err := q.Execute(ctx, "netdev_add", map[string]any{"type": "user", "id": "vco-transit", "restrict": true,
		"net": "10.0.2.0/24", "guestfwd": []map[string]any{{"str": fwd}}}); err != nil {
		return fmt.Errorf("%s: adding the transit link: %w", g.Name, err)
	}
	if _, err := q.Execute(ctx, "device_add", map[string]any{"driver": "virtio-net-pci", "id": "vco-transit-nic", "netdev": "vco-transit", "bus": "pci.0"}); err != nil {
		return fmt.Errorf("%s: adding the transit NIC: %w", g.Name, err)
	}
	script := `i=0; while ! ip link show eth0 >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 300 ] || { echo no eth0; exit 1; }; sleep 0.1; done
ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0`
	if _, err := g.MustSh(ctx, script); err != nil {
		return fmt.Errorf("%s: configuring the transit NIC: %w", g.Name, err)
	}
	return nil
}

// SupervisorExits lists, one a line, the exit statuses of the agents a
// supervised node stack restarted.
const SupervisorExits = "/run/vco-agent/exits"

const supervisorPID = "/run/vco-agent/supervisor.pid"

// StartNodeStack starts vco-agent and the vco-csi node plugin in g, in the
// background of the guest, and waits for both sockets.
func StartNodeStack(ctx context.Context, g *lab.Guest) error {
	return StartNodeStackWith(ctx, g, StackOptions{})
}

// StartNodeStackWith is StartNodeStack with options.
func StartNodeStackWith(ctx context.Context, g *lab.Guest, o StackOptions) error {
	// The lab's guests load no watchdog driver: the agent holds leases
	// without one (watchdog_device: none-unsafe).
	agentArgs, csiArgs := " --config /run/vco-agent/lab.yaml", ""
	if o.AllowUnfenced {
		agentArgs = " --config /run/vco-agent/allow-unfenced.yaml"
		csiArgs = " --allow-unfenced"
	}
	if o.VaultAddr != "" {
		// The token goes in on stdin, so that no command line (which
		// a failure's error text quotes) ever carries it.
		r, err := g.Exec().RunInput(ctx, 0, []byte(o.VaultToken), "/bin/sh", "-c", "mkdir -p /run/csi && umask 077 && cat >/run/csi/vault-token")
		if err == nil && r.Exit != 0 {
			err = fmt.Errorf("exit %d: %s", r.Exit, strings.TrimSpace(r.Stderr))
		}
		if err != nil {
			return fmt.Errorf("%s: writing the Vault token file: %w", g.Name, err)
		}
		csiArgs += " --vault-addr " + o.VaultAddr + " --vault-token-file /run/csi/vault-token"
		if len(o.VaultCA) > 0 {
			r, err := g.Exec().RunInput(ctx, 0, o.VaultCA, "/bin/sh", "-c", "cat >/run/csi/vault-ca.pem")
			if err == nil && r.Exit != 0 {
				err = fmt.Errorf("exit %d: %s", r.Exit, strings.TrimSpace(r.Stderr))
			}
			if err != nil {
				return fmt.Errorf("%s: writing the Vault CA file: %w", g.Name, err)
			}
			csiArgs += " --vault-ca-file /run/csi/vault-ca.pem"
		}
		if u, err := url.Parse(o.VaultAddr); err == nil && cleartext.Clear(u) {
			csiArgs += " " + cleartext.Option
		}
	}
	agent := fmt.Sprintf("/bin/vco-agent serve --dbus=false --location %s --node-name %s --socket %s --kubelet-root %s%s",
		Location, g.Name, AgentSocket, KubeletRoot, agentArgs)
	start := "( " + agent + " >>/var/log/vco-agent.log 2>&1 & )"
	if o.Supervise {
		start = fmt.Sprintf(`cat >/run/vco-agent/supervise.sh <<'EOF'
echo $$ >%[1]s
while :; do
	%[2]s
	rc=$?
	echo $rc >>%[3]s
	[ $rc -eq 0 ] && break
	sleep 0.2
done
EOF
( sh /run/vco-agent/supervise.sh >>/var/log/vco-agent.log 2>&1 & )`, supervisorPID, agent, SupervisorExits)
	}
	script := fmt.Sprintf(`set -e
mkdir -p /run/vco-agent /run/csi /var/lib/vco-agent %[1]s /var/log
printf 'volumes:\n  lease:\n    watchdog_device: none-unsafe\n' >/run/vco-agent/lab.yaml
printf 'volumes:\n  allow_unfenced: true\n  lease:\n    watchdog_device: none-unsafe\n' >/run/vco-agent/allow-unfenced.yaml
%[7]s
i=0; while [ ! -S %[4]s ]; do i=$((i+1)); [ $i -lt 300 ] || { cat /var/log/vco-agent.log; exit 1; }; sleep 0.1; done
( /bin/vco-csi --mode=node --driver-name %[5]s --endpoint unix://%[6]s --agent-socket %[4]s --kubelet-root %[1]s%[8]s >>/var/log/vco-csi.log 2>&1 & )
i=0; while [ ! -S %[6]s ]; do i=$((i+1)); [ $i -lt 300 ] || { cat /var/log/vco-csi.log; exit 1; }; sleep 0.1; done
`, KubeletRoot, Location, g.Name, AgentSocket, DriverName, CSISocket, start, csiArgs)
	if _, err := g.MustSh(ctx, script); err != nil {
		return fmt.Errorf("starting the node stack in %s: %w", g.Name, err)
	}
	return nil
}

// StopNodeStack stops g's vco-agent and vco-csi (SIGTERM, as systemd
// stops them) and removes their sockets, so the next start waits for
// fresh ones.
func StopNodeStack(ctx context.Context, g *lab.Guest) error {
	script := fmt.Sprintf(`if [ -f %[3]s ]; then kill $(cat %[3]s) 2>/dev/null; rm -f %[3]s; fi
for p in $(pidof vco-csi vco-agent); do kill $p; done
i=0; while pidof vco-csi vco-agent >/dev/null; do i=$((i+1)); [ $i -lt 300 ] || { echo still running: $(pidof vco-csi vco-agent); exit 1; }; sleep 0.1; done
rm -f %[1]s %[2]s`, AgentSocket, CSISocket, supervisorPID)
	if _, err := g.MustSh(ctx, script); err != nil {
		return fmt.Errorf("stopping the node stack in %s: %w", g.Name, err)
	}
	return nil
}

// Close stops the simulator's server and the lab.
func (e *Env) Close() error {
	var errs []error
	if e.srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, e.srv.Shutdown(sctx))
		cancel()
	}
	if e.Lab != nil {
		errs = append(errs, e.Lab.Close())
	}
	return errors.Join(errs...)
}

// Event is one agent event as `vco-agent events --json` prints it.
type Event struct {
	Node       string    `json:"node"`
	Type       string    `json:"type"`
	Sequence   string    `json:"sequence"`
	Time       time.Time `json:"time"`
	Volume     string    `json:"volume"`
	Device     string    `json:"device"`
	Serial     string    `json:"serial"`
	HolderKey  string    `json:"holder_key"`
	HolderNode string    `json:"holder_node"`
	Reason     string    `json:"reason"`
	Message    string    `json:"message"`
}

// Name is the event's short name: DiskRefused for EVENT_TYPE_DISK_REFUSED.
func (ev Event) Name() string {
	s := strings.TrimPrefix(ev.Type, "EVENT_TYPE_")
	var b strings.Builder
	for _, w := range strings.Split(strings.ToLower(s), "_") {
		if w != "" {
			b.WriteString(strings.ToUpper(w[:1]) + w[1:])
		}
	}
	return b.String()
}

// Events runs `vco-agent events --json` in g and returns what the agent
// keeps of its recent events.
func Events(ctx context.Context, g *lab.Guest) ([]Event, error) {
	r, err := g.Run(ctx, "/bin/vco-agent", "events", "--json", "--socket", AgentSocket)
	if err != nil {
		return nil, err
	}
	if r.Exit != 0 {
		return nil, fmt.Errorf("%s: vco-agent events: %s", g.Name, r)
	}
	var out []Event
	for _, line := range strings.Split(r.Stdout, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		var ev Event
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			return nil, fmt.Errorf("%s: vco-agent events printed %q: %w", g.Name, line, err)
		}
		ev.Node = g.Name
		out = append(out, ev)
	}
	return out, nil
}
