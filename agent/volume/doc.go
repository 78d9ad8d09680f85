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
package volume
