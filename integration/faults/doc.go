// Package faults injects faults into the lab (package lab) and checks what
// the storage stack promises under them: the iSCSI target restarting and
// losing its reservations, a guest losing power in the middle of a format,
// and one guest holding many disks at once. Each fault is a Go test of the
// guest tier (VCO_LAB=1); every test prints its figures as lines
// "FIGURE name=value" so that a soak run can collect them.
//
// The package has no code beyond its tests and their helpers.
package faults
