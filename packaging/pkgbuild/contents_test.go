package pkgbuild

import (
	"bufio"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/coreos/go-systemd/v22/unit"
	"go.yaml.in/yaml/v3"

	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/daemon"
)

// unitOptions parses a unit file into section -> name -> values.
func unitOptions(t *testing.T, file string) map[string]map[string][]string {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot(t), "packaging", "systemd", file))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	opts, err := unit.DeserializeOptions(f)
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	m := map[string]map[string][]string{}
	for _, o := range opts {
		if m[o.Section] == nil {
			m[o.Section] = map[string][]string{}
		}
		m[o.Section][o.Name] = append(m[o.Section][o.Name], o.Value)
	}
	return m
}

func one(t *testing.T, m map[string]map[string][]string, section, name string) string {
	t.Helper()
	v := m[section][name]
	if len(v) != 1 {
		t.Fatalf("[%s] %s: want exactly one value, have %q", section, name, v)
	}
	return v[0]
}

// packagedConfig is the part of the default config.yaml the units depend on.
type packagedConfig struct {
	Socket struct {
		Path  string `yaml:"path"`
		Group string `yaml:"group"`
	} `yaml:"socket"`
}

func readConfig(t *testing.T, data []byte) packagedConfig {
	t.Helper()
	var c packagedConfig
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	return c
}

// tmpfilesDirs returns path -> "mode user group" of the d lines.
func tmpfilesDirs(t *testing.T) map[string]string {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot(t), "packaging", "vco-agent.tmpfiles"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dirs := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 5 && f[0] == "d" {
			dirs[f[1]] = strings.Join(f[2:5], " ")
		}
	}
	return dirs
}

// The service, the socket, tmpfiles.d, sysusers.d, the default config and
// the cloud-init config must agree on the socket and its group, and the
// service must keep the properties the agent and the host rely on.
func TestPackagedFilesAgree(t *testing.T) {
	root := repoRoot(t)
	svc := unitOptions(t, "vco-agent.service")
	sock := unitOptions(t, "vco-agent.socket")

	data, err := os.ReadFile(filepath.Join(root, "packaging", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := readConfig(t, data)

	listen, group := checkSocketUnit(t, sock, cfg)
	checkSocketGroupCreated(t, root, listen, group)
	checkCloudInitConfig(t, root, cfg)
	checkServiceUnit(t, svc)
	if v, ok := sock["Socket"]["RuntimeDirectory"]; ok {
		t.Errorf("socket sets RuntimeDirectory=%v", v)
	}
	if !slices.Contains(svc["Unit"]["Requires"], "vco-agent.socket") {
		t.Error("service does not require its socket")
	}
}

// checkSocketUnit: the socket unit listens where config.yaml says, with
// its group and modes; it returns the socket's path and group.
func checkSocketUnit(t *testing.T, sock map[string]map[string][]string, cfg packagedConfig) (listen, group string) {
	t.Helper()
	listen = one(t, sock, "Socket", "ListenStream")
	if listen != cfg.Socket.Path {
		t.Errorf("socket unit listens on %s, config.yaml says %s", listen, cfg.Socket.Path)
	}
	group = one(t, sock, "Socket", "SocketGroup")
	if group != cfg.Socket.Group {
		t.Errorf("socket unit group %s, config.yaml group %s", group, cfg.Socket.Group)
	}
	for name, want := range map[string]string{"SocketMode": "0660", "DirectoryMode": "0750", "FileDescriptorName": "api"} {
		if got := one(t, sock, "Socket", name); got != want {
			t.Errorf("socket %s=%s, want %s", name, got, want)
		}
	}
	return listen, group
}

// checkSocketGroupCreated: tmpfiles.d lets the group reach the socket's
// directory, and sysusers.d and the packages' scripts create the group.
func checkSocketGroupCreated(t *testing.T, root, listen, group string) {
	t.Helper()
	dirs := tmpfilesDirs(t)
	if got, want := dirs[path.Dir(listen)], "0750 root "+group; got != want {
		t.Errorf("tmpfiles.d %s: %q, want %q so the group can reach the socket", path.Dir(listen), got, want)
	}
	sysusers, err := os.ReadFile(filepath.Join(root, "packaging", "vco-agent.sysusers"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sysusers), "\ng "+group+" ") {
		t.Errorf("sysusers.d does not create group %s", group)
	}
	for _, script := range []string{"deb/postinst", "rpm/pre"} {
		b, err := os.ReadFile(filepath.Join(root, "packaging", script))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "group "+group) && !strings.Contains(string(b), "-r "+group) {
			t.Errorf("%s does not create group %s", script, group)
		}
	}
}

// checkCloudInitConfig: the cloud-init config is the packaged one with the
// site filled in.
func checkCloudInitConfig(t *testing.T, root string, cfg packagedConfig) {
	t.Helper()
	ud, err := os.ReadFile(filepath.Join(root, "packaging", "cloud-init", "user-data.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var userData struct {
		WriteFiles []struct {
			Path    string `yaml:"path"`
			Content string `yaml:"content"`
		} `yaml:"write_files"`
	}
	if err := yaml.Unmarshal(ud, &userData); err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(userData.WriteFiles, func(f struct {
		Path    string `yaml:"path"`
		Content string `yaml:"content"`
	}) bool {
		return f.Path == "/etc/vco-agent/config.yaml"
	})
	if i < 0 {
		t.Fatal("cloud-init user-data does not write /etc/vco-agent/config.yaml")
	}
	if ci := readConfig(t, []byte(userData.WriteFiles[i].Content)); ci != cfg {
		t.Errorf("cloud-init config socket %+v differs from the packaged %+v", ci, cfg)
	}
}

// checkServiceUnit: the service is a notify service with a watchdog, the
// capabilities and block devices the agent needs, and nothing that would
// give it a mount namespace of its own.
func checkServiceUnit(t *testing.T, svc map[string]map[string][]string) {
	t.Helper()
	for name, want := range map[string]string{"Type": "notify", "Restart": "on-failure", "DevicePolicy": "closed", "ExecStart": "/usr/bin/vco-agent serve"} {
		if got := one(t, svc, "Service", name); got != want {
			t.Errorf("service %s=%s, want %s", name, got, want)
		}
	}
	if one(t, svc, "Service", "WatchdogSec") == "" {
		t.Error("service has no WatchdogSec")
	}
	caps := strings.Fields(one(t, svc, "Service", "CapabilityBoundingSet"))
	for _, c := range []string{"CAP_SYS_ADMIN", "CAP_SYS_RAWIO"} {
		if !slices.Contains(caps, c) {
			t.Errorf("CapabilityBoundingSet lacks %s", c)
		}
	}
	if !slices.ContainsFunc(svc["Service"]["DeviceAllow"], func(v string) bool { return strings.HasPrefix(v, "block-") }) {
		t.Error("service allows no block devices")
	}
	// The agent makes dm-crypt nodes when udev is late: mknod needs the
	// m access mode on the device-mapper major, not only the capability.
	if !slices.Contains(svc["Service"]["DeviceAllow"], "block-device-mapper rwm") {
		t.Errorf("service does not allow mknod of device-mapper nodes (DeviceAllow=%q)", svc["Service"]["DeviceAllow"])
	}
	// Each of these gives the service its own mount namespace, which would
	// keep the agent's mounts from the host.
	for _, name := range []string{
		"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
		"ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
		"ProtectHostname", "ProtectProc", "ProcSubset", "ReadOnlyPaths", "ReadWritePaths",
		"InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "RootDirectory",
		"RootImage", "MountFlags", "DynamicUser", "RuntimeDirectory", "StateDirectory",
	} {
		if v, ok := svc["Service"][name]; ok {
			t.Errorf("service sets %s=%v: it would cut mount propagation to the host", name, v)
		}
	}
}

// The packaged files must be what the agent itself expects: its config
// loader (which refuses unknown keys) accepts the default config and the
// one cloud-init writes, and the socket unit matches the daemon's
// activation name and the CLI's default socket.
func TestPackagedFilesMatchTheAgent(t *testing.T) {
	root := repoRoot(t)
	cfg, err := config.Load(filepath.Join(root, "packaging", "config.yaml"), true)
	if err != nil {
		t.Fatalf("the agent refuses the packaged config.yaml: %v", err)
	}
	sock := unitOptions(t, "vco-agent.socket")
	if got := one(t, sock, "Socket", "FileDescriptorName"); got != daemon.ActivationName {
		t.Errorf("FileDescriptorName=%s, the daemon takes %q", got, daemon.ActivationName)
	}
	if got := one(t, sock, "Socket", "ListenStream"); got != client.DefaultSocket || got != cfg.Socket.Path {
		t.Errorf("ListenStream=%s; the CLI defaults to %s, the config says %s", got, client.DefaultSocket, cfg.Socket.Path)
	}
	if got := one(t, sock, "Socket", "SocketGroup"); got != cfg.Socket.Group {
		t.Errorf("SocketGroup=%s, the agent admits group %q", got, cfg.Socket.Group)
	}

	ud, err := os.ReadFile(filepath.Join(root, "packaging", "cloud-init", "user-data.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var userData struct {
		WriteFiles []struct {
			Path    string `yaml:"path"`
			Content string `yaml:"content"`
		} `yaml:"write_files"`
	}
	if err := yaml.Unmarshal(ud, &userData); err != nil {
		t.Fatal(err)
	}
	for _, f := range userData.WriteFiles {
		if f.Path != config.DefaultPath {
			continue
		}
		p := filepath.Join(t.TempDir(), "config.yaml")
		if err := os.WriteFile(p, []byte(f.Content), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := config.Load(p, true); err != nil {
			t.Errorf("the agent refuses the config cloud-init writes: %v", err)
		}
	}
}

// metrics.listen (loopback only, docs/events.md#metrics) must work under
// the packaged unit as it is: the unit allows IPv4 and IPv6 sockets, and
// its cgroup filter lets loopback through while denying every other
// address. The agent's config must accept the documented address and
// refuse a non-loopback one, so the filter is never the only guard.
func TestUnitPermitsLoopbackMetrics(t *testing.T) {
	svc := unitOptions(t, "vco-agent.service")
	var families []string
	for _, v := range svc["Service"]["RestrictAddressFamilies"] {
		families = append(families, strings.Fields(v)...)
	}
	for _, f := range []string{"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"} {
		if !slices.Contains(families, f) {
			t.Errorf("RestrictAddressFamilies=%v lacks %s: a metrics.listen on loopback would fail", families, f)
		}
	}
	if slices.ContainsFunc(families, func(f string) bool { return strings.HasPrefix(f, "~") }) {
		t.Errorf("RestrictAddressFamilies=%v is a deny list", families)
	}
	if got := svc["Service"]["IPAddressDeny"]; !slices.Equal(got, []string{"any"}) {
		t.Errorf("IPAddressDeny=%v, want any", got)
	}
	var allow []string
	for _, v := range svc["Service"]["IPAddressAllow"] {
		allow = append(allow, strings.Fields(v)...)
	}
	if !slices.Equal(allow, []string{"localhost"}) {
		t.Errorf("IPAddressAllow=%v, want localhost alone (127.0.0.0/8 and ::1)", allow)
	}
	dir := t.TempDir()
	for addr, ok := range map[string]bool{"127.0.0.1:9465": true, "[::1]:9465": true, "0.0.0.0:9465": false, "10.0.0.5:9465": false} {
		p := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(p, []byte("metrics:\n  listen: \""+addr+"\"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := config.Load(p, true)
		if ok && err != nil {
			t.Errorf("the agent refuses metrics.listen %s: %v", addr, err)
		}
		if !ok && err == nil {
			t.Errorf("the agent accepts metrics.listen %s, which the unit's filter alone would stop", addr)
		}
	}
}
