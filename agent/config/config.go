// Package config is the vco-agent's configuration: one YAML file in which
// every field has a default, plus command-line flags that override it. Later
// capabilities (fencing, claim checks, mounts) add their own section: a
// struct field of Config with a yaml tag, its defaults in Default, its
// checks in Validate, a line in example.yaml, and flags only where an
// operator needs them on the command line.
package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/whitesky-cloud/vco-storage/agent/watchdog"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// DefaultPath is where the packaged agent looks for its configuration.
const DefaultPath = "/etc/vco-agent/config.yaml"

// Config is the whole agent configuration. The YAML keys are the `yaml` tags.
type Config struct {
	Socket    Socket  `yaml:"socket"`
	Node      Node    `yaml:"node"`
	StateDir  string  `yaml:"state_dir"`
	SysfsRoot string  `yaml:"sysfs_root"`
	Log       Log     `yaml:"log"`
	DBus      DBus    `yaml:"dbus"`
	Events    Events  `yaml:"events"`
	Volumes   Volumes `yaml:"volumes"`
	Metrics   Metrics `yaml:"metrics"`
}

// Volumes controls how the agent stages volumes for the CSI node plugin.
type Volumes struct {
	// KubeletRoot is the only directory under which staging and target
	// paths may lie.
	KubeletRoot string `yaml:"kubelet_root"`
	// DevRoot is where device nodes live.
	DevRoot string `yaml:"dev_root"`
	// CheckInterval is how often every claim is checked (reservation still
	// ours, device still there).
	CheckInterval time.Duration `yaml:"check_interval"`
	// ReclaimWait is how long a stage without a grant waits before it
	// claims a SCSI disk that holds data but whose target shows no
	// registration since it started: what a target that restarted and
	// forgot its holder's claim looks like. The holder re-establishes its
	// claim at its next check, so the wait must be longer than the
	// holders' check interval; 0 (the default) means three times this
	// agent's, assuming every node runs the same configuration.
	ReclaimWait time.Duration `yaml:"reclaim_wait"`
	// AttachWait is how long a stage waits for a disk that is not there
	// yet: the controller's attach has returned while the hot-plug is
	// still under way in this VM. Past it the stage answers NOT_FOUND and
	// the kubelet retries with its backoff; 0 answers at once.
	AttachWait time.Duration `yaml:"attach_wait"`
	// AllowUnfenced lets a stage request that asks for it use a disk that
	// offers no fencing method. Without it such a disk is refused.
	AllowUnfenced bool `yaml:"allow_unfenced"`
	// FenceMethods are the fencing methods this agent claims disks with,
	// of scsi-pr and disk-lease (both by default); or none: every disk is
	// then one that offers no fencing, staged only by the unfenced opt-in
	// (AllowUnfenced), e.g. the reference of the cluster benchmarks.
	// The watcher reads another node's claim by every method
	// regardless; a stage without the lease refuses a disk that
	// carries a lease area.
	FenceMethods []fence.Method `yaml:"fence_methods"`
	// AllowLoopDevices lets a locator name a loop device by its backing
	// file: for the simulator's host mode and host tests, never on a node.
	AllowLoopDevices bool `yaml:"allow_loop_devices"`
	// LeaseLoopDevices fences loop devices (admitted by
	// allow_loop_devices: single-host simulator and test disks) with the
	// on-disk lease too; off, they are staged only by the unfenced opt-in.
	LeaseLoopDevices bool `yaml:"lease_loop_devices"`
	// Lease is the timing of the on-disk lease that fences disks without
	// SCSI-3 reservations (docs/fencing.md states each bound).
	Lease LeaseTiming `yaml:"lease"`
	// ClaimedDir is where the agent marks the disks it has claimed for
	// the packaged udev rules, which hide unclaimed data disks; empty
	// turns the marks off.
	ClaimedDir string `yaml:"claimed_dir"`
	// WatchDisks runs the uevent watcher that refuses a disk held by
	// another node the moment it appears, and at start every disk
	// already attached.
	WatchDisks bool `yaml:"watch_disks"`
	// WatchRescan is how often the watcher classifies every attached disk
	// again, catching a disk another node took since (no uevent says so).
	WatchRescan time.Duration `yaml:"watch_rescan"`
}

// Uses reports whether the agent claims disks with method m.
func (v Volumes) Uses(m fence.Method) bool { return slices.Contains(v.FenceMethods, m) }

// validateFenceMethods checks fence_methods: scsi-pr and disk-lease, each
// once, or none alone.
func (v Volumes) validateFenceMethods() []error {
	ms := v.FenceMethods
	if len(ms) == 1 && ms[0] == fence.MethodNone {
		return nil
	}
	if len(ms) == 0 {
		return []error{errors.New("volumes.fence_methods is empty: name scsi-pr, disk-lease or both, or none to stage only by the unfenced opt-in")}
	}
	var errs []error
	for i, m := range ms {
		switch {
		case m != fence.MethodPR && m != fence.MethodLease:
			errs = append(errs, fmt.Errorf("volumes.fence_methods: %q is not a fencing method: scsi-pr, disk-lease, or none alone", m))
		case slices.Contains(ms[:i], m):
			errs = append(errs, fmt.Errorf("volumes.fence_methods names %s twice", m))
		}
	}
	return errs
}

// ReclaimAfter is the effective ReclaimWait.
func (v Volumes) ReclaimAfter() time.Duration {
	if v.ReclaimWait == 0 {
		return 3 * v.CheckInterval
	}
	return v.ReclaimWait
}

// LeaseTiming is lease.Timing in the configuration's units, and the host
// watchdog that makes its W true.
type LeaseTiming struct {
	IOTimeout time.Duration `yaml:"io_timeout"`
	Renew     time.Duration `yaml:"renew"`
	Fail      time.Duration `yaml:"fail"`
	Watchdog  time.Duration `yaml:"watchdog"`
	// WatchdogDevice is the host watchdog armed while a lease is held:
	// "auto" (a hardware one, else softdog), a device path, or
	// "none-unsafe" to hold leases without one (package agent/watchdog).
	WatchdogDevice string `yaml:"watchdog_device"`
}

// Timing is the lease package's form.
func (t LeaseTiming) Timing() lease.Timing {
	return lease.Timing{IOTimeout: t.IOTimeout, Renew: t.Renew, Fail: t.Fail, Watchdog: t.Watchdog}
}

// Metrics is the optional Prometheus endpoint.
type Metrics struct {
	// Listen is a loopback host:port to serve /metrics on; empty is off.
	Listen string `yaml:"listen"`
	// Socket is a unix socket serving the same /metrics, 0660 with the
	// API socket's group, for the node plugin to re-export in the cluster
	// (docs/monitoring.md). Empty: metrics.sock beside the API socket;
	// "off": none.
	Socket string `yaml:"socket"`
}

// MetricsOff turns Metrics.Socket off.
const MetricsOff = "off"

// MetricsSocket is where the metrics socket goes for an API socket at
// apiSocket: "" when it is off.
func (m Metrics) MetricsSocket(apiSocket string) string {
	switch m.Socket {
	case MetricsOff:
		return ""
	case "":
		return filepath.Join(filepath.Dir(apiSocket), "metrics.sock")
	}
	return m.Socket
}

// Socket is the API's unix socket. Under socket activation systemd owns the
// socket's path and mode; Group still decides who may call.
type Socket struct {
	Path string `yaml:"path"`
	// Group may call the API besides root. Empty means root only.
	Group string `yaml:"group"`
}

// Node names this host to the rest of the cluster.
type Node struct {
	// Name defaults to the host name.
	Name string `yaml:"name"`
	// Location is the whitesky.cloud location (topology key
	// cloud.whitesky/location) this node runs in.
	Location string `yaml:"location"`
}

// Log controls the agent's own log output.
type Log struct {
	// Level is one of debug, info, warn, error.
	Level string `yaml:"level"`
}

// DBus controls the event signals on the system bus.
type DBus struct {
	Enabled bool `yaml:"enabled"`
	// Address overrides the system bus address (a D-Bus address string such
	// as unix:path=/run/dbus/system_bus_socket). Empty means the system bus
	// as libdbus finds it (DBUS_SYSTEM_BUS_ADDRESS, else the default path).
	Address string `yaml:"address"`
}

// Events sizes the in-memory event buffers.
type Events struct {
	// RingSize is how many recent events the agent keeps for status and replay.
	RingSize int `yaml:"ring_size"`
	// SubscriberBuffer is how many events a slow WatchEvents subscriber may
	// fall behind before further events are dropped for it.
	SubscriberBuffer int `yaml:"subscriber_buffer"`
}

// Default returns the configuration used when no file sets anything.
func Default() Config {
	host, err := os.Hostname()
	if err != nil {
		host = ""
	}
	lt := lease.DefaultTiming()
	return Config{
		Socket:    Socket{Path: "/run/vco-agent/agent.sock"},
		Node:      Node{Name: host},
		StateDir:  "/var/lib/vco-agent",
		SysfsRoot: "/sys",
		Log:       Log{Level: "info"},
		DBus:      DBus{Enabled: true},
		Events:    Events{RingSize: 256, SubscriberBuffer: 128},
		Volumes: Volumes{KubeletRoot: "/var/lib/kubelet", DevRoot: "/dev", CheckInterval: 10 * time.Second, FenceMethods: []fence.Method{fence.MethodPR, fence.MethodLease}, AttachWait: 10 * time.Second, WatchDisks: true, WatchRescan: 30 * time.Second, ClaimedDir: "/run/vco-agent/claimed",
			Lease: LeaseTiming{IOTimeout: lt.IOTimeout, Renew: lt.Renew, Fail: lt.Fail, Watchdog: lt.Watchdog, WatchdogDevice: watchdog.Auto}},
	}
}

// Load reads the file at path over the defaults. A missing file is fine when
// the path was not chosen by the operator (explicit false): the packaged
// default file is optional. The result is validated.
func Load(path string, explicit bool) (Config, error) {
	cfg := Default()
	data, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist) && !explicit:
		return cfg, cfg.Validate()
	case errors.Is(err, fs.ErrNotExist):
		return cfg, fmt.Errorf("config file %s does not exist: create it or drop --config to use the defaults", path)
	case err != nil:
		return cfg, fmt.Errorf("reading config file %s: %w", path, err)
	}
	if err := decode(data, &cfg); err != nil {
		return cfg, fmt.Errorf("config file %s: %w", path, err)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("config file %s: %w", path, err)
	}
	return cfg, nil
}

var unknownField = regexp.MustCompile(`line (\d+): field (\S+) not found in type (\S+)`)

func decode(data []byte, cfg *Config) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	err := dec.Decode(cfg)
	if errors.Is(err, io.EOF) {
		return nil // an empty file keeps every default
	}
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs := make([]string, 0, len(te.Errors))
		for _, e := range te.Errors {
			if m := unknownField.FindStringSubmatch(e); m != nil {
				e = fmt.Sprintf("line %s: unknown field %q (in %s)", m[1], m[2], sectionName(m[3]))
			}
			msgs = append(msgs, e)
		}
		return errors.New(strings.Join(msgs, "; "))
	}
	if err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), "yaml: "))
	}
	return nil
}

// sectionName turns a Go type name from the YAML decoder into the section
// an operator sees in the file, from Config's own yaml tags, so that a new
// section needs no entry here.
func sectionName(goType string) string {
	name := strings.TrimPrefix(goType, "config.")
	if name == "Config" {
		return "the top level"
	}
	t := reflect.TypeFor[Config]()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Type.Name() == name {
			return "section " + strings.Split(f.Tag.Get("yaml"), ",")[0]
		}
	}
	return goType
}

// Validate checks the values an operator can get wrong, naming the field.
// Every section is checked and every problem reported, section by
// section.
func (c *Config) Validate() error {
	var errs []error
	for _, check := range []func() []error{c.validateTop, c.validateEvents, c.validateVolumes,
		c.validateLeaseTiming, c.validateWatchdog, c.validateMetrics} {
		errs = append(errs, check()...)
	}
	return errors.Join(errs...)
}

// validateTop checks the top level: paths, the node name and the log level.
func (c *Config) validateTop() []error {
	var errs []error
	if !filepath.IsAbs(c.Socket.Path) {
		errs = append(errs, fmt.Errorf("socket.path %q must be an absolute path", c.Socket.Path))
	}
	if !filepath.IsAbs(c.StateDir) {
		errs = append(errs, fmt.Errorf("state_dir %q must be an absolute path", c.StateDir))
	}
	if c.SysfsRoot == "" {
		errs = append(errs, errors.New("sysfs_root must not be empty"))
	}
	if c.Node.Name == "" {
		errs = append(errs, errors.New("node.name is empty and the host name could not be read: set node.name"))
	}
	if _, err := c.SlogLevel(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

// validateEvents checks the event ring's sizes.
func (c *Config) validateEvents() []error {
	var errs []error
	if c.Events.RingSize < 1 || c.Events.RingSize > 1<<20 {
		errs = append(errs, fmt.Errorf("events.ring_size %d must be between 1 and 1048576", c.Events.RingSize))
	}
	if c.Events.SubscriberBuffer < 1 || c.Events.SubscriberBuffer > 1<<20 {
		errs = append(errs, fmt.Errorf("events.subscriber_buffer %d must be between 1 and 1048576", c.Events.SubscriberBuffer))
	}
	return errs
}

// validateVolumes checks the volumes section's paths and intervals.
func (c *Config) validateVolumes() []error {
	var errs []error
	if !filepath.IsAbs(c.Volumes.KubeletRoot) || filepath.Clean(c.Volumes.KubeletRoot) == "/" {
		errs = append(errs, fmt.Errorf("volumes.kubelet_root %q must be an absolute path other than /", c.Volumes.KubeletRoot))
	}
	if !filepath.IsAbs(c.Volumes.DevRoot) {
		errs = append(errs, fmt.Errorf("volumes.dev_root %q must be an absolute path", c.Volumes.DevRoot))
	}
	if c.Volumes.CheckInterval < 100*time.Millisecond || c.Volumes.CheckInterval > time.Hour {
		errs = append(errs, fmt.Errorf("volumes.check_interval %s must be between 100ms and 1h", c.Volumes.CheckInterval))
	}
	if c.Volumes.WatchRescan < time.Second || c.Volumes.WatchRescan > time.Hour {
		errs = append(errs, fmt.Errorf("volumes.watch_rescan %s must be between 1s and 1h", c.Volumes.WatchRescan))
	}
	if w := c.Volumes.AttachWait; w < 0 || w > time.Minute {
		errs = append(errs, fmt.Errorf("volumes.attach_wait %s must be between 0 (answer NOT_FOUND at once) and 1m: the kubelet gives a stage 2m", w))
	}
	if w := c.Volumes.ReclaimWait; w != 0 && (w <= c.Volumes.CheckInterval || w > time.Hour) {
		errs = append(errs, fmt.Errorf("volumes.reclaim_wait %s must be longer than volumes.check_interval (%s), at most 1h, or 0 for three check intervals", w, c.Volumes.CheckInterval))
	}
	return append(errs, c.Volumes.validateFenceMethods()...)
}

// validateLeaseTiming checks volumes.lease's times.
func (c *Config) validateLeaseTiming() []error {
	var errs []error
	// The lease's own rules (fence/lease Timing): positive values, a
	// renewal no shorter than an I/O, a fail bound of two renewals.
	switch lt := c.Volumes.Lease; {
	case lt.IOTimeout <= 0 || lt.Renew <= 0 || lt.Fail <= 0 || lt.Watchdog < 0:
		errs = append(errs, fmt.Errorf("volumes.lease %s: io_timeout, renew and fail must be positive, watchdog 0 or more", lt.Timing()))
	case lt.IOTimeout < lease.MinIOTimeout:
		errs = append(errs, fmt.Errorf("volumes.lease %s: io_timeout must be at least %s (the lease's fast first claim relies on it, docs/fencing.md)", lt.Timing(), lease.MinIOTimeout))
	case lt.Renew < lt.IOTimeout:
		errs = append(errs, fmt.Errorf("volumes.lease %s: renew must not be shorter than io_timeout", lt.Timing()))
	case lt.Fail < 2*lt.Renew:
		errs = append(errs, fmt.Errorf("volumes.lease %s: fail must be at least twice renew", lt.Timing()))
	}
	return errs
}

// validateWatchdog checks the host watchdog the lease relies on.
func (c *Config) validateWatchdog() []error {
	var errs []error
	// A taker waits out the holder's watchdog time W, which is only true
	// while a watchdog device is armed (docs/fencing.md).
	switch lt := c.Volumes.Lease; {
	case lt.WatchdogDevice != watchdog.Auto && lt.WatchdogDevice != watchdog.Unsafe && !strings.HasPrefix(lt.WatchdogDevice, "/dev/"):
		errs = append(errs, fmt.Errorf("volumes.lease.watchdog_device %q must be %s, a device path under /dev, or %s", lt.WatchdogDevice, watchdog.Auto, watchdog.Unsafe))
	case lt.WatchdogDevice == watchdog.Unsafe:
	case lt.Watchdog == 0:
		errs = append(errs, fmt.Errorf("volumes.lease.watchdog is 0, but other nodes take a lease over after the holder's watchdog time, which only a host watchdog makes true: give it a time (default %s), or set volumes.lease.watchdog_device: %s to hold leases without one (unsafe)", lease.DefaultTiming().Watchdog, watchdog.Unsafe))
	case lt.Watchdog < 2*time.Second || lt.Watchdog%time.Second != 0:
		errs = append(errs, fmt.Errorf("volumes.lease.watchdog %s must be a whole number of seconds, at least 2s: the device is given half of it, and watchdog devices count seconds", lt.Watchdog))
	}
	return errs
}

// validateMetrics checks the metrics section.
func (c *Config) validateMetrics() []error {
	var errs []error
	if s := c.Metrics.Socket; s != "" && s != MetricsOff && !filepath.IsAbs(s) {
		errs = append(errs, fmt.Errorf("metrics.socket %q must be an absolute path, empty (beside the API socket) or %s", s, MetricsOff))
	}
	if c.Metrics.Listen != "" {
		if err := loopbackAddr(c.Metrics.Listen); err != nil {
			errs = append(errs, fmt.Errorf("metrics.listen %q: %v", c.Metrics.Listen, err))
		}
	}
	return errs
}

// loopbackAddr accepts host:port where host is a loopback IP or
// "localhost": the metrics carry volume names and must not leave the node
// unless an operator puts a proxy in front.
func loopbackAddr(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return fmt.Errorf("want host:port, e.g. 127.0.0.1:9465")
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("port %q is not a number", port)
	}
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("host must be a loopback address (127.0.0.1, ::1 or localhost)")
	}
	return nil
}

// SlogLevel is Log.Level as a slog level.
func (c *Config) SlogLevel() (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(c.Log.Level)); err != nil {
		return 0, fmt.Errorf("log.level %q must be one of debug, info, warn, error", c.Log.Level)
	}
	return l, nil
}

// Flags are the command-line overrides of `vco-agent serve`. Only flags the
// operator actually gave override the file.
type Flags struct {
	fs         *flag.FlagSet
	ConfigPath string
	socket     string
	group      string
	nodeName   string
	location   string
	stateDir   string
	sysfsRoot  string
	logLevel   string
	dbus       bool
	dbusAddr   string
	kubelet    string
	metrics    string
}

// RegisterFlags adds the configuration flags to fs.
func RegisterFlags(fs *flag.FlagSet) *Flags {
	d := Default()
	f := &Flags{fs: fs}
	fs.StringVar(&f.ConfigPath, "config", DefaultPath, "configuration file (YAML); a missing default file means all defaults")
	fs.StringVar(&f.socket, "socket", d.Socket.Path, "API socket path (ignored under socket activation)")
	fs.StringVar(&f.group, "socket-group", d.Socket.Group, "group allowed to call the API besides root")
	fs.StringVar(&f.nodeName, "node-name", "", "node name (default: the host name)")
	fs.StringVar(&f.location, "location", d.Node.Location, "whitesky.cloud location of this node")
	fs.StringVar(&f.stateDir, "state-dir", d.StateDir, "directory for the agent's state")
	fs.StringVar(&f.sysfsRoot, "sysfs-root", d.SysfsRoot, "where sysfs is mounted (for tests: a fixture tree)")
	fs.StringVar(&f.logLevel, "log-level", d.Log.Level, "debug, info, warn or error")
	fs.BoolVar(&f.dbus, "dbus", d.DBus.Enabled, "emit events as D-Bus signals on the system bus")
	fs.StringVar(&f.dbusAddr, "dbus-address", d.DBus.Address, "D-Bus address to use instead of the system bus")
	fs.StringVar(&f.kubelet, "kubelet-root", d.Volumes.KubeletRoot, "directory under which staging and target paths must lie")
	fs.StringVar(&f.metrics, "metrics-listen", d.Metrics.Listen, "loopback host:port for Prometheus /metrics (empty: off)")
	return f
}

// ConfigExplicit reports whether --config was given.
func (f *Flags) ConfigExplicit() bool { return f.set("config") }

func (f *Flags) set(name string) bool {
	found := false
	f.fs.Visit(func(fl *flag.Flag) {
		if fl.Name == name {
			found = true
		}
	})
	return found
}

// Load reads the configuration file the flags name and applies the flags
// given on the command line over it.
func (f *Flags) Load() (Config, error) {
	cfg, err := Load(f.ConfigPath, f.ConfigExplicit())
	if err != nil {
		return cfg, err
	}
	over := map[string]func(){
		"socket":         func() { cfg.Socket.Path = f.socket },
		"socket-group":   func() { cfg.Socket.Group = f.group },
		"node-name":      func() { cfg.Node.Name = f.nodeName },
		"location":       func() { cfg.Node.Location = f.location },
		"state-dir":      func() { cfg.StateDir = f.stateDir },
		"sysfs-root":     func() { cfg.SysfsRoot = f.sysfsRoot },
		"log-level":      func() { cfg.Log.Level = f.logLevel },
		"dbus":           func() { cfg.DBus.Enabled = f.dbus },
		"dbus-address":   func() { cfg.DBus.Address = f.dbusAddr },
		"kubelet-root":   func() { cfg.Volumes.KubeletRoot = f.kubelet },
		"metrics-listen": func() { cfg.Metrics.Listen = f.metrics },
	}
	f.fs.Visit(func(fl *flag.Flag) {
		if apply, ok := over[fl.Name]; ok {
			apply()
		}
	})
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("after command-line flags: %w", err)
	}
	return cfg, nil
}
