package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// upgradeRepoAddr is where the systemd guest finds the repository E9
// upgrades from: a forward of its restricted user network to the host's
// loopback (lab.Forward).
const upgradeRepoAddr = "10.0.2.100:80"

// upgradeRepo is the signed apt repository E9 upgrades the systemd
// guest's vco-agent from: packaging/repo/make-repo.sh, which `make repo`
// runs, on a scratch copy of the packages beside the booted .deb, with its
// throwaway key (one per scratch directory, so every publication is
// signed by the key the guest trusts), served over HTTP on the host's
// loopback.
type upgradeRepo struct {
	dir  string // the scratch dist directory; dir/repo is served
	deb  string // the .deb the guest booted with
	port int
	srv  *http.Server
}

// newUpgradeRepo copies the packages beside deb into a scratch directory,
// publishes them and serves the repository.
func newUpgradeRepo(ctx context.Context, deb string) (_ *upgradeRepo, err error) {
	dir, err := os.MkdirTemp("", "vco-e2e-repo.")
	if err != nil {
		return nil, err
	}
	u := &upgradeRepo{dir: dir, deb: deb}
	defer func() {
		if err != nil {
			u.close()
		}
	}()
	var pkgs []string
	for _, glob := range []string{"vco-agent_*.deb", "vco-agent-*.rpm"} {
		m, _ := filepath.Glob(filepath.Join(filepath.Dir(deb), glob))
		pkgs = append(pkgs, m...)
	}
	for _, p := range pkgs {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(p)), b, 0o644); err != nil {
			return nil, err
		}
	}
	if err := u.makeRepo(ctx); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	u.port = ln.Addr().(*net.TCPAddr).Port
	u.srv = &http.Server{Handler: http.FileServer(http.Dir(filepath.Join(dir, "repo")))}
	go func() { _ = u.srv.Serve(ln) }()
	return u, nil
}

// forward is the guest's way to the repository.
func (u *upgradeRepo) forward() lab.Forward {
	return lab.Forward{GuestAddr: upgradeRepoAddr, HostPort: u.port}
}

// sources is the repository's apt source, its key embedded, as make-repo.sh
// renders it for the nodes.
func (u *upgradeRepo) sources() (string, error) {
	b, err := os.ReadFile(filepath.Join(u.dir, "repo", "vco-storage.sources"))
	return string(b), err
}

// publish adds the booted package repacked with version (the same files,
// so that dpkg runs the maintainer scripts' upgrade path) to the
// repository and re-signs it.
func (u *upgradeRepo) publish(ctx context.Context, version string) error {
	tmp, err := os.MkdirTemp(u.dir, "repack.")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	pkg := filepath.Join(tmp, "pkg")
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-R", u.deb, pkg).CombinedOutput(); err != nil {
		return fmt.Errorf("dpkg-deb -R %s: %w: %s", u.deb, err, out)
	}
	control := filepath.Join(pkg, "DEBIAN", "control")
	b, err := os.ReadFile(control)
	if err != nil {
		return err
	}
	var lines []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "Version: ") {
			l = "Version: " + version
		}
		lines = append(lines, l)
	}
	if err := os.WriteFile(control, []byte(strings.Join(lines, "\n")), 0o644); err != nil {
		return err
	}
	out := filepath.Join(u.dir, "vco-agent_"+version+"_amd64.deb")
	if b, err := exec.CommandContext(ctx, "dpkg-deb", "-Znone", "-b", pkg, out).CombinedOutput(); err != nil {
		return fmt.Errorf("dpkg-deb -b %s: %w: %s", out, err, b)
	}
	return u.makeRepo(ctx)
}

// makeRepo runs make-repo.sh on the scratch directory from the module's
// root, as `make repo` does.
func (u *upgradeRepo) makeRepo(ctx context.Context) error {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return errors.New("cannot find the module's root")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	cmd := exec.CommandContext(ctx, filepath.Join(root, "packaging", "repo", "make-repo.sh"), u.dir)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "VCO_REPO_URL=http://"+strings.TrimSuffix(upgradeRepoAddr, ":80"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("make-repo.sh %s: %w: %s", u.dir, err, out)
	}
	return nil
}

func (u *upgradeRepo) close() {
	if u.srv != nil {
		_ = u.srv.Close()
	}
	_ = os.RemoveAll(u.dir)
}

// addUpgradeSource brings up the guest's NIC (the lab's MAC address, the
// user network's 10.0.2.15) and makes repo's source, with its key, the
// guest's only apt source, as a node adds vco-storage.sources
// (docs/install.md): apt-get update must verify the repository.
func addUpgradeSource(ctx context.Context, g *lab.Guest, repo *upgradeRepo) (string, error) {
	src, err := repo.sources()
	if err != nil {
		return "", err
	}
	r, err := g.Exec().RunInput(ctx, 0, []byte(src), "/bin/sh", "-c", `set -e
rm -f /etc/apt/sources.list.d/*
: >/etc/apt/sources.list
cat >/etc/apt/sources.list.d/vco-storage.sources`)
	if err == nil && r.Exit != 0 {
		err = fmt.Errorf("exit %d: %s", r.Exit, strings.TrimSpace(r.Stderr))
	}
	if err != nil {
		return "", fmt.Errorf("writing vco-storage.sources: %w", err)
	}
	out, err := g.MustSh(ctx, `set -e
dev=$(ip -o link | awk -F': ' '/link\/ether 52:54:00:12:34:56/ {print $2; exit}')
[ -n "$dev" ] || { ip -o link; echo "no NIC with the lab's MAC address"; exit 1; }
ip link set "$dev" up
ip addr add 10.0.2.15/24 dev "$dev"
apt-get update 2>&1 | tail -n 3
grep -c trusted=yes /etc/apt/sources.list.d/* || true`)
	if err != nil {
		return "", err
	}
	if strings.Contains(out, "Err:") || strings.Contains(out, "W: ") || strings.Contains(out, "E: ") {
		return "", fmt.Errorf("apt-get update against the repository: %s", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if lines[len(lines)-1] != "0" {
		return "", fmt.Errorf("a source says trusted=yes: %s", out)
	}
	return "vco-storage.sources (Signed-By: the repository's key) at http://" + strings.TrimSuffix(upgradeRepoAddr, ":80") + "/apt; apt-get update verified it", nil
}
