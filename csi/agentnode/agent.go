// Package agentnode is the CSI node service's view of vco-agent: the
// driver.NodeAgent interface implemented over the agent's published gRPC
// API (agent/api) on its unix socket. The node plugin holds no cloud
// credential and does no privileged work; it asks the agent.
package agentnode

import (
	"context"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// Agent is a connection to vco-agent.
type Agent struct {
	c *client.Client
}

// Dial connects to the agent at socket; it fails when nothing serves it.
func Dial(socket string) (*Agent, error) {
	c, err := client.Dial(socket)
	if err != nil {
		return nil, err
	}
	return &Agent{c: c}, nil
}

// Close drops the connection.
func (a *Agent) Close() error { return a.c.Close() }

// Identity asks the agent who this node is.
func (a *Agent) Identity(ctx context.Context) (driver.NodeIdentity, error) {
	id, err := a.c.GetIdentity(ctx, &api.GetIdentityRequest{})
	if err != nil {
		return driver.NodeIdentity{}, fmt.Errorf("vco-agent at %s: %w", a.c.Socket, err)
	}
	return driver.NodeIdentity{UUID: id.GetSystemUuid(), Location: id.GetLocation()}, nil
}

// The agent's API has no volume methods yet. Until it does, each of these
// says so with UNIMPLEMENTED rather than pretending.
func (a *Agent) missing(op string) error {
	return status.Errorf(codes.Unimplemented, "vco-agent at %s has no %s method in this version; upgrade the agent", a.c.Socket, op)
}

func (a *Agent) Stage(context.Context, driver.StageRequest) error     { return a.missing("stage") }
func (a *Agent) Unstage(context.Context, string, string) error        { return a.missing("unstage") }
func (a *Agent) Publish(context.Context, driver.PublishRequest) error { return a.missing("publish") }
func (a *Agent) Unpublish(context.Context, string, string) error      { return a.missing("unpublish") }
func (a *Agent) Expand(context.Context, string, string, int64) (int64, error) {
	return 0, a.missing("expand")
}
func (a *Agent) Stats(context.Context, string, string) (driver.VolumeStats, error) {
	return driver.VolumeStats{}, a.missing("stats")
}
