package main

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

// readOnlyWho says who sets a disk's read-only flag, for the messages
// that name it.
const readOnlyWho = "the block layer's read-only flag, which this node's agent and 'vco-agent lease watch' set on a disk held by another node's lease, and the agent on a lease it lost"

// readOnlyFlag reads the block layer's read-only flag of dev (BLKROGET);
// false on a file that is not a block device (a test image).
func readOnlyFlag(dev *lease.Device) (bool, error) {
	v, err := unix.IoctlGetInt(int(dev.Fd()), unix.BLKROGET)
	if err == unix.ENOTTY {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("%s: reading the read-only flag (BLKROGET): %w", dev.Name(), err)
	}
	return v != 0, nil
}

// setReadOnlyFlag sets or clears dev's read-only flag (BLKROSET).
func setReadOnlyFlag(dev *lease.Device, ro bool) error {
	v := 0
	if ro {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(int(dev.Fd()), unix.BLKROSET, v); err != nil {
		return fmt.Errorf("%s: setting the read-only flag to %d (BLKROSET): %w", dev.Name(), v, err)
	}
	return nil
}

// writableForLease clears the read-only flag a refusal left on dev (at
// path), as the agent's stage does when it takes the lease: the claim is
// written to the disk. It refuses while this node mounts, maps or has
// staged the disk (notInUse): the flag may then be what stops the I/O of
// a lease this node lost. restore sets the flag again; the caller calls
// it when the lease was not taken. A disk that is not read-only is left
// alone.
func (o *leaseOptions) writableForLease(dev *lease.Device, path string) (restore func(), err error) {
	ro, err := readOnlyFlag(dev)
	if err != nil || !ro {
		return func() {}, err
	}
	if err := o.notInUse(path); err != nil {
		return nil, fmt.Errorf("%s is read-only (%s), and the flag is left set: %w", dev.Name(), readOnlyWho, err)
	}
	if err := setReadOnlyFlag(dev, false); err != nil {
		return nil, err
	}
	if still, err := readOnlyFlag(dev); err != nil || still {
		_ = setReadOnlyFlag(dev, true)
		if err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("%s stays read-only with the block layer's flag cleared: the disk itself is read-only (the hypervisor attached it so); nothing can be claimed on it", dev.Name())
	}
	fmt.Fprintf(o.stderr, "vco-agent lease: %s was read-only (%s); cleared to write this node's claim\n", dev.Name(), readOnlyWho)
	return func() {
		if err := setReadOnlyFlag(dev, true); err != nil {
			fmt.Fprintf(o.stderr, "vco-agent lease: the claim was not taken, and %s could not be set read-only again: %v\n", dev.Name(), err)
		}
	}, nil
}
