// Package scsi speaks the few SCSI commands that fencing and disk
// identification need, over Linux SG_IO on a block device: TEST UNIT READY,
// INQUIRY (standard data and VPD pages 0x80 and 0x83), and PERSISTENT
// RESERVE IN/OUT. It builds the CDBs and parameter lists, parses the
// responses and the sense data (fixed and descriptor formats), and turns
// SCSI status, sense and SG_IO host/driver status into typed errors.
//
// It is written here because no maintained Go library issues persistent
// reservation commands: the kernel's IOC_PR_* ioctls are not a substitute
// (their REGISTER always sets APTPL, which some targets reject, and the read
// side needs kernel 6.19), and sg3_utils is a C program, not a library.
//
// Field layouts follow SPC-4 (INCITS 513); comments cite each table by its
// title, which stays the same across revisions while table numbers do not. The transport is an interface so
// that everything above the ioctl can be exercised without a SCSI device.
package scsi
