// Package fence decides who may use a shared cloud disk. It holds what every
// fencing method shares: the node's fence key (derived from its SMBIOS UUID,
// the same derivation the controller uses to name a superseded holder in a
// takeover grant), the grant itself, the Fencer interface that the SCSI-3
// persistent reservation engine (package fence/pr) and the on-disk lease
// implement, and the typed errors a refusal or a lost claim is reported with.
//
// The safety contract (DESIGN.md §3) is: a disk held by another live node is
// refused, a takeover happens only with a grant naming the superseded key, and
// a node that loses its claim says so and never re-claims by itself.
package fence
