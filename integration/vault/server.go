package vault

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// Server is a Vault server the lab started: file storage in Dir/data, a
// TLS listener on 127.0.0.1 with a certificate of the lab's CA (CACert),
// not dev mode. It starts sealed and uninitialised.
type Server struct {
	Bin    string // the server's binary, which is its CLI too
	Dir    string
	Addr   string // https://127.0.0.1:port
	CACert string // the CA the listener's certificate chains to
	cmd    *exec.Cmd
	exited chan struct{} // closed when the process has ended
	err    error         // its exit status, once exited is closed
}

// config is the server's configuration file: what an operator writes,
// with file storage and TLS on loopback.
const config = `storage "file" {
  path = %q
}
listener "tcp" {
  address       = %q
  tls_cert_file = %q
  tls_key_file  = %q
}
api_addr      = %q
disable_mlock = true
ui            = false
log_level     = "info"
`

// Options say where a server listens: Port on 127.0.0.1 (0: a free one)
// and the names its certificate is for besides 127.0.0.1 (the address the
// lab's guests dial, say).
type Options struct {
	Port  int
	Hosts []string
}

// Start writes a CA, the listener's certificate and the configuration
// into dir and starts bin as a server on 127.0.0.1; it returns once the
// listener answers. The server's log is dir/server.log.
func Start(ctx context.Context, bin, dir string, o Options) (*Server, error) {
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o700); err != nil {
		return nil, err
	}
	if err := writePKI(dir, append([]string{"127.0.0.1"}, o.Hosts...)...); err != nil {
		return nil, fmt.Errorf("the Vault server's certificates: %w", err)
	}
	port := o.Port
	if port == 0 {
		var err error
		if port, err = freePort(); err != nil {
			return nil, err
		}
	}
	hostPort := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	s := &Server{Bin: bin, Dir: dir, Addr: "https://" + hostPort, CACert: filepath.Join(dir, "ca.crt"), exited: make(chan struct{})}
	cfg := fmt.Sprintf(config, filepath.Join(dir, "data"), hostPort,
		filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key"), s.Addr)
	cfgPath := filepath.Join(dir, "server.hcl")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	if err := s.start(cfgPath); err != nil {
		return nil, err
	}
	if err := s.waitListening(ctx, 60*time.Second); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// Restart starts a stopped server again with its configuration and its
// data; it comes back sealed.
func (s *Server) Restart(ctx context.Context) error {
	if s.cmd != nil {
		return errors.New("the Vault server is running; stop it first")
	}
	s.exited = make(chan struct{})
	if err := s.start(filepath.Join(s.Dir, "server.hcl")); err != nil {
		return err
	}
	if err := s.waitListening(ctx, 60*time.Second); err != nil {
		s.Stop()
		return err
	}
	return nil
}

// start runs the server process, its log appended to Dir/server.log.
func (s *Server) start(cfgPath string) error {
	logf, err := os.OpenFile(filepath.Join(s.Dir, "server.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	s.cmd = exec.Command(s.Bin, "server", "-config="+cfgPath)
	s.cmd.Env = s.Env("")
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("starting the Vault server %s: %w", s.Bin, err)
	}
	go func() { s.err = s.cmd.Wait(); logf.Close(); close(s.exited) }()
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Env is the environment of the server and of its CLI: nothing of the
// caller's own Vault settings, the server's address and CA, and token if
// not empty.
func (s *Server) Env(token string) []string {
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + s.Dir,
		"VAULT_ADDR=" + s.Addr, "VAULT_CACERT=" + s.CACert}
	if token != "" {
		env = append(env, "VAULT_TOKEN="+token)
	}
	return env
}

// waitListening polls sys/health over TLS, verified against the lab's CA,
// until the server answers (a sealed, uninitialised server answers too).
func (s *Server) waitListening(ctx context.Context, limit time.Duration) error {
	pem, err := os.ReadFile(s.CACert)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	c := &http.Client{Timeout: 2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
	deadline := time.Now().Add(limit)
	var last error
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return fmt.Errorf("the Vault server exited before it listened (%v); its log: %s", s.err, filepath.Join(s.Dir, "server.log"))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		resp, err := c.Get(s.Addr + "/v1/sys/health")
		if err == nil {
			resp.Body.Close()
			return nil
		}
		last = err
	}
	return fmt.Errorf("the Vault server did not answer on %s within %s: %v; its log: %s", s.Addr, limit, last, filepath.Join(s.Dir, "server.log"))
}

// CLI runs the server's own CLI (`vault args...`) against it, with token
// as VAULT_TOKEN when not empty, and returns its standard output. A
// failure's error carries the CLI's standard error, which names no
// secret of the command line.
func (s *Server) CLI(ctx context.Context, token string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, s.Bin, args...)
	cmd.Env = s.Env(token)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return out, fmt.Errorf("vault %s: %w: %s", args[0], err, ee.Stderr)
		}
		return out, fmt.Errorf("vault %s: %w", args[0], err)
	}
	return out, nil
}

// Init initialises the server with one unseal key share (threshold 1) and
// returns the share and the root token.
func (s *Server) Init(ctx context.Context) (unsealKey, rootToken string, err error) {
	out, err := s.CLI(ctx, "", "operator", "init", "-key-shares=1", "-key-threshold=1", "-format=json")
	if err != nil {
		return "", "", err
	}
	var r struct {
		Keys      []string `json:"unseal_keys_b64"`
		RootToken string   `json:"root_token"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		return "", "", fmt.Errorf("vault operator init: its answer is not the expected JSON: %w", err)
	}
	if len(r.Keys) != 1 || r.RootToken == "" {
		return "", "", fmt.Errorf("vault operator init: %d unseal keys and a root token of %d characters, want 1 key and a token", len(r.Keys), len(r.RootToken))
	}
	return r.Keys[0], r.RootToken, nil
}

// Status is what `vault status` reports of the seal.
type Status struct {
	Initialized bool `json:"initialized"`
	Sealed      bool `json:"sealed"`
}

// Status runs `vault status`, whose exit code is 2 when the server is
// sealed: that is an answer, not a failure.
func (s *Server) Status(ctx context.Context) (Status, error) {
	out, err := s.CLI(ctx, "", "status", "-format=json")
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 2) {
		return Status{}, err
	}
	var st Status
	if err := json.Unmarshal(out, &st); err != nil {
		return Status{}, fmt.Errorf("vault status: its answer is not the expected JSON: %w", err)
	}
	return st, nil
}

// Unseal gives the server the unseal key share. The CLI reads a key on
// standard input only from a terminal, so the share is its argument, as
// its help says for scripts: a lab's throwaway share, visible for the
// moment of the call to this machine's root only. Errors name no key.
func (s *Server) Unseal(ctx context.Context, key string) error {
	_, err := s.CLI(ctx, "", "operator", "unseal", key)
	return err
}

// Stop ends the server (SIGTERM, then SIGKILL after 10 s) and waits for it.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	s.cmd = nil
}
