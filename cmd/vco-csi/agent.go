package main

import (
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// newAgent connects the node service to vco-agent.
func newAgent(socket string, o agentnode.Options) (driver.NodeAgent, error) {
	return agentnode.Dial(socket, o)
}
