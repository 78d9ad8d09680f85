// Package api is the vco-agent's published gRPC API: agent.proto and the Go
// code generated from it by `make proto`. Clients (the CSI node plugin, the
// vco-agent CLI) depend on this package only, never on the daemon's
// internals.
package api
