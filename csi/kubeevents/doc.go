// Package kubeevents shows a node's fencing events in Kubernetes. The node
// plugin follows vco-agent's event stream (WatchEvents, agent/api) and posts
// a core/v1 Event about its Node for each refusal, fence loss, takeover and
// re-established claim, and, through Users, which the node service tells
// which claim each volume was made for and which pods it is published to,
// about the volume's PersistentVolumeClaim and pods, so `kubectl describe
// pvc`, `kubectl describe pod` and `kubectl describe node` show what the
// node's journal shows (docs/events.md, "In Kubernetes").
// Neither a missing API server nor missing RBAC ever stops the plugin or
// delays a CSI call: posting runs on goroutines of its own and only logs
// and counts its failures.
//
// The Events are written with three requests (POST, GET, merge PATCH) made
// here directly, as cmd/vco-csi writes its node location map, rather than
// through client-go's tools/record. That recorder names each Event by the
// time it is made and keeps its dedupe cache in memory, so a restarted
// plugin, which receives the agent's recent events again, would post each
// of them a second time; here an Event's name is derived from what it
// reports and the Event carries the agent's start time and sequence number
// of the last occurrence it counts, which makes posting idempotent across
// restarts of either side. client-go would also grow bin/vco-csi from
// 22.1 MB to 42.0 MB with its clientset, or to 26.6 MB with the recorder
// and a sink of our own (measured on v0.37.2).
package kubeevents
