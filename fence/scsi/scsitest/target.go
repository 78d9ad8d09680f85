// Package scsitest is an in-memory model of a SCSI logical unit's
// persistent reservation state machine (SPC-4 clause 5.13 and the PERSISTENT
// RESERVE IN/OUT command descriptions), reachable through scsi.Transport
// from any number of initiators.
//
// It is a model of the target for unit tests of the fencing engine's
// decisions and of the CDB/parameter encodings, nothing more: it is not a
// substitute for the lab tests, which run the engine in real guest kernels
// against a real target (tgt) over iSCSI. The model follows the standard
// where tgt and the standard agree and can be told to behave like targets
// that differ (no PREEMPT AND ABORT, no PR at all, not SCSI).
package scsitest

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence/scsi"
)

// Options change how the modelled target behaves.
type Options struct {
	// NoPR: PERSISTENT RESERVE IN/OUT are unknown opcodes (like QEMU's
	// emulated scsi-hd).
	NoPR bool
	// NotSCSI: the device rejects SG_IO itself (like virtio-blk).
	NotSCSI bool
	// NoReportCapabilities: REPORT CAPABILITIES is an invalid service action.
	NoReportCapabilities bool
	// NoPreemptAndAbort: PREEMPT AND ABORT is an invalid service action
	// (tgt).
	NoPreemptAndAbort bool
	// AcceptAPTPL: allow APTPL=1 (tgt rejects it; the default here too).
	AcceptAPTPL bool
	// TypeMask is reported by REPORT CAPABILITIES; zero means all six types.
	TypeMask uint16
	// DescriptorSense: report sense in descriptor format (72h) instead of
	// fixed (70h).
	DescriptorSense bool
	// IgnoreReserve: RESERVE answers GOOD but reserves nothing (a broken
	// target; the engine's verification must catch it).
	IgnoreReserve bool
	// Serial and NAA are returned by INQUIRY VPD 0x80 and 0x83.
	Serial string
	NAA    []byte
}

type reservation struct {
	holder string // initiator; "" for all-registrants types
	key    uint64
	typ    uint8
}

// Target is one modelled logical unit.
type Target struct {
	Opts Options
	// BeforeCommand, if set, runs before each command (without the target's
	// lock held, so it may issue commands through other initiators). Tests
	// use it to interleave two nodes at a chosen step.
	BeforeCommand func(initiator string, cdb []byte)

	mu    sync.Mutex
	regs  map[string]uint64
	order []string // registration order, for stable READ KEYS output
	res   *reservation
	gen   uint32
	ua    map[string][][2]uint8
	// notReady counts commands per initiator still to be answered NOT
	// READY (ASC/ASCQ in notReadyCode).
	notReady     map[string]int
	notReadyCode [2]uint8
	log          []string
	// seen holds every initiator that sent a command, for Restart.
	seen map[string]bool
}

// New returns a target with no registrations.
func New(o Options) *Target {
	return &Target{Opts: o, regs: map[string]uint64{}, ua: map[string][][2]uint8{}, notReady: map[string]int{}, seen: map[string]bool{}}
}

// Restart models a target that keeps its persistent reservation state in
// memory only (no APTPL; tgt) being restarted: every registration and the
// reservation are gone, the PR generation is back to 0 (SPC-4: a power on
// resets it), pending unit attentions are dropped, and each initiator that
// had talked to the target finds a 29/00 POWER ON, RESET unit attention
// on its next command, as it would on its new I_T nexus.
func (t *Target) Restart() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.regs, t.order, t.res, t.gen = map[string]uint64{}, nil, nil, 0
	t.ua, t.notReady = map[string][][2]uint8{}, map[string]int{}
	for ini := range t.seen {
		t.ua[ini] = [][2]uint8{{0x29, 0x00}}
	}
	t.log = append(t.log, "target restarted")
}

// Generation returns the PR generation (READ KEYS' PRGENERATION).
func (t *Target) Generation() uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gen
}

// Port is one initiator's I_T nexus to the target; it is a scsi.Transport.
type Port struct {
	t    *Target
	name string
}

// Initiator returns the I_T nexus of the named initiator (e.g. an iSCSI
// initiator name).
func (t *Target) Initiator(name string) *Port { return &Port{t: t, name: name} }

// QueueUnitAttention makes the next command from initiator fail with UNIT
// ATTENTION asc/ascq (INQUIRY excepted, as SPC-4 requires).
func (t *Target) QueueUnitAttention(initiator string, asc, ascq uint8) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ua[initiator] = append(t.ua[initiator], [2]uint8{asc, ascq})
}

// QueueNotReady makes the next n commands from initiator (INQUIRY
// excepted) fail with NOT READY asc/ascq, e.g. 04/01 "becoming ready".
func (t *Target) QueueNotReady(initiator string, n int, asc, ascq uint8) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.notReady[initiator] = n
	t.notReadyCode = [2]uint8{asc, ascq}
}

// Registered returns the key an initiator is registered with.
func (t *Target) Registered(initiator string) (uint64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	k, ok := t.regs[initiator]
	return k, ok
}

// Reservation returns the holder initiator ("" for all-registrants), key
// and type of the reservation.
func (t *Target) Reservation() (holder string, key uint64, typ uint8, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.res == nil {
		return "", 0, 0, false
	}
	return t.res.holder, t.res.key, t.res.typ, true
}

// Log returns the commands executed so far, as "initiator: COMMAND".
func (t *Target) Log() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.log)
}

// CanWrite reports whether a WRITE from initiator would be allowed, per the
// SPC-4 table of commands allowed in the presence of persistent
// reservations.
func (t *Target) CanWrite(initiator string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.allowed(initiator, true)
}

// CanRead reports whether a READ from initiator would be allowed.
func (t *Target) CanRead(initiator string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.allowed(initiator, false)
}

func (t *Target) allowed(ini string, write bool) bool {
	r := t.res
	if r == nil {
		return true
	}
	_, registered := t.regs[ini]
	switch r.typ {
	case 1: // Write Exclusive
		return !write || r.holder == ini
	case 3: // Exclusive Access
		return r.holder == ini
	case 5, 7: // Write Exclusive, Registrants Only / All Registrants
		return !write || registered
	case 6, 8: // Exclusive Access, Registrants Only / All Registrants
		return registered
	}
	return false
}

type outcome struct {
	status scsi.Status
	key    scsi.SenseKey
	asc    uint8
	ascq   uint8
	n      int // data-in bytes produced
}

var good = outcome{status: scsi.StatusGood}

func check(k scsi.SenseKey, asc, ascq uint8) outcome {
	return outcome{status: scsi.StatusCheckCondition, key: k, asc: asc, ascq: ascq}
}

var conflict = outcome{status: scsi.StatusReservationConflict}

// Execute implements scsi.Transport.
func (p *Port) Execute(ctx context.Context, cdb []byte, dir scsi.Direction, data []byte, _ time.Duration) (scsi.Response, error) {
	t := p.t
	if t.Opts.NotSCSI {
		return scsi.Response{}, fmt.Errorf("%w: SG_IO: inappropriate ioctl for device", scsi.ErrNotSCSI)
	}
	if err := ctx.Err(); err != nil {
		return scsi.Response{}, err
	}
	if t.BeforeCommand != nil {
		t.BeforeCommand(p.name, cdb)
	}
	t.mu.Lock()
	o := t.execute(p.name, cdb, dir, data)
	t.mu.Unlock()
	r := scsi.Response{Status: o.status, Resid: len(data) - o.n}
	if dir != scsi.DirFromDevice {
		r.Resid = 0
	}
	if o.status == scsi.StatusCheckCondition {
		r.Sense = t.sense(o)
		r.DriverStatus = 0x08
	}
	if o.status == scsi.StatusReservationConflict {
		r.HostStatus = 0x11 // DID_NEXUS_FAILURE, as the Linux midlayer reports it
	}
	return r, nil
}

func (t *Target) sense(o outcome) []byte {
	if t.Opts.DescriptorSense {
		// Descriptor format, no descriptors: 72h, key, ASC, ASCQ, length 0.
		return []byte{0x72, byte(o.key), o.asc, o.ascq, 0, 0, 0, 0}
	}
	s := make([]byte, 18)
	s[0] = 0x70
	s[2] = byte(o.key)
	s[7] = 10
	s[12], s[13] = o.asc, o.ascq
	return s
}

func (t *Target) execute(ini string, cdb []byte, dir scsi.Direction, data []byte) outcome {
	if len(cdb) == 0 {
		return check(scsi.IllegalRequest, 0x20, 0)
	}
	t.log = append(t.log, ini+": "+describe(cdb))
	t.seen[ini] = true
	if cdb[0] != scsi.OpInquiry {
		if q := t.ua[ini]; len(q) > 0 {
			t.ua[ini] = q[1:]
			return check(scsi.UnitAttention, q[0][0], q[0][1])
		}
		if t.notReady[ini] > 0 {
			t.notReady[ini]--
			return check(scsi.NotReady, t.notReadyCode[0], t.notReadyCode[1])
		}
	}
	switch cdb[0] {
	case scsi.OpTestUnitReady:
		return good
	case scsi.OpInquiry:
		return t.inquiry(cdb, data)
	case scsi.OpPersistentReserveIn:
		if t.Opts.NoPR {
			return check(scsi.IllegalRequest, 0x20, 0)
		}
		return t.prIn(cdb, data)
	case scsi.OpPersistentReserveOut:
		if t.Opts.NoPR {
			return check(scsi.IllegalRequest, 0x20, 0)
		}
		if dir != scsi.DirToDevice {
			return check(scsi.IllegalRequest, 0x24, 0)
		}
		return t.prOut(ini, cdb, data)
	}
	return check(scsi.IllegalRequest, 0x20, 0)
}

func describe(cdb []byte) string {
	switch cdb[0] {
	case scsi.OpPersistentReserveIn:
		if len(cdb) > 1 {
			return "PR IN " + scsi.PRInAction(cdb[1]&0x1f).String()
		}
	case scsi.OpPersistentReserveOut:
		if len(cdb) > 1 {
			return "PR OUT " + scsi.PROutAction(cdb[1]&0x1f).String()
		}
	case scsi.OpTestUnitReady:
		return "TEST UNIT READY"
	case scsi.OpInquiry:
		return "INQUIRY"
	}
	return fmt.Sprintf("opcode 0x%02x", cdb[0])
}

func put(data, b []byte) outcome {
	n := copy(data, b)
	return outcome{status: scsi.StatusGood, n: n}
}

func (t *Target) inquiry(cdb, data []byte) outcome {
	if len(cdb) < 6 {
		return check(scsi.IllegalRequest, 0x24, 0)
	}
	alloc := int(binary.BigEndian.Uint16(cdb[3:5]))
	data = data[:min(alloc, len(data))]
	if cdb[1]&1 == 0 {
		if cdb[2] != 0 {
			return check(scsi.IllegalRequest, 0x24, 0)
		}
		b := make([]byte, 36)
		b[0] = 0x00 // direct access block device
		b[2] = 0x06 // SPC-4
		b[3] = 0x02
		b[4] = 31
		copy(b[8:16], "MODEL   ")
		copy(b[16:32], "PR-TARGET       ")
		copy(b[32:36], "0001")
		return put(data, b)
	}
	switch cdb[2] {
	case scsi.VPDUnitSerialNumber:
		b := append([]byte{0, 0x80, 0, byte(len(t.Opts.Serial))}, t.Opts.Serial...)
		return put(data, b)
	case scsi.VPDDeviceID:
		var body []byte
		if len(t.Opts.NAA) > 0 {
			body = append(body, 0x01, 0x03, 0, byte(len(t.Opts.NAA)))
			body = append(body, t.Opts.NAA...)
		}
		b := append([]byte{0, 0x83, byte(len(body) >> 8), byte(len(body))}, body...)
		return put(data, b)
	}
	return check(scsi.IllegalRequest, 0x24, 0)
}

func (t *Target) prIn(cdb, data []byte) outcome {
	if len(cdb) < 10 {
		return check(scsi.IllegalRequest, 0x24, 0)
	}
	alloc := int(binary.BigEndian.Uint16(cdb[7:9]))
	data = data[:min(alloc, len(data))]
	var b []byte
	switch scsi.PRInAction(cdb[1] & 0x1f) {
	case scsi.ReadKeys:
		b = make([]byte, 8, 8+8*len(t.order))
		for _, ini := range t.order {
			b = binary.BigEndian.AppendUint64(b, t.regs[ini])
		}
		binary.BigEndian.PutUint32(b[0:4], t.gen)
		binary.BigEndian.PutUint32(b[4:8], uint32(len(b)-8))
	case scsi.ReadReservation:
		b = make([]byte, 8)
		binary.BigEndian.PutUint32(b[0:4], t.gen)
		if t.res != nil {
			b = append(b, make([]byte, 16)...)
			binary.BigEndian.PutUint32(b[4:8], 16)
			if !isAllRegistrants(t.res.typ) {
				binary.BigEndian.PutUint64(b[8:16], t.res.key)
			}
			b[21] = scsi.ScopeLU<<4 | t.res.typ
		}
	case scsi.ReportCapabilities:
		if t.Opts.NoReportCapabilities {
			return check(scsi.IllegalRequest, 0x24, 0)
		}
		mask := t.Opts.TypeMask
		if mask == 0 {
			mask = 0xEA01
		}
		b = []byte{0, 8, 0x00, 0x80, byte(mask >> 8), byte(mask), 0, 0}
	case scsi.ReadFullStatus:
		b = make([]byte, 8)
		binary.BigEndian.PutUint32(b[0:4], t.gen)
		for _, ini := range t.order {
			d := make([]byte, 24)
			binary.BigEndian.PutUint64(d[0:8], t.regs[ini])
			if t.res != nil && (t.res.holder == ini || isAllRegistrants(t.res.typ)) {
				d[12] = 0x01
				d[13] = t.res.typ
			}
			tid := iscsiTransportID(ini)
			binary.BigEndian.PutUint32(d[20:24], uint32(len(tid)))
			b = append(append(b, d...), tid...)
		}
		binary.BigEndian.PutUint32(b[4:8], uint32(len(b)-8))
	default:
		return check(scsi.IllegalRequest, 0x24, 0)
	}
	return put(data, b)
}

// iscsiTransportID encodes an iSCSI initiator device TransportID (SPC-4,
// protocol identifier 5h, format 00b): a null-terminated name padded to a
// multiple of four bytes.
func iscsiTransportID(name string) []byte {
	n := len(name) + 1
	n = (n + 3) &^ 3
	b := make([]byte, 4+n)
	b[0] = 0x05
	binary.BigEndian.PutUint16(b[2:4], uint16(n))
	copy(b[4:], name)
	return b
}

func isAllRegistrants(t uint8) bool { return t == 7 || t == 8 }

func validType(t uint8) bool {
	switch t {
	case 1, 3, 5, 6, 7, 8:
		return true
	}
	return false
}

func (t *Target) unregister(ini string) {
	delete(t.regs, ini)
	t.order = slices.DeleteFunc(t.order, func(s string) bool { return s == ini })
	if t.res == nil {
		return
	}
	if isAllRegistrants(t.res.typ) {
		if len(t.regs) == 0 {
			t.res = nil
		}
		return
	}
	if t.res.holder == ini {
		// A holder that unregisters releases its reservation; under the
		// registrants-only types the other registrants are told.
		if t.res.typ == 5 || t.res.typ == 6 {
			for _, o := range t.order {
				t.ua[o] = append(t.ua[o], [2]uint8{0x2A, 0x04})
			}
		}
		t.res = nil
	}
}

func (t *Target) register(ini string, key uint64) {
	if _, ok := t.regs[ini]; !ok {
		t.order = append(t.order, ini)
	}
	t.regs[ini] = key
	if t.res != nil && t.res.holder == ini {
		t.res.key = key
	}
}

// prOutParams are a PERSISTENT RESERVE OUT's CDB and parameter list.
type prOutParams struct {
	sa         scsi.PROutAction
	scope, typ uint8
	key, sakey uint64
	aptpl      bool
}

func (t *Target) prOut(ini string, cdb, data []byte) outcome {
	p, bad, ok := parsePROut(cdb, data)
	if !ok {
		return bad
	}
	mine, registered := t.regs[ini]
	switch p.sa {
	case scsi.Register, scsi.RegisterAndIgnoreExistingKey:
		return t.prRegister(ini, p, mine, registered)
	}
	// Every other service action needs a registration matching key.
	if !registered || p.key != mine {
		return conflict
	}
	switch p.sa {
	case scsi.Reserve:
		return t.prReserve(ini, p, mine)
	case scsi.Release:
		return t.prRelease(ini, p)
	case scsi.Clear:
		for _, o := range t.order {
			if o != ini {
				t.ua[o] = append(t.ua[o], [2]uint8{0x2A, 0x03})
			}
		}
		t.regs = map[string]uint64{}
		t.order = nil
		t.res = nil
		t.gen++
		return good
	case scsi.Preempt, scsi.PreemptAndAbort:
		if p.sa == scsi.PreemptAndAbort && t.Opts.NoPreemptAndAbort {
			return check(scsi.IllegalRequest, 0x24, 0)
		}
		return t.preempt(ini, p.scope, p.typ, p.sakey)
	}
	return check(scsi.IllegalRequest, 0x24, 0)
}

// parsePROut reads a PERSISTENT RESERVE OUT; ok is false, with the
// check condition to answer, when it is malformed or asks for what the
// model does not do.
func parsePROut(cdb, data []byte) (p prOutParams, bad outcome, ok bool) {
	if len(cdb) < 10 {
		return p, check(scsi.IllegalRequest, 0x24, 0), false
	}
	p.sa = scsi.PROutAction(cdb[1] & 0x1f)
	p.scope, p.typ = cdb[2]>>4, cdb[2]&0x0f
	if plen := binary.BigEndian.Uint32(cdb[5:9]); plen != scsi.PROutParamLen || len(data) != scsi.PROutParamLen {
		return p, check(scsi.IllegalRequest, 0x1A, 0), false // PARAMETER LIST LENGTH ERROR
	}
	p.key = binary.BigEndian.Uint64(data[0:8])
	p.sakey = binary.BigEndian.Uint64(data[8:16])
	p.aptpl = data[20]&0x01 != 0
	if data[20]&0x0c != 0 {
		return p, check(scsi.IllegalRequest, 0x26, 0), false // SPEC_I_PT / ALL_TG_PT not modelled
	}
	return p, outcome{}, true
}

// prRegister is REGISTER and REGISTER AND IGNORE EXISTING KEY from ini,
// whose key is mine when registered.
func (t *Target) prRegister(ini string, p prOutParams, mine uint64, registered bool) outcome {
	if p.aptpl && !t.Opts.AcceptAPTPL {
		return check(scsi.IllegalRequest, 0x26, 0)
	}
	if p.sa == scsi.Register {
		if !registered && p.key != 0 {
			return conflict
		}
		if registered && p.key != mine {
			return conflict
		}
	}
	if p.sakey == 0 {
		if registered {
			t.unregister(ini)
			t.gen++
		}
		return good
	}
	t.register(ini, p.sakey)
	t.gen++
	return good
}

// prReserve is RESERVE from ini, registered with key mine.
func (t *Target) prReserve(ini string, p prOutParams, mine uint64) outcome {
	if p.scope != scsi.ScopeLU || !validType(p.typ) {
		return check(scsi.IllegalRequest, 0x24, 0)
	}
	if t.Opts.IgnoreReserve {
		return good
	}
	if t.res == nil {
		t.res = &reservation{holder: ini, key: mine, typ: p.typ}
		if isAllRegistrants(p.typ) {
			t.res.holder, t.res.key = "", 0
		}
		return good
	}
	if t.res.typ == p.typ && (t.res.holder == ini || isAllRegistrants(p.typ)) {
		return good
	}
	return conflict
}

// prRelease is RELEASE from ini.
func (t *Target) prRelease(ini string, p prOutParams) outcome {
	if t.res == nil {
		return good
	}
	if !isAllRegistrants(t.res.typ) && t.res.holder != ini {
		return good
	}
	if p.scope != scsi.ScopeLU || p.typ != t.res.typ {
		return check(scsi.IllegalRequest, 0x26, 0x04) // INVALID RELEASE OF PERSISTENT RESERVATION
	}
	old := t.res
	t.res = nil
	if old.typ != 1 && old.typ != 3 {
		for _, o := range t.order {
			if o != ini {
				t.ua[o] = append(t.ua[o], [2]uint8{0x2A, 0x04})
			}
		}
	}
	return good
}

// preempt follows SPC-4 "Preempting persistent reservations and
// registration handling".
func (t *Target) preempt(ini string, scope, typ uint8, sakey uint64) outcome {
	removeKey := func(k uint64, all bool) int {
		n := 0
		for _, o := range slices.Clone(t.order) {
			if o == ini {
				continue
			}
			if all || t.regs[o] == k {
				delete(t.regs, o)
				t.order = slices.DeleteFunc(t.order, func(s string) bool { return s == o })
				t.ua[o] = append(t.ua[o], [2]uint8{0x2A, 0x05})
				n++
			}
		}
		return n
	}
	if t.res != nil && isAllRegistrants(t.res.typ) {
		if sakey == 0 {
			if scope != scsi.ScopeLU || !validType(typ) {
				return check(scsi.IllegalRequest, 0x24, 0)
			}
			removeKey(0, true)
			t.res = &reservation{holder: ini, key: t.regs[ini], typ: typ}
			if isAllRegistrants(typ) {
				t.res.holder, t.res.key = "", 0
			}
			t.gen++
			return good
		}
		if removeKey(sakey, false) == 0 {
			return conflict
		}
		t.gen++
		return good
	}
	if sakey == 0 {
		return check(scsi.IllegalRequest, 0x26, 0)
	}
	if t.res != nil && t.res.key == sakey {
		if scope != scsi.ScopeLU || !validType(typ) {
			return check(scsi.IllegalRequest, 0x24, 0)
		}
		removeKey(sakey, false)
		t.res = &reservation{holder: ini, key: t.regs[ini], typ: typ}
		if isAllRegistrants(typ) {
			t.res.holder, t.res.key = "", 0
		}
		t.gen++
		return good
	}
	if removeKey(sakey, false) == 0 {
		return conflict
	}
	t.gen++
	return good
}
