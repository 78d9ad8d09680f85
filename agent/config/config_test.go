package config

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

func write(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestMissingDefaultFileGivesDefaults(t *testing.T) {
	cfg, err := Load(filepath.Join(t.TempDir(), "absent.yaml"), false)
	if err != nil {
		t.Fatalf("missing default file: %v", err)
	}
	if cfg.Socket.Path != "/run/vco-agent/agent.sock" || cfg.SysfsRoot != "/sys" || cfg.StateDir != "/var/lib/vco-agent" || !cfg.DBus.Enabled {
		t.Fatalf("defaults not applied: %+v", cfg)
	}
	host, _ := os.Hostname()
	if cfg.Node.Name != host {
		t.Fatalf("node name %q, want host name %q", cfg.Node.Name, host)
	}
}

func TestMissingExplicitFileIsAnError(t *testing.T) {
	p := filepath.Join(t.TempDir(), "absent.yaml")
	_, err := Load(p, true)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("got %v, want an error naming %s", err, p)
	}
}

func TestFileOverridesDefaults(t *testing.T) {
	p := write(t, "socket:\n  path: /tmp/x.sock\n  group: storage\nnode:\n  name: n1\n  location: ch-lug-1\nlog:\n  level: debug\ndbus:\n  enabled: false\nevents:\n  ring_size: 8\n")
	cfg, err := Load(p, true)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Socket.Path != "/tmp/x.sock" || cfg.Socket.Group != "storage" || cfg.Node.Name != "n1" ||
		cfg.Node.Location != "ch-lug-1" || cfg.Log.Level != "debug" || cfg.DBus.Enabled || cfg.Events.RingSize != 8 {
		t.Fatalf("file not applied: %+v", cfg)
	}
	if cfg.Events.SubscriberBuffer != Default().Events.SubscriberBuffer || cfg.SysfsRoot != "/sys" {
		t.Fatalf("unset fields lost their defaults: %+v", cfg)
	}
}

func TestEmptyFileKeepsDefaults(t *testing.T) {
	cfg, err := Load(write(t, ""), true)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Socket.Path != Default().Socket.Path {
		t.Fatalf("got %+v", cfg)
	}
}

func TestUnknownFieldNamesFieldAndLine(t *testing.T) {
	p := write(t, "socket:\n  path: /tmp/x.sock\n  gruop: storage\n")
	_, err := Load(p, true)
	if err == nil {
		t.Fatal("unknown field accepted")
	}
	for _, want := range []string{p, "line 3", `"gruop"`, "section socket"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	_, err = Load(write(t, "log:\n  level: info\nsysfs: /x\n"), true)
	if err == nil || !strings.Contains(err.Error(), "line 3") || !strings.Contains(err.Error(), `"sysfs"`) {
		t.Fatalf("top-level unknown field: %v", err)
	}
}

func TestBadValuesAreNamed(t *testing.T) {
	cases := map[string]string{
		"log:\n  level: loud\n":                "log.level",
		"socket:\n  path: rel.sock\n":          "socket.path",
		"events:\n  ring_size: 0\n":            "events.ring_size",
		"state_dir: var\n":                     "state_dir",
		"events:\n  ring_size: lots\n":         "line 2",
		"socket: [\n":                          "line",
		"dbus:\n  enabled: sometimes\n":        "line 2",
		"volumes:\n  kubelet_root: /\n":        "volumes.kubelet_root",
		"volumes:\n  kubelet_root: kubelet\n":  "volumes.kubelet_root",
		"volumes:\n  check_interval: 1ms\n":    "volumes.check_interval",
		"volumes:\n  check_interval: often\n":  "line 2",
		"volumes:\n  reclaim_wait: 5s\n":       "volumes.reclaim_wait",
		"volumes:\n  attach_wait: -1s\n":       "volumes.attach_wait",
		"volumes:\n  attach_wait: 2m\n":        "volumes.attach_wait",
		"volumes:\n  reclaim_wait: -1s\n":      "volumes.reclaim_wait",
		"volumes:\n  reclaim_wait: 2h\n":       "volumes.reclaim_wait",
		"volumes:\n  watch_rescan: 10ms\n":     "volumes.watch_rescan",
		"volumes:\n  watch_rescan: 0s\n":       "volumes.watch_rescan",
		"metrics:\n  listen: 0.0.0.0:9465\n":   "loopback",
		"metrics:\n  listen: 10.0.0.1:9465\n":  "loopback",
		"metrics:\n  listen: 127.0.0.1\n":      "host:port",
		"metrics:\n  listen: localhost:http\n": "port",
	}
	for body, want := range cases {
		_, err := Load(write(t, body), true)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: got %v, want mention of %q", body, err, want)
		}
	}
}

func TestFlagsOverrideFileOnlyWhenGiven(t *testing.T) {
	p := write(t, "socket:\n  path: /tmp/file.sock\nnode:\n  location: from-file\n")
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	f := RegisterFlags(fs)
	if err := fs.Parse([]string{"--config", p, "--sysfs-root", "/tmp/sys", "--dbus=false", "--node-name", "n9"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := f.Load()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Socket.Path != "/tmp/file.sock" || cfg.Node.Location != "from-file" {
		t.Fatalf("flag defaults overrode the file: %+v", cfg)
	}
	if cfg.SysfsRoot != "/tmp/sys" || cfg.DBus.Enabled || cfg.Node.Name != "n9" {
		t.Fatalf("given flags not applied: %+v", cfg)
	}
	fs = flag.NewFlagSet("serve", flag.ContinueOnError)
	f = RegisterFlags(fs)
	_ = fs.Parse([]string{"--config", p, "--log-level", "chatty"})
	if _, err := f.Load(); err == nil || !strings.Contains(err.Error(), "log.level") {
		t.Fatalf("bad flag value: %v", err)
	}
}

func TestVolumesAndMetricsSections(t *testing.T) {
	p := write(t, "volumes:\n  kubelet_root: /srv/kubelet\n  check_interval: 2s\n  allow_unfenced: true\nmetrics:\n  listen: \"[::1]:9465\"\n")
	cfg, err := Load(p, true)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Volumes.KubeletRoot != "/srv/kubelet" || cfg.Volumes.CheckInterval.Seconds() != 2 || !cfg.Volumes.AllowUnfenced ||
		cfg.Volumes.AllowLoopDevices || cfg.Volumes.DevRoot != "/dev" || cfg.Metrics.Listen != "[::1]:9465" {
		t.Fatalf("volumes/metrics not applied: %+v %+v", cfg.Volumes, cfg.Metrics)
	}
	if got := cfg.Volumes.ReclaimAfter(); got != 6*time.Second {
		t.Fatalf("reclaim wait by default %s, want three check intervals (6s)", got)
	}
	if cfg, err := Load(write(t, "volumes:\n  reclaim_wait: 45s\n"), true); err != nil || cfg.Volumes.ReclaimAfter() != 45*time.Second {
		t.Fatalf("reclaim_wait 45s: %v %v", cfg.Volumes.ReclaimAfter(), err)
	}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	f := RegisterFlags(fs)
	if err := fs.Parse([]string{"--config", p, "--kubelet-root", "/k", "--metrics-listen", "127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	if cfg, err = f.Load(); err != nil || cfg.Volumes.KubeletRoot != "/k" || cfg.Metrics.Listen != "127.0.0.1:1" {
		t.Fatalf("flags: %+v %v", cfg, err)
	}
}

func TestExampleFileIsTheDefaults(t *testing.T) {
	cfg, err := Load("example.yaml", true)
	if err != nil {
		t.Fatalf("the shipped example does not load: %v", err)
	}
	if !reflect.DeepEqual(cfg, Default()) {
		t.Fatalf("example.yaml drifted from the defaults:\n%+v\n%+v", cfg, Default())
	}
}

// The lease's W holds only with a host watchdog armed: W = 0 (no
// watchdog) is accepted only with the explicit unsafe setting.
func TestLeaseWithoutAWatchdogNeedsTheUnsafeSetting(t *testing.T) {
	bad := map[string]string{
		"volumes:\n  lease:\n    watchdog: 0s\n":                                 "watchdog_device: none-unsafe",
		"volumes:\n  lease:\n    watchdog: 0s\n    watchdog_device: auto\n":      "volumes.lease.watchdog is 0",
		"volumes:\n  lease:\n    watchdog_device: softdog\n":                     "volumes.lease.watchdog_device",
		"volumes:\n  lease:\n    watchdog_device: \"\"\n":                        "volumes.lease.watchdog_device",
		"volumes:\n  lease:\n    watchdog: 1500ms\n":                             "whole number of seconds",
		"volumes:\n  lease:\n    watchdog: 500ms\n    watchdog_device: /dev/w\n": "at least 2s",
		"volumes:\n  lease:\n    watchdog: 1s\n":                                 "half of it",
		"volumes:\n  lease:\n    io_timeout: 50ms\n    renew: 1s\n":              "io_timeout must be at least 100ms",
	}
	for body, want := range bad {
		_, err := Load(write(t, body), true)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: got %v, want mention of %q", body, err, want)
		}
	}
	cfg, err := Load(write(t, "volumes:\n  lease:\n    watchdog: 0s\n    watchdog_device: none-unsafe\n"), true)
	if err != nil || cfg.Volumes.Lease.Watchdog != 0 || cfg.Volumes.Lease.WatchdogDevice != "none-unsafe" {
		t.Fatalf("the explicit unsafe setting: %+v %v", cfg.Volumes.Lease, err)
	}
	if d := Default().Volumes.Lease; d.WatchdogDevice != "auto" || d.Watchdog != 30*time.Second {
		t.Fatalf("defaults: %+v", d)
	}
	if cfg, err := Load(write(t, "volumes:\n  lease:\n    watchdog_device: /dev/watchdog1\n"), true); err != nil || cfg.Volumes.Lease.WatchdogDevice != "/dev/watchdog1" {
		t.Fatalf("a device path: %+v %v", cfg.Volumes.Lease, err)
	}
}

// fence_methods: a subset of scsi-pr and disk-lease, or none alone;
// anything else is refused naming the field.
func TestFenceMethods(t *testing.T) {
	for _, c := range []struct {
		yaml string
		want []fence.Method
		err  string
	}{
		{"", []fence.Method{fence.MethodPR, fence.MethodLease}, ""},
		{"volumes:\n  fence_methods: [disk-lease]\n", []fence.Method{fence.MethodLease}, ""},
		{"volumes:\n  fence_methods: [none]\n", []fence.Method{fence.MethodNone}, ""},
		{"volumes:\n  fence_methods: []\n", nil, "volumes.fence_methods is empty"},
		{"volumes:\n  fence_methods: [none, scsi-pr]\n", nil, `"none" is not a fencing method`},
		{"volumes:\n  fence_methods: [scsi-pr, scsi-pr]\n", nil, "names scsi-pr twice"},
		{"volumes:\n  fence_methods: [pr]\n", nil, `"pr" is not a fencing method`},
	} {
		p := filepath.Join(t.TempDir(), "c.yaml")
		if err := os.WriteFile(p, []byte(c.yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := Load(p, true)
		switch {
		case c.err == "" && err != nil:
			t.Errorf("%q: %v", c.yaml, err)
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%q: error %v, want one saying %q", c.yaml, err, c.err)
		case c.err == "" && !slices.Equal(cfg.Volumes.FenceMethods, c.want):
			t.Errorf("%q: fence_methods %v, want %v", c.yaml, cfg.Volumes.FenceMethods, c.want)
		}
	}
}
