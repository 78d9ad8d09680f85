// Package volume does the agent's privileged work for the CSI node plugin:
// it stages a volume (find and verify the disk, fence it, open LUKS2 when
// encrypted, make a filesystem only on a blank device, mount it at the
// staging path in the host's mount namespace), publishes it into pods with
// bind mounts, grows it, reports its usage and health, and gives it back.
//
// Every claim is recorded under the state directory before the disk is
// touched and updated after each step, so a stage cut short by a crash is
// finished (never formatted twice) by its retry, and the agent re-verifies
// each claim when it starts. A periodic check of every claim stops I/O on
// a disk whose fence was lost (docs/architecture.md P4): the block device is set
// read-only, the filesystem remounted read-only, DiskFenced published, and
// the volume reported abnormal until a new stage carrying a grant.
//
// Fencing is chosen per disk by a FencerFactory: SCSI-3 persistent
// reservations where the disk has them, else the on-disk lease (package
// fence/lease) on a blank disk or one carrying a lease area, and otherwise
// nothing, which a stage accepts only when both the request and the
// configuration opt in. Classify, Refused and Removed serve the uevent
// watcher (package fence/uevent), which refuses a disk held elsewhere the
// moment it appears. Encryption is reached through the Encryption
// interface, implemented by LUKS on package crypt; without one, encrypted
// volumes are refused.
//
// Which file holds which part of the Manager:
//
//	manager.go     the Manager, its options, live entries, Close
//	stage.go       NodeStage: the request, its entry, its steps and their
//	               rollback; restage.go a repeated stage of a claim
//	unstage.go, publish.go, expand.go, stats.go   the other calls
//	mount.go, format.go, grow.go   the filesystem: mount, mkfs, fsck, resize
//	encrypt.go, luks.go, mappername.go   LUKS2 and the dm-crypt mapping;
//	               rewrap.go a LUKS2 token rewritten in place
//	fencing.go, lease.go, leasedisk.go, datamap.go   choosing and taking
//	               the fence; the lease's data area and its mapping
//	guard.go       the release guard (the only way a fence is given up)
//	check.go       the start-up and periodic claim checks
//	loss.go, drain.go, reestablish.go, reclaim.go   a fence lost, the
//	               I/O stopped, a reservation re-established, a takeover
//	watchdog.go    the host watchdog's list of leases; the boot id
//	watch.go, list.go   the uevent watcher's questions; ListDisks
//	store.go       the claim records; locks.go per-volume locks
//	host.go, bind.go, paths.go, device.go   what the Manager does to the
//	               node (behind the host interface), kubelet paths, disks;
//	               ioctl_linux.go a block device's size (BLKGETSIZE64)
//	metrics.go     the Prometheus series
package volume
