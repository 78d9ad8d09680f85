// Package client connects to a running vco-agent over its unix socket. It
// turns the ways a connection fails (no socket, a stale socket, no
// permission) into one sentence an operator can act on; the CLI and the
// CSI node plugin both use it.
package client

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
)

// DefaultSocket is where the packaged agent listens.
const DefaultSocket = "/run/vco-agent/agent.sock"

// ErrNotRunning marks a failure to reach the agent because nothing serves
// the socket.
var ErrNotRunning = errors.New("vco-agent is not running")

// Client is a connection to the agent.
type Client struct {
	api.AgentClient
	conn *grpc.ClientConn
	// Socket is the path connected to.
	Socket string
}

// Dial checks that an agent answers on socket and returns a client.
func Dial(socket string) (*Client, error) {
	c, err := net.DialTimeout("unix", socket, 3*time.Second)
	if err != nil {
		return nil, explain(socket, err)
	}
	c.Close()
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(false)))
	if err != nil {
		return nil, fmt.Errorf("connecting to vco-agent at %s: %w", socket, err)
	}
	return &Client{AgentClient: api.NewAgentClient(conn), conn: conn, Socket: socket}, nil
}

func explain(socket string, err error) error {
	check := "check `systemctl status vco-agent.socket vco-agent.service`"
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: there is no socket at %s; %s", ErrNotRunning, socket, check)
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("%w: nothing is listening on %s (a stale socket); %s", ErrNotRunning, socket, check)
	case errors.Is(err, fs.ErrPermission):
		return fmt.Errorf("cannot open the vco-agent socket %s: permission denied; run as root or as a member of the agent's socket group", socket)
	}
	return fmt.Errorf("cannot reach vco-agent at %s: %v; %s", socket, err, check)
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// AskAgain makes call, and makes it again while the agent answers ABORTED:
// another request, or the agent's periodic claim check, holds the volume
// for a moment, and the answer asks the caller to come back, as the
// kubelet does. When ctx ends it returns the last answer.
func AskAgain(ctx context.Context, call func(ctx context.Context) error) error {
	err := call(ctx)
	for status.Code(err) == codes.Aborted {
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		err = call(ctx)
	}
	return err
}
