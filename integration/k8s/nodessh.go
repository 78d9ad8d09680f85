package k8s

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// nodeSSH is the storage suite's way into a worker: its disruptive
// patterns stop and start a node's kubelet and look at its mounts over
// SSH, to the node's address. The lab's workers run no SSH server and
// share one address (QEMU's user network), so each worker gets an
// ExternalIP of its own from the documentation range (192.0.2.N, never
// routed; set as a cloud controller would, ExternalAddresses) and the
// suite reaches them through this SSH "bastion" on the host's loopback
// (e2e.test's KUBE_SSH_BASTION): a connection the suite asks it to open
// to N:22 is served by an SSH server of its own that runs each command in
// worker N with the lab's exec channel, as root, and answers its output
// and exit status. Only the key it generated is let in.
type nodeSSH struct {
	// Addr is the bastion's host:port, KeyPath the client's private key
	// (OpenSSH PEM) for KUBE_SSH_KEY_PATH.
	Addr, KeyPath string

	cfg   *ssh.ServerConfig
	ln    net.Listener
	nodes map[string]sshNode // "192.0.2.N" -> worker
	log   io.Writer
	wg    sync.WaitGroup
}

// sshNode is a worker as the bastion serves it: its name, and how a
// command runs in it (the lab's exec channel; tests give a fake).
type sshNode struct {
	name string
	sh   func(ctx context.Context, script string) (*guestexec.Result, error)
}

// externalIP is worker i's (0-based) ExternalIP.
func externalIP(i int) string { return fmt.Sprintf("192.0.2.%d", 10+i) }

// startNodeSSH serves the bastion for the workers gs (ExternalIP i for
// gs[i]) and writes its client key into dir.
func startNodeSSH(dir string, gs []*lab.Guest, log io.Writer) (*nodeSSH, error) {
	nodes := make([]sshNode, len(gs))
	for i, g := range gs {
		// As sshd does, through the user's shell: root's is bash, whose
		// "command not found" is what the suite looks for to tell that
		// a node has no sudo (storage/utils isSudoPresent).
		nodes[i] = sshNode{name: g.Name, sh: func(ctx context.Context, script string) (*guestexec.Result, error) {
			return g.Exec().Run(ctx, 0, "/bin/bash", "-c", script)
		}}
	}
	return serveNodeSSH(dir, nodes, log)
}

func serveNodeSSH(dir string, gs []sshNode, log io.Writer) (*nodeSSH, error) {
	_, hostPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	hostKey, err := ssh.NewSignerFromKey(hostPriv)
	if err != nil {
		return nil, err
	}
	clientPub, clientPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	block, err := ssh.MarshalPrivateKey(clientPriv, "vco-lab storage suite")
	if err != nil {
		return nil, err
	}
	keyPath := filepath.Join(dir, "suite-ssh-key")
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(block), 0o600); err != nil {
		return nil, err
	}
	allowed, err := ssh.NewPublicKey(clientPub)
	if err != nil {
		return nil, err
	}
	cfg := &ssh.ServerConfig{PublicKeyCallback: func(_ ssh.ConnMetadata, k ssh.PublicKey) (*ssh.Permissions, error) {
		if string(k.Marshal()) != string(allowed.Marshal()) {
			return nil, errors.New("not the storage suite's key")
		}
		return nil, nil
	}}
	cfg.AddHostKey(hostKey)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &nodeSSH{Addr: ln.Addr().String(), KeyPath: keyPath, cfg: cfg, ln: ln, nodes: map[string]sshNode{}, log: log}
	for i, g := range gs {
		s.nodes[externalIP(i)] = g
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() { defer s.wg.Done(); s.serveBastion(c) }()
		}
	}()
	return s, nil
}

// Env is what e2e.test needs to use the bastion.
func (s *nodeSSH) Env() []string {
	return []string{"KUBE_SSH_BASTION=" + s.Addr, "KUBE_SSH_KEY_PATH=" + s.KeyPath, "KUBE_SSH_USER=root"}
}

// Stop closes the listener; connections in flight end with their commands.
func (s *nodeSSH) Stop() {
	s.ln.Close()
	s.wg.Wait()
}

// serveBastion serves one client of the bastion: it only forwards
// (direct-tcpip) to a worker's port 22.
func (s *nodeSSH) serveBastion(c net.Conn) {
	defer c.Close()
	_, chans, reqs, err := ssh.NewServerConn(c, s.cfg)
	if err != nil {
		return
	}
	go ssh.DiscardRequests(reqs)
	for nc := range chans {
		if nc.ChannelType() != "direct-tcpip" {
			_ = nc.Reject(ssh.UnknownChannelType, "the lab's bastion only forwards to a worker's port 22")
			continue
		}
		var to struct {
			Host     string
			Port     uint32
			OrigHost string
			OrigPort uint32
		}
		if err := ssh.Unmarshal(nc.ExtraData(), &to); err != nil {
			_ = nc.Reject(ssh.ConnectionFailed, "malformed forward request")
			continue
		}
		g, ok := s.nodes[to.Host]
		if !ok || to.Port != 22 {
			_ = nc.Reject(ssh.ConnectionFailed, net.JoinHostPort(to.Host, strconv.Itoa(int(to.Port)))+" is no worker's SSH address")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		go ssh.DiscardRequests(creqs)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer ch.Close()
			s.serveNode(&channelConn{Channel: ch}, g)
		}()
	}
}

// serveNode is the SSH server of worker g over one forwarded connection:
// sessions whose exec requests run in g.
func (s *nodeSSH) serveNode(c net.Conn, g sshNode) {
	_, chans, reqs, err := ssh.NewServerConn(c, s.cfg)
	if err != nil {
		return
	}
	go ssh.DiscardRequests(reqs)
	for nc := range chans {
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.UnknownChannelType, "sessions only")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.session(ch, creqs, g) }()
	}
}

// session runs the session's one command in g; anything but an exec
// request (a shell, a terminal) is refused.
func (s *nodeSSH) session(ch ssh.Channel, reqs <-chan *ssh.Request, g sshNode) {
	defer ch.Close()
	for r := range reqs {
		if r.Type != "exec" {
			_ = r.Reply(r.Type == "env", nil)
			continue
		}
		var cmd struct{ Command string }
		if err := ssh.Unmarshal(r.Payload, &cmd); err != nil {
			_ = r.Reply(false, nil)
			continue
		}
		_ = r.Reply(true, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		res, err := g.sh(ctx, cmd.Command)
		cancel()
		status := uint32(255)
		if err != nil {
			fmt.Fprintf(ch.Stderr(), "vco-lab: running the command in %s: %v\n", g.name, err)
		} else {
			_, _ = io.WriteString(ch, res.Stdout)
			_, _ = io.WriteString(ch.Stderr(), res.Stderr)
			status = uint32(res.Exit)
		}
		fmt.Fprintf(s.log, "k8s: suite ssh %s: %q: exit %d\n", g.name, cmd.Command, status)
		_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{status}))
		return
	}
}

// channelConn is an SSH channel as the net.Conn an SSH server takes.
type channelConn struct{ ssh.Channel }

type labAddr struct{}

func (labAddr) Network() string { return "ssh-channel" }
func (labAddr) String() string  { return "forwarded" }

func (channelConn) LocalAddr() net.Addr              { return labAddr{} }
func (channelConn) RemoteAddr() net.Addr             { return labAddr{} }
func (channelConn) SetDeadline(time.Time) error      { return nil }
func (channelConn) SetReadDeadline(time.Time) error  { return nil }
func (channelConn) SetWriteDeadline(time.Time) error { return nil }
