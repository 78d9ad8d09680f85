// Package lease fences a disk that has no SCSI-3 persistent reservations
// (virtio-blk, or a target without PR) with a lease kept on the disk
// itself: a delta lease (Chockler and Malkhi, as sanlock uses it for host
// ids) with per-host slots and epochs, so that each host only ever writes
// its own block; the code is ours. Its Engine implements fence.Fencer, and
// fence.FirstClaimer for the first claim of a disk no node was given
// before, so the agent picks it or the reservation engine (fence/pr) by
// probing and handles both the same way.
//
// Format writes the lease area only on a disk package internal/safety/blank
// proves blank, never over data (docs/architecture.md P5); ReadLayout and
// ReadStatus read a disk's area without changing it; MapData and FindData
// give the volume's data, from DataOffset, as a loop device. Every lease
// I/O is O_DIRECT|O_DSYNC and bounded by Timing.IOTimeout.
//
// The target does not enforce a lease: a holder that cannot renew stops
// its I/O by itself (Config.OnLost), and the host watchdog (agent/watchdog,
// fed from Engine.Health) resets a host whose agent hung.
//
// The layout, the algorithm, its timing and bounds (Timing, DefaultTiming,
// Timing.Bounds) and what it guarantees: docs/fencing.md, "The on-disk
// lease". The schedule simulator (sim_test.go) checks its rules.
package lease
