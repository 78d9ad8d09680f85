package k8s

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"
)

// KubeletPort is the kubelet's port in the workers.
const KubeletPort = 10250

// kubeletProxy is how the API server reaches the kubelets (kubectl exec,
// logs, port-forward; the storage suite's pods are read with exec): the
// workers' QEMU user networks route nothing from the host, and every
// worker has the same address, so each worker's kubelet port is forwarded
// to a port of the host's loopback (lab.Inbound), and the API server's
// egress selector sends its "cluster" traffic through this HTTP CONNECT
// proxy, which takes a node's name (the API server dials the Hostname
// address, which is the node's name) to that node's forward. Anything
// else is refused. It listens on a unix socket: kube-apiserver v1.34
// takes a CONNECT proxy over TCP only with TLS client certificates.
type kubeletProxy struct {
	// Socket is the path of the proxy's unix socket.
	Socket string
	ln     net.Listener
	ports  map[string]int // node name -> host port of its kubelet
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]bool
}

// startKubeletProxy serves on the unix socket socket for the nodes'
// kubelet forwards (node name -> host port).
func startKubeletProxy(socket string, ports map[string]int) (*kubeletProxy, error) {
	_ = os.Remove(socket) // a lab directory used before
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("the kubelet proxy: %w", err)
	}
	p := &kubeletProxy{Socket: socket, ln: ln, ports: ports, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.track(c, true)
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer p.track(c, false)
				p.serve(c)
			}()
		}
	}()
	return p, nil
}

func (p *kubeletProxy) track(c net.Conn, add bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		p.conns[c] = true
	} else {
		delete(p.conns, c)
		c.Close()
	}
}

// serve answers one CONNECT and splices the tunnel.
func (p *kubeletProxy) serve(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	reply := func(code int, msg string) {
		fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Length: %d\r\n\r\n%s", code, http.StatusText(code), len(msg), msg)
	}
	if req.Method != http.MethodConnect {
		reply(http.StatusMethodNotAllowed, "the lab's kubelet proxy only tunnels CONNECT\n")
		return
	}
	target, err := p.target(req.Host)
	if err != nil {
		reply(http.StatusBadGateway, err.Error()+"\n")
		return
	}
	up, err := net.DialTimeout("tcp", target, 10*time.Second)
	if err != nil {
		reply(http.StatusBadGateway, fmt.Sprintf("%s (%s): %v\n", req.Host, target, err))
		return
	}
	p.track(up, true)
	defer p.track(up, false)
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() {
		// Bytes the client sent after its request are in br.
		_, _ = io.Copy(up, br)
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(c, up)
		if uc, ok := c.(*net.UnixConn); ok {
			_ = uc.CloseWrite()
		}
		done <- struct{}{}
	}()
	<-done
	<-done
}

// target is the loopback forward of a node's kubelet port, for
// "<node>:10250".
func (p *kubeletProxy) target(hostport string) (string, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", fmt.Errorf("CONNECT %q: %v", hostport, err)
	}
	hp, ok := p.ports[host]
	if !ok || port != strconv.Itoa(KubeletPort) {
		return "", fmt.Errorf("CONNECT %s: the lab's kubelet proxy reaches only the workers' kubelets (a worker's name, port %d)", hostport, KubeletPort)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(hp)), nil
}

// Stop closes the listener and every tunnel.
func (p *kubeletProxy) Stop() {
	p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// egressConfig writes the API server's egress selector configuration
// that sends its traffic to nodes and pods through the proxy.
func (p *kubeletProxy) egressConfig(dir string) (string, error) {
	path := filepath.Join(dir, "egress-selector.yaml")
	cfg := fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: %s
`, p.Socket)
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}
