package main

import (
	"fmt"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

// newAgent connects the node service to vco-agent.
func newAgent(socket string) (driver.NodeAgent, error) {
	return nil, fmt.Errorf("the node service needs the vco-agent client, which this build lacks (agent socket %s)", socket)
}

// fenceKey is the fence key derivation shared with the agent; nil until
// the fence package provides it, so grants name superseded nodes only.
var fenceKey driver.FenceKeyFunc
