package scsi

import (
	"errors"
	"fmt"
)

// Error kinds, for errors.Is. A *CommandError or *TransportError matches
// exactly one of them.
var (
	// ErrReservationConflict: the target answered RESERVATION CONFLICT
	// (status 18h): another I_T nexus holds a reservation that forbids the
	// command, or a PR OUT named a key this nexus is not registered with.
	ErrReservationConflict = errors.New("reservation conflict")
	// ErrIllegalRequest: ILLEGAL REQUEST sense: the target does not
	// implement the command or rejects a field of it.
	ErrIllegalRequest = errors.New("illegal request")
	// ErrUnitAttention: UNIT ATTENTION sense: the target reports an event
	// (reset, reservations preempted, ...) and did not run the command.
	ErrUnitAttention = errors.New("unit attention")
	// ErrNotReady: NOT READY sense.
	ErrNotReady = errors.New("not ready")
	// ErrCheckCondition: any other CHECK CONDITION, or a status we do not
	// act on (BUSY, TASK SET FULL, ...).
	ErrCheckCondition = errors.New("command failed")
	// ErrTransport: the command did not complete at the SCSI level (SG_IO
	// host or driver status, timeout, lost path).
	ErrTransport = errors.New("transport error")
	// ErrNotSCSI: the device does not accept SG_IO at all (virtio-blk, loop,
	// a partition, ...).
	ErrNotSCSI = errors.New("not a SCSI device")
)

// CommandError is a SCSI command that completed with a status other than
// GOOD.
type CommandError struct {
	Command string // e.g. "PERSISTENT RESERVE OUT (RESERVE)"
	Status  Status
	// Sense is the parsed sense data of a CHECK CONDITION; nil when the
	// target returned none (or for other statuses).
	Sense *Sense
}

func (e *CommandError) Error() string {
	if e.Sense != nil {
		return fmt.Sprintf("%s: %s: %s", e.Command, e.Status, e.Sense)
	}
	return fmt.Sprintf("%s: %s", e.Command, e.Status)
}

// Is matches the error kind (ErrReservationConflict, ErrUnitAttention, ...).
func (e *CommandError) Is(target error) bool { return target == e.kind() }

func (e *CommandError) kind() error {
	if e.Status == StatusReservationConflict {
		return ErrReservationConflict
	}
	if e.Status == StatusCheckCondition && e.Sense != nil {
		switch e.Sense.Key {
		case IllegalRequest:
			return ErrIllegalRequest
		case UnitAttention:
			return ErrUnitAttention
		case NotReady:
			return ErrNotReady
		}
	}
	return ErrCheckCondition
}

// ASC returns the additional sense code and qualifier, if there was sense.
func (e *CommandError) ASC() (asc, ascq uint8, ok bool) {
	if e.Sense == nil {
		return 0, 0, false
	}
	return e.Sense.ASC, e.Sense.ASCQ, true
}

// UnitAttentionCode returns the ASC/ASCQ of a unit attention anywhere in
// err's chain.
func UnitAttentionCode(err error) (asc, ascq uint8, ok bool) {
	var ce *CommandError
	if errors.As(err, &ce) && errors.Is(ce, ErrUnitAttention) {
		return ce.Sense.ASC, ce.Sense.ASCQ, true
	}
	return 0, 0, false
}

// TransportError is a command that did not complete at the SCSI level.
type TransportError struct {
	Command      string
	HostStatus   uint16 // SG_IO host_status (DID_* codes)
	DriverStatus uint16 // SG_IO driver_status (DRIVER_* codes)
	Err          error  // an errno from the ioctl, or nil
}

func (e *TransportError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s: %v", e.Command, e.Err)
	}
	s := fmt.Sprintf("%s: transport failure", e.Command)
	if e.HostStatus != 0 {
		s += fmt.Sprintf(", host status 0x%02x (%s)", e.HostStatus, hostStatusName(e.HostStatus))
	}
	if e.DriverStatus != 0 {
		s += fmt.Sprintf(", driver status 0x%02x", e.DriverStatus)
	}
	return s
}

// Is matches ErrTransport.
func (e *TransportError) Is(target error) bool { return target == ErrTransport }

func (e *TransportError) Unwrap() error { return e.Err }

// Host status codes of the Linux SCSI midlayer (include/scsi/scsi_status.h).
const (
	hostOK                 = 0x00
	hostNoConnect          = 0x01
	hostBusBusy            = 0x02
	hostTimeOut            = 0x03
	hostBadTarget          = 0x04
	hostAbort              = 0x05
	hostError              = 0x07
	hostReset              = 0x08
	hostTransportDisrupted = 0x0e
	hostTransportFailfast  = 0x0f
	hostNexusFailure       = 0x11
	hostAllocFailure       = 0x12
	hostMediumError        = 0x13
	hostTransportMarginal  = 0x14
)

func hostStatusName(h uint16) string {
	switch h {
	case hostNoConnect:
		return "no connection"
	case hostBusBusy:
		return "bus busy"
	case hostTimeOut:
		return "timed out"
	case hostBadTarget:
		return "bad target"
	case hostAbort:
		return "aborted"
	case hostError:
		return "internal error"
	case hostReset:
		return "reset"
	case hostTransportDisrupted:
		return "transport disrupted"
	case hostTransportFailfast:
		return "transport failfast"
	case hostNexusFailure:
		return "nexus failure"
	case hostAllocFailure:
		return "allocation failure"
	case hostMediumError:
		return "medium error"
	case hostTransportMarginal:
		return "transport marginal"
	}
	return "unknown"
}
