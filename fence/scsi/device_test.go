package scsi

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// scripted is a Transport that answers from a list, for testing how Device
// judges responses. (The SG_IO transport itself needs a SCSI device, which
// the lab provides.)
type scripted struct {
	answers  []Response
	err      error
	calls    int
	timeouts []time.Duration
}

func (s *scripted) Execute(_ context.Context, cdb []byte, dir Direction, data []byte, timeout time.Duration) (Response, error) {
	s.calls++
	s.timeouts = append(s.timeouts, timeout)
	if s.err != nil {
		return Response{}, s.err
	}
	r := s.answers[0]
	if len(s.answers) > 1 {
		s.answers = s.answers[1:]
	}
	return r, nil
}

func fixedSense(k SenseKey, asc, ascq uint8) []byte {
	b := make([]byte, 18)
	b[0], b[2], b[7], b[12], b[13] = 0x70, byte(k), 10, asc, ascq
	return b
}

func TestDeviceClassifiesErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    Response
		kind error
		text string
	}{
		{"conflict", Response{Status: StatusReservationConflict}, ErrReservationConflict, "RESERVATION CONFLICT"},
		{"nexus failure", Response{HostStatus: hostNexusFailure}, ErrReservationConflict, "RESERVATION CONFLICT"},
		{"illegal", Response{Status: StatusCheckCondition, Sense: fixedSense(IllegalRequest, 0x20, 0)}, ErrIllegalRequest, "INVALID COMMAND OPERATION CODE"},
		{"not ready", Response{Status: StatusCheckCondition, Sense: fixedSense(NotReady, 0x04, 0x01)}, ErrNotReady, "BECOMING READY"},
		{"medium", Response{Status: StatusCheckCondition, Sense: fixedSense(MediumError, 0x11, 0)}, ErrCheckCondition, "MEDIUM ERROR"},
		{"no sense", Response{Status: StatusCheckCondition}, ErrCheckCondition, "CHECK CONDITION"},
		{"host timeout", Response{HostStatus: hostTimeOut}, ErrTransport, "timed out"},
		{"driver timeout", Response{DriverStatus: driverTimeout}, ErrTransport, "driver status 0x06"},
		{"transport lost", Response{HostStatus: hostTransportDisrupted}, ErrTransport, "transport disrupted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Device{Name: "/dev/sdx", T: &scripted{answers: []Response{tc.r}}, UnitAttentionRetries: -1}
			err := d.TestUnitReady(context.Background())
			if !errors.Is(err, tc.kind) {
				t.Fatalf("error %v is not %v", err, tc.kind)
			}
			if !strings.Contains(err.Error(), tc.text) || !strings.Contains(err.Error(), "/dev/sdx") {
				t.Fatalf("message %q lacks %q or the device", err, tc.text)
			}
		})
	}
	// DRIVER_SENSE alone with GOOD status is success.
	d := NewDevice("x", &scripted{answers: []Response{{DriverStatus: driverSense}}})
	if err := d.TestUnitReady(context.Background()); err != nil {
		t.Fatal(err)
	}
	// ENOTTY-style refusal is ErrNotSCSI, an errno is a transport error.
	d = NewDevice("x", &scripted{err: errors.Join(ErrNotSCSI)})
	if err := d.TestUnitReady(context.Background()); !errors.Is(err, ErrNotSCSI) {
		t.Fatalf("not SCSI: %v", err)
	}
	d = NewDevice("x", &scripted{err: errors.New("EIO")})
	if err := d.TestUnitReady(context.Background()); !errors.Is(err, ErrTransport) {
		t.Fatalf("errno: %v", err)
	}
}

func TestDeviceRetriesUnitAttentionBounded(t *testing.T) {
	ua := Response{Status: StatusCheckCondition, Sense: fixedSense(UnitAttention, 0x29, 0)}
	s := &scripted{answers: []Response{ua, ua, {}}}
	var seen []string
	d := &Device{Name: "x", T: s, OnUnitAttention: func(cmd string, se Sense) error {
		seen = append(seen, cmd+": "+se.String())
		return nil
	}}
	if err := d.TestUnitReady(context.Background()); err != nil {
		t.Fatal(err)
	}
	if s.calls != 3 || len(seen) != 2 {
		t.Fatalf("%d calls, hook saw %q", s.calls, seen)
	}
	s = &scripted{answers: []Response{ua}}
	d = &Device{Name: "x", T: s, UnitAttentionRetries: 4}
	err := d.TestUnitReady(context.Background())
	if asc, ascq, ok := UnitAttentionCode(err); !ok || asc != 0x29 || ascq != 0 {
		t.Fatalf("after retries: %v", err)
	}
	if s.calls != 5 {
		t.Fatalf("%d calls, want 1 + 4 retries", s.calls)
	}
	// The hook can stop the command.
	stop := errors.New("preempted")
	s = &scripted{answers: []Response{ua}}
	d = &Device{Name: "x", T: s, OnUnitAttention: func(string, Sense) error { return stop }}
	if err := d.TestUnitReady(context.Background()); err != stop || s.calls != 1 {
		t.Fatalf("hook error: %v after %d calls", err, s.calls)
	}
}

func TestDeviceTimeoutFollowsContext(t *testing.T) {
	s := &scripted{answers: []Response{{}}}
	d := &Device{Name: "x", T: s, Timeout: time.Minute}
	c, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := d.TestUnitReady(c); err != nil {
		t.Fatal(err)
	}
	if s.timeouts[0] > 2*time.Second || s.timeouts[0] < time.Second {
		t.Fatalf("timeout %v, want the context's ~2s", s.timeouts[0])
	}
	if err := d.TestUnitReady(context.Background()); err != nil || s.timeouts[1] != time.Minute {
		t.Fatalf("timeout without deadline %v", s.timeouts[1])
	}
	c2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if err := d.TestUnitReady(c2); !errors.Is(err, context.Canceled) || s.calls != 2 {
		t.Fatalf("cancelled: %v, %d calls", err, s.calls)
	}
}

func TestReadKeysRereadsWhenTruncated(t *testing.T) {
	// 40 keys do not fit the first 264-byte buffer.
	full := make([]byte, 8+40*8)
	full[7] = byte(40 * 8 & 0xff)
	full[6] = byte(40 * 8 >> 8)
	for i := 0; i < 40; i++ {
		full[8+i*8+7] = byte(i + 1)
	}
	tr := &growing{data: full}
	d := NewDevice("x", tr)
	k, err := d.ReadKeys(context.Background())
	if err != nil || len(k.Keys) != 40 || k.Truncated || k.Keys[39] != 40 {
		t.Fatalf("keys %d truncated=%v err=%v", len(k.Keys), k.Truncated, err)
	}
	if tr.calls != 2 {
		t.Fatalf("%d reads, want 2", tr.calls)
	}
}

type growing struct {
	data  []byte
	calls int
}

func (g *growing) Execute(_ context.Context, cdb []byte, _ Direction, data []byte, _ time.Duration) (Response, error) {
	g.calls++
	alloc := int(cdb[7])<<8 | int(cdb[8])
	n := copy(data[:min(alloc, len(data))], g.data)
	return Response{Resid: len(data) - n}, nil
}
