package main

import (
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// newAgent connects the node service to vco-agent.
func newAgent(socket string) (driver.NodeAgent, error) {
	return agentnode.Dial(socket)
}

// fenceKey is the fence key derivation shared with the agent; nil until
// the fence package provides it, so grants name superseded nodes only.
var fenceKey driver.FenceKeyFunc
