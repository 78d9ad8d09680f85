package k8s

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"io"
	"net"
	"os"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
)

// suiteSSH runs cmd on host through the bastion as e2e.test does with
// KUBE_SSH_BASTION (test/e2e/framework/ssh): an SSH connection to the
// bastion, a forward to host, an SSH session over it.
func suiteSSH(t *testing.T, s *nodeSSH, key []byte, host, cmd string) (stdout, stderr string, code int, err error) {
	t.Helper()
	signer, err := ssh.ParsePrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &ssh.ClientConfig{User: "root", Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)}, HostKeyCallback: ssh.InsecureIgnoreHostKey()}
	bc, err := ssh.Dial("tcp", s.Addr, cfg)
	if err != nil {
		return "", "", 0, err
	}
	defer bc.Close()
	conn, err := bc.Dial("tcp", host)
	if err != nil {
		return "", "", 0, err
	}
	defer conn.Close()
	ncc, chans, reqs, err := ssh.NewClientConn(conn, host, cfg)
	if err != nil {
		return "", "", 0, err
	}
	c := ssh.NewClient(ncc, chans, reqs)
	defer c.Close()
	sess, err := c.NewSession()
	if err != nil {
		return "", "", 0, err
	}
	defer sess.Close()
	var out, errOut strings.Builder
	sess.Stdout, sess.Stderr = &out, &errOut
	if err := sess.Run(cmd); err != nil {
		if ee, ok := err.(*ssh.ExitError); ok {
			return out.String(), errOut.String(), ee.ExitStatus(), nil
		}
		return "", "", 0, err
	}
	return out.String(), errOut.String(), 0, nil
}

// The bastion takes the suite to the worker whose ExternalIP it asks for,
// runs the command there and answers its output and exit status; other
// addresses and other keys are refused.
func TestNodeSSHRunsTheSuitesCommandsInTheRightWorker(t *testing.T) {
	ran := map[string][]string{}
	node := func(name string) sshNode {
		return sshNode{name: name, sh: func(_ context.Context, script string) (*guestexec.Result, error) {
			ran[name] = append(ran[name], script)
			if script == "systemctl stop kubelet" {
				return &guestexec.Result{Stdout: "stopped on " + name + "\n"}, nil
			}
			return &guestexec.Result{Stderr: "sh: sudo: not found\n", Exit: 127}, nil
		}}
	}
	s, err := serveNodeSSH(t.TempDir(), []sshNode{node("node-a"), node("node-b")}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	key, err := os.ReadFile(s.KeyPath)
	if err != nil {
		t.Fatal(err)
	}
	out, _, code, err := suiteSSH(t, s, key, net.JoinHostPort(externalIP(1), "22"), "systemctl stop kubelet")
	if err != nil || code != 0 || out != "stopped on node-b\n" || len(ran["node-a"]) != 0 {
		t.Fatalf("stop on node-b: %q %d %v; ran %v", out, code, err, ran)
	}
	_, errOut, code, err := suiteSSH(t, s, key, net.JoinHostPort(externalIP(0), "22"), "sudo --version")
	if err != nil || code != 127 || !strings.Contains(errOut, "sudo: not found") {
		t.Fatalf("sudo --version on node-a: %q %d %v", errOut, code, err)
	}
	if _, _, _, err := suiteSSH(t, s, key, "192.0.2.99:22", "true"); err == nil {
		t.Fatal("a forward to no worker's address was served")
	}
	if _, _, _, err := suiteSSH(t, s, key, net.JoinHostPort(externalIP(0), "2222"), "true"); err == nil {
		t.Fatal("a forward to another port was served")
	}
	_, other, _ := ed25519Key(t)
	if _, _, _, err := suiteSSH(t, s, other, net.JoinHostPort(externalIP(0), "22"), "true"); err == nil {
		t.Fatal("another key was let in")
	}
	if len(ran["node-a"]) != 1 || len(ran["node-b"]) != 1 {
		t.Fatalf("commands run: %v", ran)
	}
}

// ed25519Key is a fresh key in OpenSSH PEM form.
func ed25519Key(t *testing.T) (ed25519.PublicKey, []byte, ed25519.PrivateKey) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	b, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	return pub, pem.EncodeToMemory(b), priv
}
