// Package safety holds, in its subpackages, the proofs the agent's safety
// properties rest on (docs/architecture.md): blank proves a device holds
// nothing before any format (P5), inuse proves nothing of a volume is in
// use on this node before its fence is given up (P1).
package safety
