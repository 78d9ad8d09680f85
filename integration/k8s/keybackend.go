package k8s

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/vault"
)

// The key backend's names in the lab: docs/encryption.md's recipe for a
// cluster called lab (its prod-1 read as lab).
const (
	ClusterName  = "lab"
	TransitMount = "transit-" + ClusterName
	AuthMount    = "kubernetes-" + ClusterName
	TransitRole  = "vco-csi-node"
	TransitKey   = "vco-csi-volumes"
)

// recipeHeading is the section of docs/encryption.md the lab follows.
const recipeHeading = "## Setting up the key backend"

// keyBackend is the Vault server K7 runs as the cluster's key backend: a
// build of integration/vault started on the host port the workers reach
// as HostInGuest:GuestTransitPort, initialised and unsealed, set up by
// docs/encryption.md's recipe, its requests in an audit log.
type KeyBackend struct {
	Srv  *vault.Server
	root string // the root token, the recipe's administrator
	Key  string // the one unseal key share
	// recipe are the recipe's blocks as the lab read them (its
	// placeholders replaced), once followed.
	recipe []vault.Block
	dir    string // the operator's working directory of the recipe
	audit  string // the file audit device's log
}

// StartKeyBackend builds (or takes from the cache) the Vault server,
// starts it on port with a certificate for HostInGuest, initialises and
// unseals it and turns its audit log on.
func (c *Cluster) StartKeyBackend(ctx context.Context, port int, log io.Writer) (*KeyBackend, error) {
	bin, err := vault.Build(ctx, lab.DefaultCacheDir(), log)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(c.Env.Lab.Dir(), "vault")
	srv, err := vault.Start(ctx, bin, dir, vault.Options{Port: port, Hosts: []string{HostInGuest}})
	if err != nil {
		return nil, err
	}
	kb := &KeyBackend{Srv: srv, dir: filepath.Join(dir, "operator"), audit: filepath.Join(dir, "audit.log")}
	if err := kb.unseal(ctx); err != nil {
		srv.Stop()
		return nil, err
	}
	if err := kb.enableAudit(ctx); err != nil {
		srv.Stop()
		return nil, err
	}
	return kb, os.MkdirAll(kb.dir, 0o700)
}

// unseal initialises the server with one key share and unseals it.
func (kb *KeyBackend) unseal(ctx context.Context) error {
	key, root, err := kb.Srv.Init(ctx)
	if err != nil {
		return err
	}
	kb.root, kb.Key = root, key
	return kb.Srv.Unseal(ctx, key)
}

// describe names the server for the report.
func (kb *KeyBackend) Describe() string {
	return fmt.Sprintf("Vault %s built from source at %s (file storage, TLS)", vault.Version, kb.Srv.Addr)
}

// recipeSubst are the recipe's placeholders read for the lab, in order.
func (c *Cluster) recipeSubst() [][2]string {
	return [][2]string{
		{"<prod-1 api server>:6443", "127.0.0.1:" + strconv.Itoa(c.cp.apiPort)},
		{"prod-1", ClusterName},
		{"https://openbao.example.net:8200", fmt.Sprintf("https://%s:%d", HostInGuest, GuestTransitPort)},
		{"make csi-addon VCO_CSI_IMAGE=try.whitesky.cloud/vco/csi:1.0",
			fmt.Sprintf("make -s -C %s csi-addon VCO_CSI_IMAGE=%s ADDON_DIR=%s", repoRoot(), Image, filepath.Join(c.Env.Lab.Dir(), "addon"))},
	}
}

// FollowRecipe runs docs/encryption.md's key backend recipe block by
// block, as an operator would, in kb.dir: shell blocks with bash (bao is
// the server's own CLI, logged in as the administrator; kubectl the
// cluster's, with the administrator's kubeconfig), a block the prose
// names a file saved to that file, a yaml block applied. The server's CA
// is in kb.dir as openbao-ca.pem, where the recipe reads it. Before a
// block reads the token reviewer's Secret, it waits until the cluster
// has filled it.
func (c *Cluster) FollowRecipe(ctx context.Context, kb *KeyBackend) (int, error) {
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "encryption.md"))
	if err != nil {
		return 0, err
	}
	blocks, err := vault.Recipe(doc, recipeHeading)
	if err != nil {
		return 0, fmt.Errorf("docs/encryption.md: %w", err)
	}
	if err := c.operatorTools(kb); err != nil {
		return 0, err
	}
	for i := range blocks {
		b := &blocks[i]
		for _, r := range c.recipeSubst() {
			b.Text = strings.ReplaceAll(b.Text, r[0], r[1])
			b.File = strings.ReplaceAll(b.File, r[0], r[1])
		}
		if err := c.recipeBlock(ctx, kb, *b); err != nil {
			return i, fmt.Errorf("docs/encryption.md %q, block %d (%s): %w\n%s", recipeHeading, i+1, b.Lang, err, b.Text)
		}
	}
	kb.recipe = blocks
	return len(blocks), nil
}

// operatorTools puts the operator's tools in kb.dir/bin (bao: the
// server's CLI; kubectl) and the server's CA in kb.dir.
func (c *Cluster) operatorTools(kb *KeyBackend) error {
	bin := filepath.Join(kb.dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return err
	}
	for name, target := range map[string]string{"bao": kb.Srv.Bin, "kubectl": c.Bins.Kubectl} {
		_ = os.Remove(filepath.Join(bin, name))
		if err := os.Symlink(target, filepath.Join(bin, name)); err != nil {
			return err
		}
	}
	ca, err := os.ReadFile(kb.Srv.CACert)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(kb.dir, "openbao-ca.pem"), ca, 0o644)
}

// recipeBlock runs, saves or applies one block of the recipe.
func (c *Cluster) recipeBlock(ctx context.Context, kb *KeyBackend, b vault.Block) error {
	switch {
	case b.File != "":
		return os.WriteFile(filepath.Join(kb.dir, b.File), []byte(b.Text), 0o600)
	case b.Lang == "yaml":
		_, err := c.KubectlInput(ctx, strings.NewReader(b.Text), "apply", "-f", "-")
		return err
	case b.Lang != "sh":
		return fmt.Errorf("a %s block that names no file to save it to", b.Lang)
	}
	if strings.Contains(b.Text, "vco-csi-token-reviewer") {
		if err := c.waitReviewerToken(ctx); err != nil {
			return err
		}
	}
	_, err := c.OperatorSh(ctx, kb, b.Text)
	return err
}

// OperatorSh runs script with bash as the recipe's operator: in kb.dir,
// bao logged in as the administrator, kubectl the cluster's.
func (c *Cluster) OperatorSh(ctx context.Context, kb *KeyBackend, script string) (string, error) {
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Dir = kb.dir
	cmd.Env = append(kb.Srv.Env(kb.root), "PATH="+filepath.Join(kb.dir, "bin")+":"+os.Getenv("PATH"), "KUBECONFIG="+c.Kubeconfig)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%w: %s", err, lab.LastLines(out.String()+stderr.String(), 10))
	}
	return out.String(), nil
}

// recipeCommand is the recipe's shell command (with its continuation
// lines) that starts with prefix.
func (kb *KeyBackend) RecipeCommand(prefix string) (string, error) {
	for _, b := range kb.recipe {
		if b.Lang != "sh" {
			continue
		}
		lines := strings.Split(b.Text, "\n")
		for i, l := range lines {
			if !strings.HasPrefix(l, prefix) {
				continue
			}
			cmd := []string{l}
			for j := i; strings.HasSuffix(lines[j], "\\") && j+1 < len(lines); j++ {
				cmd = append(cmd, lines[j+1])
			}
			return strings.Join(cmd, "\n"), nil
		}
	}
	return "", fmt.Errorf("docs/encryption.md's recipe has no command starting %q", prefix)
}

// waitReviewerToken waits until the cluster has filled the token
// reviewer's Secret, which the encryption part creates empty.
func (c *Cluster) waitReviewerToken(ctx context.Context) error {
	return WaitFor(ctx, 2*time.Minute, "the token reviewer's Secret filled", func() (bool, string, error) {
		out, err := c.Kubectl(ctx, "-n", AddonNamespace, "get", "secret", "vco-csi-token-reviewer", "-o", "jsonpath={.data.token}")
		return err == nil && strings.TrimSpace(out) != "", fmt.Sprint(err), nil
	})
}

// enableAudit turns on a file audit device, so the lab sees in the
// server's own log which requests it answered.
func (kb *KeyBackend) enableAudit(ctx context.Context) error {
	_, err := kb.Srv.CLI(ctx, kb.root, "audit", "enable", "file", "file_path="+kb.audit)
	return err
}

// answered counts the requests to path the server answered without an
// error, by its audit log.
func (kb *KeyBackend) Answered(path string) (int, error) {
	f, err := os.Open(kb.audit)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		var e struct {
			Type    string
			Error   string
			Request struct{ Path string }
		}
		if json.Unmarshal(sc.Bytes(), &e) == nil && e.Type == "response" && e.Error == "" && e.Request.Path == path {
			n++
		}
	}
	return n, sc.Err()
}
