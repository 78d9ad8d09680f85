// Package scenarios holds the end-to-end scenarios that run on the lab
// (package lab): real guest kernels sharing iSCSI disks with SCSI-3
// persistent reservations. The scenarios are Go tests; this package has no
// code of its own beyond them.
package scenarios
