package scsi

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Direction of a command's data transfer.
type Direction int

const (
	DirNone       Direction = iota // no data phase
	DirFromDevice                  // data-in: the target fills the buffer
	DirToDevice                    // data-out: the buffer is sent
)

// Response is what a transport reports for one command that reached the
// target (or failed on the way in a way the host adapter could tell).
type Response struct {
	Status Status
	// Sense is the raw sense data of a CHECK CONDITION (may be empty).
	Sense []byte
	// Resid is the number of data bytes not transferred.
	Resid int
	// HostStatus and DriverStatus are the Linux midlayer's SG_IO
	// host_status and driver_status; zero when all went well.
	HostStatus, DriverStatus uint16
}

// Transport issues one CDB and returns the raw outcome. It does not
// interpret SCSI status or sense: that is Device's job, so every transport
// (SG_IO, or a model of a target in tests) is judged by the same rules.
// An error return means the command could not be issued or completed
// (errno from the ioctl); a Response means the target or host adapter
// answered.
type Transport interface {
	Execute(ctx context.Context, cdb []byte, dir Direction, data []byte, timeout time.Duration) (Response, error)
}

// Defaults for Device.
const (
	DefaultTimeout              = 20 * time.Second
	DefaultUnitAttentionRetries = 8
)

// Device runs typed commands over a Transport, turning status and sense
// into errors and retrying unit attentions a bounded number of times.
type Device struct {
	// Name is the device as shown in errors (e.g. "/dev/sdb").
	Name string
	T    Transport
	// Timeout bounds each command (SG_IO timeout); the context's deadline
	// shortens it further. Zero means DefaultTimeout.
	Timeout time.Duration
	// UnitAttentionRetries bounds how often a command that returned UNIT
	// ATTENTION (or BUSY) is reissued. Zero means the default; negative
	// means none.
	UnitAttentionRetries int
	// OnUnitAttention, if set, sees every unit attention before a retry.
	// A non-nil return stops the command with that error: this is how the
	// fencing engine turns "reservations preempted" into a lost claim
	// instead of letting the retry swallow it.
	OnUnitAttention func(command string, s Sense) error
}

// NewDevice returns a Device with default timeouts and retries.
func NewDevice(name string, t Transport) *Device { return &Device{Name: name, T: t} }

// SG_IO driver_status codes (include/scsi/sg.h); the low nibble is the
// driver byte, DRIVER_SENSE only says sense data is present.
const (
	driverSense   = 0x08
	driverTimeout = 0x06
)

// exec runs a command, trying it again after a unit attention or while
// the target is busy, up to the device's retries.
func (d *Device) exec(ctx context.Context, name string, cdb []byte, dir Direction, data []byte) (int, error) {
	timeout, retries := d.limits()
	for attempt := 0; ; attempt++ {
		t, err := d.attemptTimeout(ctx, name, timeout)
		if err != nil {
			return 0, err
		}
		resp, err := d.T.Execute(ctx, cdb, dir, data, t)
		if err != nil {
			if errors.Is(err, ErrNotSCSI) {
				return 0, fmt.Errorf("%s on %s: %w", name, d.Name, err)
			}
			return 0, &TransportError{Command: name + " on " + d.Name, Err: err}
		}
		n := len(data) - resp.Resid
		if n < 0 || n > len(data) {
			n = len(data)
		}
		cerr := classify(name+" on "+d.Name, resp)
		if cerr == nil {
			return n, nil
		}
		if err := d.again(ctx, name, attempt, retries, cerr); err != nil {
			return 0, err
		}
	}
}

// limits are the device's command timeout and unit attention retries,
// defaults filled in.
func (d *Device) limits() (time.Duration, int) {
	timeout := d.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	retries := d.UnitAttentionRetries
	if retries == 0 {
		retries = DefaultUnitAttentionRetries
	} else if retries < 0 {
		retries = 0
	}
	return timeout, retries
}

// attemptTimeout is the timeout of the next attempt: the command timeout,
// cut to what is left of ctx.
func (d *Device) attemptTimeout(ctx context.Context, name string, timeout time.Duration) (time.Duration, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("%s on %s: %w", name, d.Name, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		left := time.Until(dl)
		if left < time.Millisecond {
			return 0, fmt.Errorf("%s on %s: %w", name, d.Name, context.DeadlineExceeded)
		}
		if left < timeout {
			timeout = left
		}
	}
	return timeout, nil
}

// again decides, for attempt (from 0) of a command that failed with
// cerr, whether it is tried again: nil after its wait, or the error that
// ends it. OnUnitAttention sees every unit attention first.
func (d *Device) again(ctx context.Context, name string, attempt, retries int, cerr error) error {
	var ce *CommandError
	if !errors.As(cerr, &ce) {
		return cerr
	}
	if errors.Is(ce, ErrUnitAttention) && d.OnUnitAttention != nil {
		if herr := d.OnUnitAttention(name, *ce.Sense); herr != nil {
			return herr
		}
	}
	if attempt < retries {
		switch {
		case errors.Is(ce, ErrUnitAttention):
			return nil
		case ce.Status == StatusBusy || ce.Status == StatusTaskSetFull:
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(attempt+1) * 50 * time.Millisecond):
			}
			return nil
		}
	}
	return cerr
}

// classify turns a Response into nil (GOOD) or a typed error.
func classify(name string, r Response) error {
	// The midlayer marks a RESERVATION CONFLICT with host byte
	// DID_NEXUS_FAILURE; the status byte is the authority, but a nexus
	// failure alone still means the target refused us.
	if r.Status == StatusReservationConflict || (r.Status == StatusGood && r.HostStatus == hostNexusFailure) {
		return &CommandError{Command: name, Status: StatusReservationConflict}
	}
	if r.Status != StatusGood && r.Status != StatusConditionMet {
		ce := &CommandError{Command: name, Status: r.Status}
		if r.Status == StatusCheckCondition {
			if s, err := ParseSense(r.Sense); err == nil {
				ce.Sense = &s
			}
		}
		return ce
	}
	if r.HostStatus != hostOK || r.DriverStatus&0x07 != 0 || r.DriverStatus&0x0f == driverTimeout {
		return &TransportError{Command: name, HostStatus: r.HostStatus, DriverStatus: r.DriverStatus}
	}
	return nil
}

// TestUnitReady issues TEST UNIT READY.
func (d *Device) TestUnitReady(ctx context.Context) error {
	_, err := d.exec(ctx, "TEST UNIT READY", TestUnitReadyCDB(), DirNone, nil)
	return err
}

// Inquiry returns standard INQUIRY data.
func (d *Device) Inquiry(ctx context.Context) (Inquiry, error) {
	buf := make([]byte, 96)
	n, err := d.exec(ctx, "INQUIRY", InquiryCDB(false, 0, uint16(len(buf))), DirFromDevice, buf)
	if err != nil {
		return Inquiry{}, err
	}
	return ParseInquiry(buf[:n])
}

func (d *Device) vpd(ctx context.Context, page uint8) ([]byte, error) {
	name := fmt.Sprintf("INQUIRY VPD 0x%02x", page)
	buf := make([]byte, 255)
	n, err := d.exec(ctx, name, InquiryCDB(true, page, uint16(len(buf))), DirFromDevice, buf)
	if err != nil {
		return nil, err
	}
	if n >= 4 {
		if need := 4 + int(buf[2])<<8 + int(buf[3]); need > n && need > len(buf) {
			buf = make([]byte, need)
			if n, err = d.exec(ctx, name, InquiryCDB(true, page, uint16(len(buf))), DirFromDevice, buf); err != nil {
				return nil, err
			}
		}
	}
	return buf[:n], nil
}

// UnitSerial returns the Unit Serial Number (VPD page 0x80).
func (d *Device) UnitSerial(ctx context.Context) (string, error) {
	b, err := d.vpd(ctx, VPDUnitSerialNumber)
	if err != nil {
		return "", err
	}
	return ParseUnitSerial(b)
}

// DeviceIDs returns the designators of the Device Identification VPD page.
func (d *Device) DeviceIDs(ctx context.Context) ([]Designator, error) {
	b, err := d.vpd(ctx, VPDDeviceID)
	if err != nil {
		return nil, err
	}
	return ParseDeviceID(b)
}

func (d *Device) prIn(ctx context.Context, a PRInAction, size int) ([]byte, error) {
	buf := make([]byte, size)
	n, err := d.exec(ctx, "PERSISTENT RESERVE IN ("+a.String()+")", PRInCDB(a, uint16(size)), DirFromDevice, buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}

// maxPRIn is the largest allocation length PR IN can ask for (two bytes).
const maxPRIn = 0xffff

// ReadKeys returns the registered keys, re-reading with a larger buffer
// when the first answer was truncated.
func (d *Device) ReadKeys(ctx context.Context) (Keys, error) {
	size := 8 + 8*32
	for {
		b, err := d.prIn(ctx, ReadKeys, size)
		if err != nil {
			return Keys{}, err
		}
		k, err := ParseReadKeys(b)
		if err != nil || !k.Truncated || size >= maxPRIn || len(b) < size {
			return k, err
		}
		size = min(k.Need, maxPRIn)
	}
}

// ReadReservation returns the current persistent reservation, if any.
func (d *Device) ReadReservation(ctx context.Context) (Reservation, error) {
	b, err := d.prIn(ctx, ReadReservation, 24)
	if err != nil {
		return Reservation{}, err
	}
	return ParseReadReservation(b)
}

// ReportCapabilities returns the target's PR capabilities.
func (d *Device) ReportCapabilities(ctx context.Context) (Capabilities, error) {
	b, err := d.prIn(ctx, ReportCapabilities, 8)
	if err != nil {
		return Capabilities{}, err
	}
	return ParseReportCapabilities(b)
}

// ReadFullStatus returns every registration with its initiator.
func (d *Device) ReadFullStatus(ctx context.Context) (FullStatus, error) {
	size := 8 + 32*8
	for {
		b, err := d.prIn(ctx, ReadFullStatus, size)
		if err != nil {
			return FullStatus{}, err
		}
		fs, err := ParseReadFullStatus(b)
		if err != nil || !fs.Truncated || size >= maxPRIn || len(b) < size {
			return fs, err
		}
		size = min(fs.Need, maxPRIn)
	}
}

// PersistentReserveOut issues one PERSISTENT RESERVE OUT service action.
func (d *Device) PersistentReserveOut(ctx context.Context, p PROut) error {
	_, err := d.exec(ctx, "PERSISTENT RESERVE OUT ("+p.Action.String()+")", p.CDB(), DirToDevice, p.Params())
	return err
}
