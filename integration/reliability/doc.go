// Package reliability holds the host-tier tests that cross package
// boundaries: hostile requests against the built vco-agent over its real
// socket and against the CSI plugin over the simulator, secrets pushed
// through every path and searched for in everything the stack prints,
// cloud API faults, and the crash loop that SIGKILLs `vco-agent serve`
// mid-stage and mid-unstage on a real loop device.
//
// The tests run as root (loop devices and mounts). `make soak` runs them
// with more rounds and writes the figures to docs/reliability.md
// (VCO_RELIABILITY_REPORT names the file).
package reliability
