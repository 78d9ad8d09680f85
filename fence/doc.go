// Package fence decides who may use a shared cloud disk. It holds what every
// fencing method shares: the node's fence key (derived from its SMBIOS UUID,
// the same derivation the controller uses to name a superseded holder in a
// takeover grant), the grant itself, the Fencer interface that the SCSI-3
// persistent reservation engine (package fence/pr) and the on-disk lease
// implement, and the typed errors a refusal or a lost claim is reported with.
//
// The safety contract (docs/architecture.md, Safety properties) is: a disk held by another live node is
// refused, a takeover happens only with a grant naming the superseded key, and
// a node that loses its claim says so and never re-claims by itself.
//
// Using it on a node:
//
//	key, _ := fence.KeyFromUUID(info.UUID)               // smbios.Read
//	disk, _ := discovery.Finder{}.Find(loc)              // fence/discovery
//	dev, _ := discovery.Finder{}.Open(ctx, disk, loc)    // verified node
//	e, _ := pr.New(disk.DevPath, dev.SCSI, pr.Config{Key: key, Node: info.UUID,
//		Disk: diskID, Resolver: nodes, Verify: dev.Verify})
//	sup, _ := e.Probe(ctx)            // MethodNone: use the lease instead
//	claim, err := e.Acquire(ctx, grant) // *HeldError: refuse (P2)
//	err = e.Check(ctx)                // periodically; *LostError: stop I/O (P4)
//	e.MarkLost("write: EBADE")        // when I/O sees a reservation conflict
//	err = e.Release(ctx)              // on unstage
//
// An Engine that has seen its claim lost refuses to Acquire again; only a
// new Engine (a new, explicit stage) may claim the disk again.
package fence
