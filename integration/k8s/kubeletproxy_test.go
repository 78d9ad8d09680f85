package k8s

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// dialThrough dials addr through the proxy as the API server's egress
// selector does (HTTPConnect over a unix socket).
func dialThrough(ctx context.Context, socket, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
	br := bufio.NewReader(c)
	res, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		c.Close()
		return nil, err
	}
	if res.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(res.Body)
		c.Close()
		return nil, fmt.Errorf("CONNECT %s: %s: %s", addr, res.Status, b)
	}
	return c, nil
}

func TestKubeletProxyTunnelsToTheNodesForward(t *testing.T) {
	// A stand-in kubelet: echoes one line, upper-cased.
	kl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer kl.Close()
	go func() {
		for {
			c, err := kl.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, _ := bufio.NewReader(c).ReadString('\n')
				io.WriteString(c, strings.ToUpper(line))
			}()
		}
	}()
	port := kl.Addr().(*net.TCPAddr).Port
	p, err := startKubeletProxy(filepath.Join(t.TempDir(), "kubelets.sock"), map[string]int{"node-a": port})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := dialThrough(ctx, p.Socket, "node-a:"+strconv.Itoa(KubeletPort))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "exec ls\n")
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || got != "EXEC LS\n" {
		t.Fatalf("through the tunnel: %q, %v", got, err)
	}
	// Only a worker's kubelet port is reached: no other node, no other
	// port, nothing on the host.
	for _, addr := range []string{"node-b:10250", "node-a:22", "127.0.0.1:" + strconv.Itoa(port)} {
		if c, err := dialThrough(ctx, p.Socket, addr); err == nil {
			c.Close()
			t.Errorf("CONNECT %s went through", addr)
		} else if !strings.Contains(err.Error(), "502") {
			t.Errorf("CONNECT %s: %v, want 502 Bad Gateway", addr, err)
		}
	}
}

func TestEgressConfigNamesTheProxy(t *testing.T) {
	p, err := startKubeletProxy(filepath.Join(t.TempDir(), "kubelets.sock"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	path, err := p.egressConfig(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(path)
	for _, want := range []string{"kind: EgressSelectorConfiguration", "- name: cluster", "proxyProtocol: HTTPConnect", "uds:\n        udsName: " + p.Socket + "\n"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("egress config lacks %q:\n%s", want, b)
		}
	}
}
