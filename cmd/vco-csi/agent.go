package main

import (
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
)

// newAgent connects the node service to vco-agent.
func newAgent(socket string, o agentnode.Options) (*agentnode.Agent, error) {
	return agentnode.Dial(socket, o)
}
