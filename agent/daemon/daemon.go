// Package daemon runs `vco-agent serve`: it reads the node's identity,
// opens the API socket (handed over by systemd, or created here), wires the
// event bus to its sinks, serves the gRPC API, and speaks the sd_notify
// protocol (READY, STATUS, WATCHDOG, STOPPING) so that systemd knows when
// the agent is really up. While it holds an on-disk lease it keeps a host
// watchdog armed (package agent/watchdog). It stops on SIGTERM or SIGINT and
// leaves nothing behind: no socket it created, no directory it created, no
// goroutine; only a host watchdog stays armed while leases are still held.
package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/dbussignal"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/fencecaps"
	"github.com/whitesky-cloud/vco-storage/agent/logging"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/agent/server"
	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/location"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

// ActivationName is the FileDescriptorName= of the API socket in
// vco-agent.socket.
const ActivationName = "api"

// stopTimeout bounds how long open calls may delay the exit after SIGTERM.
const stopTimeout = 5 * time.Second

// Main is `vco-agent serve`: it parses args, runs the agent until SIGTERM
// or SIGINT, and returns the exit code. Errors are printed to stderr.
func Main(args []string, version string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	flags := config.RegisterFlags(fs)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: vco-agent serve [flags]\n\nRuns the agent daemon (normally started by systemd).\n\nflags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vco-agent serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	cfg, err := flags.Load()
	if err != nil {
		fmt.Fprintf(stderr, "vco-agent: %v\n", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := Run(ctx, Options{Config: cfg, Version: version, Stderr: stderr}); err != nil {
		fmt.Fprintf(stderr, "vco-agent: %v\n", err)
		notify("STATUS=failed: " + oneLine(err.Error()))
		return 1
	}
	return 0
}

// Options are what Run needs besides the configuration.
type Options struct {
	Config  config.Config
	Version string
	// Stderr receives the text log when stderr is not the journal.
	Stderr io.Writer
}

// Run serves until ctx ends, then stops gracefully.
func Run(ctx context.Context, o Options) error {
	cfg := o.Config
	if o.Stderr == nil {
		o.Stderr = os.Stderr
	}
	level, err := cfg.SlogLevel()
	if err != nil {
		return err
	}
	log, toJournal := logging.New(level, o.Stderr)
	logMode := "text"
	if toJournal {
		logMode = "journal"
	}
	started := time.Now()

	notify("STATUS=reading the node identity under " + cfg.SysfsRoot)
	ident, err := readIdentity(cfg)
	if err != nil {
		return err
	}
	policy, err := socketPolicy(cfg.Socket.Group)
	if err != nil {
		return err
	}
	sock, err := openSocket(cfg.Socket, policy)
	if err != nil {
		return err
	}
	defer sock.cleanup()

	bus := events.NewBus(cfg.Events.RingSize, cfg.Events.SubscriberBuffer, log)
	bus.AddSink(logging.EventSink(log, toJournal))
	rt := server.Runtime{SocketActivated: sock.activated, SocketPath: sock.path}
	defer connectDBus(ctx, cfg, bus, log, &rt)()

	notify("STATUS=re-verifying recorded volume claims")
	gid := -1
	if policy.GID >= 0 {
		gid = int(policy.GID)
	}
	vols, err := startVolumes(ctx, cfg, ident, bus, log, cfg.Metrics.MetricsSocket(sock.path), gid)
	if err != nil {
		return err
	}
	defer vols.close()
	rt.Watchdog = vols.wd.Status

	srv := server.New(server.Options{Version: o.Version, Identity: ident, Bus: bus, Started: started, Runtime: rt, Log: log, Policy: policy, Volumes: vols.m})
	g := srv.NewGRPC()
	served := make(chan error, 1)
	go func() { served <- g.Serve(sock.l) }()

	announceReady(log, o.Version, sock, ident, rt.DBusDetail, logMode, vols.metricsProblem, bus)

	wdDone := make(chan struct{})
	wdStopped := startWatchdog(log, wdDone, func() { bus.Stats() })

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-served:
		if serveErr != nil {
			serveErr = fmt.Errorf("the API server on %s stopped: %w", sock.path, serveErr)
		}
	}

	notify("STOPPING=1\nSTATUS=stopping")
	log.Info("vco-agent stopping")
	close(wdDone)
	<-wdStopped
	stopServing(log, g, bus, vols, ident.NodeName)
	log.Info("vco-agent stopped")
	return serveErr
}

// stopServing ends the agent's work in the order that loses nothing: the
// claim checks stop before the bus closes, so that no loss found during
// shutdown goes unannounced; the bus closes, which ends the WatchEvents
// streams so that the API server's graceful stop can finish; calls still
// open after stopTimeout are closed.
func stopServing(log *slog.Logger, g *grpc.Server, bus *events.Bus, vols *volumes, node string) {
	vols.stopChecks()
	bus.Publish(events.Event{Type: events.AgentStopping, Message: "vco-agent stopping on node " + node})
	bus.Close()
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(stopTimeout):
		log.Warn("API calls still open after the stop timeout; closing them", "timeout", stopTimeout)
		g.Stop()
		<-stopped
	}
}

// connectDBus adds the D-Bus signal sink to bus when the configuration
// asks for it, says in rt how that went, and returns what closes it. A bus
// that cannot be reached is not fatal: the journal and the API stream
// still carry every event.
func connectDBus(ctx context.Context, cfg config.Config, bus *events.Bus, log *slog.Logger, rt *server.Runtime) (closeIt func()) {
	if !cfg.DBus.Enabled {
		rt.DBusDetail = "disabled in the configuration"
		return func() {}
	}
	notify("STATUS=connecting to D-Bus")
	ds, err := dbussignal.Connect(ctx, cfg.DBus.Address)
	if err != nil {
		rt.DBusDetail = err.Error()
		log.Warn("D-Bus event signals are off; the journal and the API stream still carry every event", "err", err)
		return func() {}
	}
	bus.AddSink(ds)
	rt.DBusConnected = true
	rt.DBusDetail = "connected to " + ds.Address
	if !ds.OwnsName {
		rt.DBusDetail += ", without the name " + dbussignal.BusName
		log.Warn("the bus did not give the agent its name; signals go out from its unique name", "name", dbussignal.BusName,
			"hint", "install the D-Bus policy cloud.whitesky.VcoAgent1.conf and check that no other agent runs")
	}
	return func() { ds.Close() }
}

// announceReady logs that the agent serves, tells systemd it is ready
// (with the problems an operator should see in its status line) and
// publishes AgentStarted.
func announceReady(log *slog.Logger, version string, sock *apiSocket, ident server.NodeIdentity, dbus, logMode, metricsProblem string, bus *events.Bus) {
	how := "created by the agent"
	if sock.activated {
		how = "from systemd socket activation"
	}
	log.Info("vco-agent serving", "version", version, "socket", sock.path, "socket_origin", how, "node", ident.NodeName,
		"system_uuid", ident.SystemUUID, "identity_source", ident.Source, "log", logMode, "dbus", dbus)
	status := fmt.Sprintf("serving on %s (node %s, SMBIOS UUID %s)", sock.path, ident.NodeName, ident.SystemUUID)
	if msg, bad := LocationProblem(ident.Location); bad {
		log.Error(msg, "location", ident.Location)
		status += "; " + msg
	} else {
		log.Info(msg, "location", ident.Location)
	}
	if metricsProblem != "" {
		status += "; " + metricsProblem
	}
	notify("READY=1\nSTATUS=" + oneLine(status))
	bus.Publish(events.Event{Type: events.AgentStarted, Message: fmt.Sprintf("vco-agent %s serving on %s for node %s", version, sock.path, ident.NodeName)})
}

type volumes struct {
	m  *volume.Manager
	wd *watchdog.Watchdog
	// metricsProblem says why metrics.listen is not served; empty when
	// it is, or when it is off.
	metricsProblem string
	// stopChecks ends the periodic claim check, the host watchdog's
	// feeding and the metrics listener; close (after the API has stopped)
	// also leaves the host watchdog as the held leases need it
	// (watchdog.Stop) and closes the devices.
	stopChecks, close func()
}

// hostWatchdog is the watchdog armed while a lease is held, guarding the
// leases leases lists. Its Linger covers a stage's acquisition, which may
// wait out another holder's expiry bound before the lease is held.
func hostWatchdog(cfg config.Config, leases func() []watchdog.Lease, log *slog.Logger) *watchdog.Watchdog {
	lt := cfg.Volumes.Lease
	t := lt.Timing()
	return watchdog.New(watchdog.Config{Device: lt.WatchdogDevice, Timeout: lt.Watchdog, Leases: leases,
		Linger: t.Expiry() + t.Settle() + 3*t.IOTimeout,
		Find: func(want string) (watchdog.Info, error) {
			return watchdog.Find(cfg.SysfsRoot, cfg.Volumes.DevRoot, want)
		},
		Active: func(want string) (watchdog.Info, bool) {
			return watchdog.FindActive(cfg.SysfsRoot, cfg.Volumes.DevRoot, want)
		},
		Log: log.With("part", "host-watchdog")})
}

// guarded arms the host watchdog before a stage takes a lease (the
// factory's Prepare runs before its first Acquire): a lease is never
// taken on a host that cannot be reset within W, unless the
// configuration says so (watchdog.Unsafe).
func guarded(wd *watchdog.Watchdog, f volume.LeaseFactory) volume.LeaseFactory {
	return func(ctx context.Context, dev *volume.Device, vol string, onLost func(*fence.LostError) bool) (volume.Choice, error) {
		ch, err := f(ctx, dev, vol, onLost)
		if err != nil || ch.Fencer == nil {
			return ch, err
		}
		prepare := ch.Prepare
		ch.Prepare = func(ctx context.Context) (bool, error) {
			if err := wd.Ready(ctx); err != nil {
				return false, err
			}
			if prepare == nil {
				return false, nil
			}
			return prepare(ctx)
		}
		return ch, nil
	}
}

// startVolumes opens the claim store, re-verifies every recorded claim,
// and starts the periodic claim check and, when configured, the metrics
// listener.
func startVolumes(ctx context.Context, cfg config.Config, ident server.NodeIdentity, bus *events.Bus, log *slog.Logger, metricsSock string, gid int) (*volumes, error) {
	// mount-utils logs through klog; its lines join the agent's own log.
	klog.SetSlogLogger(log.With("part", "mount"))
	key, err := fence.KeyFromUUID(ident.SystemUUID)
	if err != nil {
		return nil, fmt.Errorf("deriving this node's fence key from its SMBIOS UUID: %w", err)
	}
	// The watchdog asks the manager for its leases once it runs, after
	// the manager is made.
	var m *volume.Manager
	wd := hostWatchdog(cfg, func() []watchdog.Lease { return m.Leases() }, log)
	m, err = volume.New(volume.Options{
		Config: cfg.Volumes, StateDir: cfg.StateDir, SysfsRoot: cfg.SysfsRoot, Bus: bus, Log: log.With("part", "volumes"),
		Fencers: &volume.Fencing{Key: key, Node: ident.SystemUUID, Log: log.With("part", "fence"), Use: cfg.Volumes.Uses,
			Lease: leaseFor(cfg.Volumes, guarded(wd, volume.NewLease(volume.LeaseOptions{Key: key, Node: ident.SystemUUID, NodeName: ident.NodeName,
				Timing: cfg.Volumes.Lease.Timing(), Log: log.With("part", "lease")})))},
		Crypt: &volume.LUKS{},
	})
	if err != nil {
		return nil, err
	}
	m.Metrics().Registry().MustRegister(wd.Collector(), leaseRenewalCollector{m.Leases})
	// The leases an earlier process held stop the feeding until the
	// start-up check below has seen each one renewed.
	m.ExpectRecordedLeases()
	// A device the last agent process left counting down is noted, not
	// opened: the watchdog's first tick whose leases allow a feed (each
	// recorded lease resumed and renewing, or none recorded) takes it
	// over, so a host that holds none is not reset for a crash of the
	// agent, and one whose leases this process cannot resume runs out the
	// countdown the earlier process left.
	wd.Adopt()
	wctx, wcancel := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { defer close(wdone); wd.Run(wctx) }()
	m.Reconcile(ctx)
	srv, metricsProblem := serveMetrics(cfg.Metrics.Listen, m, log)
	closeSock := serveMetricsSocket(metricsSock, gid, m, log)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); m.Run(cctx) }()
	watched := make(chan struct{})
	if cfg.Volumes.WatchDisks {
		// Ready comes after the watcher's scan of the disks already
		// attached, so a disk held elsewhere is read-only before READY=1.
		w := &uevent.Watcher{Classify: m.Classify, OnDecision: m.Refused, OnRemove: m.Removed,
			Match: watchMatch(cfg.Volumes.AllowLoopDevices), Logger: log.With("part", "uevent"),
			SysfsRoot: cfg.SysfsRoot, Rescan: cfg.Volumes.WatchRescan, Serialize: m.WatchLock()}
		go func() {
			defer close(watched)
			if err := w.Run(cctx); err != nil {
				log.Error("the disk watcher stopped: disks held elsewhere are refused only when a stage asks for them", "err", err)
			}
		}()
		select {
		case <-w.Ready():
		case <-watched:
		}
	} else {
		close(watched)
	}
	var once sync.Once
	stopChecks := func() {
		once.Do(func() {
			cancel()
			<-done
			<-watched
			wcancel()
			<-wdone
			if srv != nil {
				srv.Close()
			}
			closeSock()
		})
	}
	// The watchdog decides on the leases before the manager closes their
	// fencers, which ends their renewals.
	return &volumes{m: m, wd: wd, metricsProblem: metricsProblem, stopChecks: stopChecks, close: func() { stopChecks(); wd.Stop(); m.Close() }}, nil
}

// serveMetrics starts the /metrics listener when metrics.listen is set. A
// listener that cannot start (the address taken, or IP sockets denied by a
// unit without the loopback permission) is logged and skipped: metrics are
// an aid, and an agent that exits over them would take every volume on the
// node down with it (docs/events.md#metrics). The returned sentence says
// what went wrong, for the systemd status line; it is empty when all is well.
func serveMetrics(listen string, m *volume.Manager, log *slog.Logger) (*http.Server, string) {
	if listen == "" {
		return nil, ""
	}
	l, err := net.Listen("tcp", listen)
	if err != nil {
		problem := fmt.Sprintf("metrics off: cannot listen on metrics.listen %s: %v", listen, err)
		log.Error("the metrics listener did not start; the agent serves volumes without it", "address", listen, "err", err,
			"hint", "free the address or pick another in metrics.listen; under systemd check that the unit allows loopback IP sockets (RestrictAddressFamilies=, IPAddressAllow=), then restart the agent")
		return nil, problem
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Metrics().Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(l)
	log.Info("metrics served", "address", l.Addr().String())
	return srv, ""
}

// serveMetricsSocket serves /metrics on a unix socket, mode 0660 with the
// API socket's group, which the node plugin reads and re-exports to the
// cluster's Prometheus (docs/monitoring.md): no IP socket on the host is
// needed for that. As with metrics.listen, a socket that cannot be made is
// logged and skipped. It returns what closes it and removes its file.
func serveMetricsSocket(path string, gid int, m *volume.Manager, log *slog.Logger) func() {
	if path == "" {
		return func() {}
	}
	skip := func(err error) func() {
		log.Error("the metrics socket was not made; the node plugin cannot re-export this agent's metrics", "path", path, "err", err,
			"hint", "set metrics.socket to a path in a directory the agent may write, or off")
		return func() {}
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != fs.ModeSocket {
			return skip(fmt.Errorf("%s exists and is not a socket", path))
		}
		// A stale socket of an earlier run: the agent is the only server.
		if err := os.Remove(path); err != nil {
			return skip(err)
		}
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return skip(err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		l.Close()
		return skip(err)
	}
	if err := os.Chown(path, -1, gid); err != nil {
		l.Close()
		return skip(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Metrics().Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(l)
	log.Info("metrics served", "socket", path)
	return func() {
		srv.Close()
		os.Remove(path)
	}
}

// leaseRenewalCollector reports how old the least recently renewed lease
// is, against its fail bound: an alert on the ratio warns before the
// claim is lost (F) and the host watchdog stops being fed (F - d).
type leaseRenewalCollector struct{ leases func() []watchdog.Lease }

var (
	descRenewalAge = prometheus.NewDesc("vco_agent_lease_oldest_renewal_seconds",
		"Age of the least recently renewed lease this agent holds (0 when it holds none); a lease is renewed every volumes.lease.renew.", nil, nil)
	descRenewalFail = prometheus.NewDesc("vco_agent_lease_fail_bound_seconds",
		"The fail bound F of that lease: it is lost when its renewal is this old.", nil, nil)
)

func (leaseRenewalCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descRenewalAge
	ch <- descRenewalFail
}

func (c leaseRenewalCollector) Collect(ch chan<- prometheus.Metric) {
	var age, fail time.Duration
	for _, l := range c.leases() {
		if l.Fenced || l.Renewed.IsZero() {
			continue
		}
		if a := time.Since(l.Renewed); a > age {
			age, fail = a, l.Fail
		}
	}
	ch <- prometheus.MustNewConstMetric(descRenewalAge, prometheus.GaugeValue, age.Seconds())
	ch <- prometheus.MustNewConstMetric(descRenewalFail, prometheus.GaugeValue, fail.Seconds())
}

func notify(state string) {
	// Without NOTIFY_SOCKET this is a no-op; errors are not actionable here.
	_, _ = sddaemon.SdNotify(false, state)
}

// startWatchdog pings systemd at half the interval it asked for. Before
// each ping it runs alive, which blocks if the agent's core is wedged (the
// event bus's lock held forever): then the pings stop and systemd restarts
// the agent.
func startWatchdog(log *slog.Logger, done <-chan struct{}, alive func()) <-chan struct{} {
	stopped := make(chan struct{})
	interval, err := sddaemon.SdWatchdogEnabled(false)
	if err != nil {
		log.Warn("ignoring a malformed systemd watchdog setting", "err", err)
	}
	if interval <= 0 {
		close(stopped)
		return stopped
	}
	log.Debug("systemd watchdog on", "interval", interval, "ping_every", interval/2)
	go func() {
		defer close(stopped)
		t := time.NewTicker(interval / 2)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				alive()
				notify("WATCHDOG=1")
			}
		}
	}()
	return stopped
}

func readIdentity(cfg config.Config) (server.NodeIdentity, error) {
	root := cfg.SysfsRoot
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		if err == nil {
			err = errors.New("not a directory")
		}
		return server.NodeIdentity{}, fmt.Errorf("sysfs root %s is not usable (%v): mount sysfs there or point --sysfs-root / sysfs_root at it", root, unwrapPath(err))
	}
	info, err := smbios.Read(root)
	if err != nil {
		return server.NodeIdentity{}, fmt.Errorf("cannot read this node's SMBIOS identity under %s, which the agent needs to derive its fence keys: %w", root, err)
	}
	return server.NodeIdentity{
		SystemUUID: info.UUID, Manufacturer: info.Manufacturer, ProductName: info.ProductName,
		Serial: info.Serial, SMBIOSVersion: info.SMBIOSVersion, Source: info.Source,
		NodeName: cfg.Node.Name, Location: cfg.Node.Location,
		Fencing: func() []fencecaps.Capability { return fencecaps.Detect(root) },
	}, nil
}

// LocationProblem says in a sentence what the node's configured location
// means for its topology, and whether the node cannot be ready with it: a
// placeholder left from the cloud-init template (or any value that is no
// location) makes the node plugin's NodeGetInfo fail, so the node is never
// labelled with it (docs/agent.md, node.location).
func LocationProblem(loc string) (string, bool) {
	if loc == "" {
		return "node.location is not set: the node plugin takes this node's location from the controller's map of VMs to locations", false
	}
	if err := location.Check(loc); err != nil {
		return fmt.Sprintf("node.location %v: this node is not ready for volumes (the node plugin refuses to register it); remove node.location from the configuration, so that the node takes its VM's location from the controller, or set it to that location, and restart vco-agent", err), true
	}
	return "node.location is set: the node plugin checks that it agrees with the controller's map of VMs to locations", false
}

func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

func socketPolicy(group string) (peercred.Policy, error) {
	if group == "" {
		return peercred.Policy{GID: -1}, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		if _, nerr := strconv.Atoi(group); nerr == nil {
			g, err = user.LookupGroupId(group)
		}
	}
	if err != nil {
		return peercred.Policy{}, fmt.Errorf("socket.group %q does not exist on this host: create it (groupadd %s) or change socket.group", group, group)
	}
	gid, err := strconv.ParseInt(g.Gid, 10, 64)
	if err != nil {
		return peercred.Policy{}, fmt.Errorf("group %s has a non-numeric gid %q", group, g.Gid)
	}
	return peercred.Policy{GID: gid, GroupName: g.Name}, nil
}

type apiSocket struct {
	l         net.Listener
	path      string
	activated bool
	cleanup   func()
}

// openSocket takes the socket systemd passed as "api", or creates one.
func openSocket(c config.Socket, p peercred.Policy) (*apiSocket, error) {
	named, err := activation.ListenersWithNames()
	if err != nil {
		return nil, fmt.Errorf("taking the sockets systemd passed: %w", err)
	}
	if len(named) > 0 {
		ls := named[ActivationName]
		if len(ls) != 1 {
			var names []string
			for n := range named {
				names = append(names, n)
			}
			return nil, fmt.Errorf("systemd passed sockets named %s but not exactly one named %q: set FileDescriptorName=%s in vco-agent.socket",
				strings.Join(names, ", "), ActivationName, ActivationName)
		}
		for n, extra := range named {
			if n != ActivationName {
				for _, l := range extra {
					l.Close()
				}
			}
		}
		path := ls[0].Addr().String()
		return &apiSocket{l: ls[0], path: path, activated: true, cleanup: func() {}}, nil
	}
	return createSocket(c.Path, p)
}

func createSocket(path string, p peercred.Policy) (*apiSocket, error) {
	dir := filepath.Dir(path)
	gid := -1
	if p.GID >= 0 {
		gid = int(p.GID)
	}
	var madeDir bool
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("creating the socket directory %s: %w", dir, err)
		}
		madeDir = true
		if err := os.Chmod(dir, 0o750); err != nil {
			return nil, err
		}
		if err := os.Chown(dir, -1, gid); err != nil {
			return nil, fmt.Errorf("giving %s to group %s: %w", dir, p.GroupName, err)
		}
	}
	removeDir := func() {
		if madeDir {
			os.Remove(dir)
		}
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != fs.ModeSocket {
			removeDir()
			return nil, fmt.Errorf("%s exists and is not a socket: move it away or set socket.path", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			removeDir()
			return nil, fmt.Errorf("another process already serves %s: stop it (systemctl stop vco-agent) or set socket.path", path)
		}
		// A socket nobody answers on is left over from a crash.
		if err := os.Remove(path); err != nil {
			removeDir()
			return nil, fmt.Errorf("removing the stale socket %s: %w", path, err)
		}
	}
	// The umask closes the window between bind and chmod in which the
	// socket would have the process's default mode.
	old := syscall.Umask(0o117)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		removeDir()
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	l.SetUnlinkOnClose(true)
	fail := func(err error) (*apiSocket, error) {
		l.Close()
		removeDir()
		return nil, err
	}
	if err := os.Chmod(path, 0o660); err != nil {
		return fail(fmt.Errorf("chmod %s: %w", path, err))
	}
	if err := os.Chown(path, -1, gid); err != nil {
		return fail(fmt.Errorf("giving %s to group %s: %w", path, p.GroupName, err))
	}
	return &apiSocket{l: l, path: path, cleanup: func() {
		l.Close() // unlinks the socket
		os.Remove(path)
		removeDir()
	}}, nil
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

// watchMatch selects the disks the uevent watcher checks: whole disks,
// not the agent's own stacking (loop data mappings, dm-crypt) nor RAM
// disks; loop devices only where the configuration admits them as disks.
func watchMatch(loops bool) func(uevent.Event) bool {
	return func(ev uevent.Event) bool {
		if !ev.Disk() {
			return false
		}
		for _, p := range []string{"dm-", "ram", "zram", "sr", "md", "nbd"} {
			if strings.HasPrefix(ev.DevName, p) {
				return false
			}
		}
		return loops || !strings.HasPrefix(ev.DevName, "loop")
	}
}

// leaseFor keeps loop devices (single-host simulator and test disks) off
// the lease unless the configuration asks for it.
func leaseFor(cfg config.Volumes, f volume.LeaseFactory) volume.LeaseFactory {
	if cfg.LeaseLoopDevices {
		return f
	}
	return func(ctx context.Context, dev *volume.Device, vol string, onLost func(*fence.LostError) bool) (volume.Choice, error) {
		if strings.HasPrefix(dev.Name, "loop") {
			return volume.Choice{Method: fence.MethodNone,
				Reason: "the on-disk lease is off for loop devices (volumes.lease_loop_devices)"}, nil
		}
		return f(ctx, dev, vol, onLost)
	}
}
