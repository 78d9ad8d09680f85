package deploy

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
)

// buildPlugin compiles this module's vco-csi.
func buildPlugin(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "vco-csi")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/vco-csi")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building vco-csi: %v\n%s", err, out)
	}
	return bin
}

var kubeRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand resolves $(NAME) in args as kubelet does, from env.
func expand(args []string, env map[string]string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = kubeRef.ReplaceAllStringFunc(a, func(m string) string {
			if v, ok := env[m[2:len(m)-1]]; ok {
				return v
			}
			return m
		})
	}
	return out
}

// relocate points an absolute path flag somewhere under dir.
func relocate(args []string, name, to string) []string {
	for i, a := range args {
		if strings.HasPrefix(a, "--"+name+"=") {
			args[i] = "--" + name + "=" + to
		}
	}
	return args
}

// TestPluginAcceptsTheManifestArguments runs this module's vco-csi with the
// controller's arguments and environment, filled from the documented
// example Secret, and asks it its name over the socket the sidecars dial:
// it must be the CSIDriver's. The node's arguments must get past flag
// parsing to the point where the plugin looks for the agent.
func TestPluginAcceptsTheManifestArguments(t *testing.T) {
	bin := buildPlugin(t)
	a := decode(t, renderings[1].Image, renderings[1].DriverName)
	doc, err := os.ReadFile(addonDoc)
	if err != nil {
		t.Fatal(err)
	}
	var secret corev1.Secret
	var keyBackend corev1.ConfigMap
	for _, m := range yamlBlock.FindAllSubmatch(doc, -1) {
		if strings.Contains(string(m[1]), "name: csi-driver-secret") {
			strict(t, m[1], &secret)
		}
		if strings.Contains(string(m[1]), "name: csi-key-backend-config") && keyBackend.Name == "" { // the seed's form
			strict(t, m[1], &keyBackend)
		}
	}
	dir := t.TempDir()

	t.Run("controller", func(t *testing.T) { pluginArgsController(t, bin, a, secret, dir) })

	// The node plugin reads the documented example ConfigMap from the
	// directory the DaemonSet projects it into, then stops at the missing
	// agent socket; without a required key it says so and goes on to the
	// same point (a key-backend problem never stops it).
	t.Run("node", func(t *testing.T) { pluginArgsNode(t, bin, a, keyBackend, dir) })

	// The node pod's init container, with the identity and the one
	// capability the manifest gives it, makes the directories the kubelet
	// made as root the plugin's, and finds them so at the pod's next start.
	t.Run("plugin-dirs", func(t *testing.T) { pluginDirsArgs(t, bin, a) })
}

func pluginDirsArgs(t *testing.T, bin string, a *addon) {
	setpriv, err := exec.LookPath("setpriv")
	if err != nil || os.Getuid() != 0 {
		t.Skip("needs root and setpriv (util-linux) to run with the manifest's capabilities")
	}
	spec := a.daemonSets[0].Spec.Template.Spec
	ic := spec.InitContainers[0]
	base := t.TempDir()
	args := slices.Clone(ic.Args)
	for _, m := range ic.VolumeMounts {
		d := filepath.Join(base, m.Name)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "left-by-root"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		args[slices.Index(args, m.MountPath)] = d
	}
	groups := []string{}
	for _, g := range append(slices.Clone(spec.SecurityContext.SupplementalGroups), *spec.SecurityContext.FSGroup) {
		groups = append(groups, strconv.FormatInt(g, 10))
	}
	caps := "-all"
	for _, c := range ic.SecurityContext.Capabilities.Add {
		caps += ",+" + strings.ToLower(string(c))
	}
	run := func(caps string) (string, error) {
		cmd := exec.Command(setpriv, append([]string{"--reuid=" + strconv.FormatInt(*ic.SecurityContext.RunAsUser, 10),
			"--regid=" + strconv.FormatInt(*ic.SecurityContext.RunAsGroup, 10), "--groups=" + strings.Join(groups, ","),
			"--bounding-set=" + caps, "--inh-caps=-all", "--", bin}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// Without the capability the manifest adds, it fails, saying why.
	if out, err := run("-all"); err == nil || !strings.Contains(out, "CAP_CHOWN") {
		t.Errorf("plugin-dirs without CAP_CHOWN: %v\n%s", err, out)
	}
	for _, want := range []string{"owner 65532:65532", "already"} {
		if out, err := run(caps); err != nil || strings.Count(out, want) != len(ic.VolumeMounts) {
			t.Fatalf("plugin-dirs %q with %s: %v\n%s\nwant %q for each directory", args, caps, err, out, want)
		}
	}
	for _, m := range ic.VolumeMounts {
		for _, p := range []string{filepath.Join(base, m.Name), filepath.Join(base, m.Name, "left-by-root")} {
			fi, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if st := fi.Sys().(*syscall.Stat_t); int64(st.Uid) != *spec.SecurityContext.RunAsUser || int64(st.Gid) != *spec.SecurityContext.RunAsGroup {
				t.Errorf("%s is %d:%d after plugin-dirs", p, st.Uid, st.Gid)
			}
		}
	}
}

func pluginArgsController(t *testing.T, bin string, a *addon, secret corev1.Secret, dir string) {
	d := a.deployments[0]
	w := workload{"Deployment", d.Name, d.Spec.Selector, d.Spec.Template}
	p := a.plugin(t, w)
	env := map[string]string{}
	for _, e := range p.Env {
		if r := e.ValueFrom.SecretKeyRef; r != nil {
			env[e.Name] = secret.StringData[r.Key]
		}
	}
	tf, _ := flag(p.Args, "token-file")
	if err := os.WriteFile(filepath.Join(dir, "jwt"), []byte(secret.StringData[filepath.Base(tf)]), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "c.sock")
	// The health endpoint on a free loopback port, not the pod's :9808.
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	healthAddr := hl.Addr().String()
	hl.Close()
	args := relocate(relocate(relocate(expand(p.Args, env), "endpoint", "unix://"+sock), "token-file", filepath.Join(dir, "jwt")),
		"http-endpoint", healthAddr)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill(); <-exited }()
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("vco-csi %q exited: %v\n%s", args, err, stderr.String())
		case <-ctx.Done():
			t.Fatalf("vco-csi %q made no socket:\n%s", args, stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil {
		t.Fatalf("GetPluginInfo: %v\n%s", err, stderr.String())
	}
	if info.GetName() != a.drivers[0].Name {
		t.Errorf("the controller plugin calls itself %q; the CSIDriver is %q", info.GetName(), a.drivers[0].Name)
	}
	// The liveness probe's endpoint is served by the plugin itself;
	// the example portal is not reachable from here, so it reports the
	// API, not ok.
	r, err := http.Get("http://" + healthAddr + "/healthz")
	if err != nil {
		t.Fatalf("the controller's --http-endpoint is not served: %v\n%s", err, stderr.String())
	}
	body, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "API does not answer") {
		t.Errorf("/healthz with an unreachable portal = %d %q, want 503 naming the API", r.StatusCode, body)
	}
}

func pluginArgsNode(t *testing.T, bin string, a *addon, keyBackend corev1.ConfigMap, dir string) {
	ds := a.daemonSets[0]
	w := workload{"DaemonSet", ds.Name, ds.Spec.Selector, ds.Spec.Template}
	p := a.plugin(t, w)
	missing := filepath.Join(dir, "no-agent", "agent.sock")
	for _, tc := range []struct {
		drop, want string
	}{{"", missing}, {"role", "ConfigMap csi-key-backend-config has no key role"}} {
		kb := t.TempDir()
		for k, v := range keyBackend.Data {
			if k != tc.drop {
				if err := os.WriteFile(filepath.Join(kb, k), []byte(v), 0o600); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := os.WriteFile(filepath.Join(kb, "token"), []byte("eyJhbGciOiJSUzI1NiJ9.e30.c2ln"), 0o600); err != nil {
			t.Fatal(err)
		}
		args := relocate(relocate(relocate(expand(p.Args, nil), "endpoint", "unix://"+filepath.Join(dir, "n.sock")),
			"agent-socket", missing), "key-backend-dir", kb)
		out, err := exec.Command(bin, args...).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), missing) {
			t.Errorf("vco-csi %q: %v\n%s\nwant exit 1 saying %q", args, err, out, tc.want)
		}
	}
}
