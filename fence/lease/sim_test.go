package lease

// The lease protocol under adversarial schedules. Each schedule is one
// seed: hosts sharing one simulated disk acquire, renew, release, pause,
// die and come back, and the disk tears, delays and fails their I/O. It
// runs inside a testing/synctest bubble, so the engine's own timers,
// sleeps and clock run on a fake clock that jumps to the next event: an
// hour of lease time costs milliseconds. The engine's code is the real
// one; only its block file (blockFile) and a pause gate are the
// simulator's.
//
// The disk (simDisk) is atomic per sector only: a slot write lands sector
// by sector over its latency, a failed write may land in part, and a read
// samples each block at some instant of its own latency, so it can see
// half of another host's write. Writes complete late (after the caller's
// I/O timeout; the device stays busy until they land, as the kernel's
// request does). A paused host is an agent frozen as SIGSTOP freezes it:
// it stops where it enters or leaves a lease I/O, while its requests
// already issued go on; its host watchdog (fed while the lease is
// healthy, see docs/fencing.md) resets the host W after the last feed if
// the pause lasts that long. A dead host issues nothing more, but what it
// issued before still lands. Unless -lease.plain is given, a schedule also
// draws, from a stream of its own (so that a seed's plain schedule stays
// what it was): hosts configured with their own timings (a short d with a
// long renewal interval, and the like), new engines released before they
// acquire (an unstage after an agent restart), and clones: a disk that
// starts with a source disk's held slots, which the first node given it
// acquires with AcquireFirst before any other node is given it. From a
// stream of their own again, holders' agents restart (an upgrade, or a
// crash that systemd restarts) while the host keeps the volume mounted and
// writing: the stopping engine hands its lease off or just ends, the agent
// is down for up to F + 2W, the host watchdog resets a host whose agent
// stays down W past the last feed, and the new engine resumes the claim
// (Engine.Resume), or the host's I/O stops when it finds the claim lost.
// A life that ended without a release (a death, a reset, a loss) is
// followed by one that first takes its record back with Engine.Retake, as
// the agent does once nothing of the volume is in use.
// W past the last feed is the latest reset the agent allows, and the one
// modelled: its device counts W/2, and the one ping the kernel gives a
// device when the dying agent's descriptor closes comes within W/2 of the
// last feed (agent/watchdog); the new process feeds only once its lease
// is resumed and renewing, which the model counts as the host living on.
//
// One class of schedules (classFirst) is the never-published fast path
// (docs/fencing.md): the node the controller first published the disk to
// claims its blank lease area with AcquireFirst, holding it without the
// settle wait, while a platform that attached the disk to other VMs as
// well lets their nodes acquire it (without the flag, some with a grant
// naming the first node) within milliseconds of that claim, some with the
// shortest I/O timeout an engine accepts.
//
// Invariants, checked on every schedule:
//   - no two keys may write at overlapping times: a host may write from the
//     return of its Acquire until it releases, its loss is reported (plus a
//     drain of up to d), or it is reset;
//   - a granted takeover returns within its bound;
//   - a disk whose holders are all gone (released, dead) is acquired by a
//     lone acquirer on a healthy disk;
//   - a holder is not declared lost because its own slot "changed" when no
//     other writer touched that slot.
//
// A failing schedule prints its seed and trace; replay it with
//
//	go test ./fence/lease -run 'TestLeaseSchedules$' -lease.seed=N -v
//
// Two events of different hosts at the very same nanosecond may run in
// either order (the Go scheduler picks); the hosts' random start offsets
// and latencies make that rare, so a seed replays its schedule.

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

var (
	simSeeds = flag.Int("lease.seeds", 2000, "schedules TestLeaseSchedules runs (make soak runs more)")
	simSeed  = flag.Int64("lease.seed", -1, "run only this schedule, with its trace")
	simFrom  = flag.Int64("lease.from", 1, "first seed of TestLeaseSchedules")
	simOnly  = flag.Int("lease.class", -1, "run only the seeds of this class (0 mixed, 1 slow, 2 churn, 3 takeover, 4 first)")
	simPlain = flag.Bool("lease.plain", false, "run the schedules without the extra faults (hosts' own timings, clones, releases before acquiring)")
)

// simClass is the kind of schedule a seed draws.
type simClass int

const (
	// classMixed: 2-4 hosts with fixed keys compete for the disk with
	// every kind of fault, pause, death and grant.
	classMixed simClass = iota
	// classSlow: one host holds the disk for a long time on a disk whose
	// writes are often slow, some past the I/O timeout, but all land.
	classSlow
	// classChurn: a stream of hosts, each with a new key (autoscaled or
	// spot nodes), that acquire and mostly die holding the disk.
	classChurn
	// classTakeover: a holder whose writes take a good part of d, and
	// takers with grants naming it.
	classTakeover
	// classFirst: the never-published fast path. Host 0 claims a blank
	// lease area with AcquireFirst; hosts on VMs the platform attached
	// the disk to as well acquire it at the same moment without the flag.
	classFirst
	nClasses
)

func (c simClass) String() string {
	return [...]string{"mixed", "slow", "churn", "takeover", "first"}[c]
}

// classOf is the class a seed draws.
func classOf(seed int64) simClass { return simClass(seed % int64(nClasses)) }

// ioProfile is how a host's disk path behaves, as fractions of d.
type ioProfile struct {
	slow    float64 // share of I/Os that take d/4..d
	late    float64 // share that take d..4d (the caller times out first)
	fail    float64 // share that fail (EIO); a failed write may land in part
	maxFast float64 // the others take up to this fraction of d
}

var (
	calmIO    = ioProfile{maxFast: 0.01}
	roughIO   = ioProfile{slow: 0.05, late: 0.03, fail: 0.03, maxFast: 0.05}
	slowIO    = ioProfile{slow: 0.2, late: 0.15, maxFast: 0.3}
	draggyIO  = ioProfile{slow: 0.3, maxFast: 0.5}
	laggyIO   = ioProfile{slow: 0.6, late: 0.02, maxFast: 0.5}
	simTiming = []Timing{
		DefaultTiming(),
		{IOTimeout: time.Second, Renew: 2 * time.Second, Fail: 8 * time.Second, Watchdog: 12 * time.Second},
		{IOTimeout: 2 * time.Second, Renew: 5 * time.Second, Fail: 20 * time.Second, Watchdog: 30 * time.Second},
	}
	// simOwnTiming are timings a node's agent may be configured with
	// besides the ones above (each node has its own configuration, so
	// hosts sharing a disk may differ): a short d with a long renewal
	// interval, and a long d with a short one.
	simOwnTiming = []Timing{
		{IOTimeout: time.Second, Renew: 5 * time.Second, Fail: 10 * time.Second, Watchdog: 15 * time.Second},
		{IOTimeout: 3 * time.Second, Renew: 3 * time.Second, Fail: 12 * time.Second, Watchdog: 20 * time.Second},
		{IOTimeout: time.Second, Renew: 15 * time.Second, Fail: 30 * time.Second, Watchdog: 30 * time.Second},
	}
	// simMinTiming has the shortest I/O timeout an engine accepts: its
	// settle wait is the shortest a racer of a fast first claim can have
	// (2% above MinIOTimeout, which its clock, up to 1% fast, must keep).
	simMinTiming = Timing{IOTimeout: 102 * time.Millisecond, Renew: 204 * time.Millisecond, Fail: 816 * time.Millisecond, Watchdog: time.Second}
)

// simAllTiming is every timing a schedule may give a host.
func simAllTiming() []Timing { return append(slices.Clone(simTiming), simOwnTiming...) }

// sim is one schedule.
type sim struct {
	t     *testing.T
	seed  int64
	class simClass
	disk  *simDisk
	end   time.Time // no acquisition starts after it
	trace *syncBuffer
	log   *slog.Logger

	mu        sync.Mutex
	windows   []*window
	devices   []*simDevice
	acquiring map[*window]bool // acquisitions in flight, by their would-be window
	failures  []string
	keys      int // keys handed out, for fresh keys

	// serial is the disk's serial as every host sees it ("" unless the
	// disk is a clone). first, when not nil, is closed once host 0's first
	// acquisition (AcquireFirst: the controller says no node was given the
	// disk before) has returned; no other host is given the disk before.
	serial    string
	first     chan struct{}
	firstOnce sync.Once

	// fast counts fast first claims, and those taken while another
	// host's acquisition was in flight.
	fast, fastRaced int
	// firstRead, when not nil, is closed once host 0's AcquireFirst has
	// read the lease area (classFirst): the other hosts start after it.
	firstRead     chan struct{}
	firstReadOnce sync.Once
}

func init() {
	testHookFirstRead = func(e *Engine) {
		if f, ok := e.dev.f.(*simDevice); ok && f.s != nil && f.s.firstRead != nil {
			f.s.firstReadOnce.Do(func() { close(f.s.firstRead) })
		}
	}
}

func (s *sim) firstDone() {
	if s.first != nil {
		s.firstOnce.Do(func() { close(s.first) })
	}
}

// window is one engine's life on the disk: from its Acquire's return
// until it may no longer write.
type window struct {
	host       int
	life       int
	key        fence.Key
	acqStart   time.Time
	start, end time.Time // zero end: still open
	granted    bool
	dev        *simDevice
}

func (w *window) String() string {
	end := "open"
	if !w.end.IsZero() {
		end = simTime(w.end)
	}
	return fmt.Sprintf("host %d life %d key %s [%s, %s]", w.host, w.life, w.key, simTime(w.start), end)
}

var simEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

func simTime(t time.Time) string { return t.Sub(simEpoch).Round(time.Microsecond).String() }

func (s *sim) failf(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	msg := fmt.Sprintf(format, args...)
	s.failures = append(s.failures, msg)
	s.log.Error("INVARIANT BROKEN: " + msg)
}

func (s *sim) event(host int, msg string, args ...any) {
	s.log.Info(msg, append([]any{"host", host}, args...)...)
}

// simDisk is the shared disk: its lease area, atomic per sector.
type simDisk struct {
	sector int
	mu     sync.Mutex
	data   []byte
	// writers records, per slot, which engine lives issued writes to it.
	writers [Slots]map[*window]bool
}

func (d *simDisk) landSector(off int, b []byte) {
	d.mu.Lock()
	copy(d.data[off:], b)
	d.mu.Unlock()
}

func (d *simDisk) readBlock(dst []byte, off int) {
	d.mu.Lock()
	copy(dst, d.data[off:off+len(dst)])
	d.mu.Unlock()
}

// simDevice is one engine life's block file and gate.
type simDevice struct {
	s    *sim
	disk *simDisk
	host int
	w    *window
	rng  *rand.Rand // used only under the Device's sem (one I/O at a time)
	// drainRng draws OnLost's drain time.
	drainRng *rand.Rand
	prof     ioProfile
	d        time.Duration

	mu     sync.Mutex
	dead   bool
	resume chan struct{} // non-nil while the agent is paused
	// inflight counts requests issued and not yet complete; done is
	// set when the life that uses the device has ended.
	inflight int
	done     bool
	writes   int // writes issued
	failed   int // writes that failed (EIO), which may have landed in part
	// rate is the host's clock rate (1: true time; 0 when unset). Its
	// engine runs with its timing divided by the rate, as a clock that
	// runs fast makes every wait shorter in true time; the timing in the
	// slots it writes is multiplied back, so that the disk carries the
	// figures of its configuration, and the timing in the slots it reads
	// is divided, as its clock measures them.
	rate float64
	// script, when set (scripted tests), gives each I/O's duration: a
	// read sees the disk as it is when issued, a write lands whole when
	// it completes.
	script func(write bool) time.Duration
}

func (f *simDevice) busy(delta int) {
	f.mu.Lock()
	f.inflight += delta
	f.mu.Unlock()
}

func (f *simDevice) Close() error { return nil }

func (f *simDevice) isDead() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.dead
}

// gate blocks while the host's agent is paused.
func (f *simDevice) gate() {
	f.mu.Lock()
	ch := f.resume
	f.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

func (f *simDevice) pause() {
	f.mu.Lock()
	if f.resume == nil && !f.dead {
		f.resume = make(chan struct{})
	}
	f.mu.Unlock()
}

func (f *simDevice) unpause() {
	f.mu.Lock()
	if f.resume != nil {
		close(f.resume)
		f.resume = nil
	}
	f.mu.Unlock()
}

// kill resets the host: nothing more is issued; what was issued lands.
func (f *simDevice) kill() {
	f.mu.Lock()
	f.dead = true
	f.mu.Unlock()
	f.unpause()
}

// latency draws one I/O's duration and whether it fails.
func (f *simDevice) latency() (time.Duration, bool) {
	d := float64(f.d)
	r := f.rng.Float64()
	p := f.prof
	switch {
	case r < p.fail:
		return time.Duration(f.rng.Float64() * d), true
	case r < p.fail+p.late:
		return time.Duration(d * (1 + 3*f.rng.Float64())), false
	case r < p.fail+p.late+p.slow:
		return time.Duration(d * (0.25 + 0.75*f.rng.Float64())), false
	}
	return time.Duration(1 + f.rng.Float64()*p.maxFast*d), false
}

// rescaleSlot multiplies the timing a slot block carries by k, if the
// block decodes, and seals it again.
func rescaleSlot(b []byte, k float64) {
	s, err := DecodeSlot(b)
	if err != nil || s.State == StateEmpty {
		return
	}
	s.Timing = scaleTiming(s.Timing, k)
	copy(b, EncodeSlot(s))
}

// scaleTiming multiplies t by k, to the millisecond the slots keep. The
// rounding must not break a bound the timing keeps exactly (F = 2R, R =
// d): a slot whose timing does not validate does not decode, and the
// reader would take it for a torn write.
func scaleTiming(t Timing, k float64) Timing {
	f := func(d time.Duration) time.Duration {
		return time.Duration(math.Round(float64(d.Milliseconds())*k)) * time.Millisecond
	}
	s := Timing{IOTimeout: f(t.IOTimeout), Renew: f(t.Renew), Fail: f(t.Fail), Watchdog: f(t.Watchdog)}
	if t.Renew == t.IOTimeout {
		s.Renew = s.IOTimeout
	}
	if t.Fail == 2*t.Renew {
		s.Fail = 2 * s.Renew
	}
	return s
}

// clockRate draws a clock rate within ±skew for a host configured with
// t, one its timing survives scaled there and back (1 if none is found).
func clockRate(r *rand.Rand, t Timing, skew float64) float64 {
	for range 20 {
		k := 1 + skew*(2*r.Float64()-1)
		if in := scaleTiming(t, 1/k); in.validate() == nil && scaleTiming(in, k) == t {
			return k
		}
	}
	return 1
}

func sleepUntil(t time.Time) {
	if d := time.Until(t); d > 0 {
		time.Sleep(d)
	}
}

func (f *simDevice) ReadAt(p []byte, off int64) (int, error) {
	if f.isDead() {
		return 0, syscall.EIO
	}
	f.busy(1)
	defer f.busy(-1)
	if f.script != nil {
		f.disk.readBlock(p, int(off))
		time.Sleep(f.script(false))
		return len(p), nil
	}
	lat, fails := f.latency()
	start := time.Now()
	nb := len(p) / BlockSize
	// Each block is read at one of a few instants of the request.
	instants := make([]time.Duration, 1+f.rng.IntN(3))
	for i := range instants {
		instants[i] = time.Duration(f.rng.Int64N(int64(lat) + 1))
	}
	slices.Sort(instants)
	at := make([]int, nb)
	for i := range at {
		at[i] = f.rng.IntN(len(instants))
	}
	for k, in := range instants {
		sleepUntil(start.Add(in))
		for i := range nb {
			if at[i] == k {
				f.disk.readBlock(p[i*BlockSize:(i+1)*BlockSize], int(off)+i*BlockSize)
			}
		}
	}
	if f.rate != 0 && f.rate != 1 {
		for i := range nb {
			if o := int(off) + i*BlockSize; o >= BlockSize {
				rescaleSlot(p[i*BlockSize:(i+1)*BlockSize], 1/f.rate)
			}
		}
	}
	sleepUntil(start.Add(lat))
	if fails {
		return 0, syscall.EIO
	}
	return len(p), nil
}

func (f *simDevice) WriteAt(p []byte, off int64) (int, error) {
	if f.isDead() {
		return 0, syscall.EIO
	}
	f.busy(1)
	defer f.busy(-1)
	f.mu.Lock()
	f.writes++
	f.mu.Unlock()
	if f.script != nil {
		time.Sleep(f.script(true))
		f.disk.landSector(int(off), p)
		return len(p), nil
	}
	lat, fails := f.latency()
	start := time.Now()
	if slot := int(off)/BlockSize - 1; slot >= 0 && slot < Slots {
		f.disk.mu.Lock()
		if f.disk.writers[slot] == nil {
			f.disk.writers[slot] = map[*window]bool{}
		}
		f.disk.writers[slot][f.w] = true
		f.disk.mu.Unlock()
	}
	ns := len(p) / f.disk.sector
	type landing struct {
		at  time.Duration
		sec int
	}
	var ls []landing
	for i := range ns {
		if fails && f.rng.IntN(2) == 0 {
			continue // this sector of a failed write never lands
		}
		ls = append(ls, landing{time.Duration(f.rng.Int64N(int64(lat) + 1)), i})
	}
	slices.SortFunc(ls, func(a, b landing) int { return int(a.at - b.at) })
	buf := bytes.Clone(p)
	if f.rate != 0 && f.rate != 1 && off >= BlockSize {
		rescaleSlot(buf, f.rate)
	}
	for _, l := range ls {
		sleepUntil(start.Add(l.at))
		o := l.sec * f.disk.sector
		f.disk.landSector(int(off)+o, buf[o:o+f.disk.sector])
	}
	sleepUntil(start.Add(lat))
	if fails {
		f.mu.Lock()
		f.failed++
		f.mu.Unlock()
		return 0, syscall.EIO
	}
	return len(p), nil
}

// simHost is one node; it runs lives one after another.
type simHost struct {
	s      *sim
	idx    int
	rng    *rand.Rand
	uuid   string
	key    fence.Key
	churn  bool // a fresh key (a new node) for every life
	timing Timing
	prof   ioProfile
	// lives bounds how many lives the host runs (0: until the end).
	lives int
	// sem is the disk's I/O lock in this host's agent, which every
	// life's Device shares, as the agent's Devices of one disk do
	// (ioLock): a life's request still in flight holds it.
	sem chan struct{}
	// grantP is the chance that an acquisition carries a grant naming
	// the current holder; pauseP, dieP and releaseP what ends a hold.
	grantP, pauseP, dieP float64
	hold                 time.Duration // mean hold time
	// x draws the extra faults (nil: none); releaseFirstP is the chance
	// that a life's new engine is released before it acquires (an
	// unstage after an agent restart); first: the first life acquires
	// with AcquireFirst.
	x             *rand.Rand
	releaseFirstP float64
	first         bool
	// restarts draws the agent restarts (nil: none), restartP their
	// chance at each step of a hold (an upgrade, or a crash that systemd
	// restarts, while the volume stays mounted).
	restarts *rand.Rand
	restartP float64
	// retakeNext: the last life ended without a release (the host died,
	// its watchdog reset it, or its agent found the claim lost and
	// stopped its I/O); the next one takes its record back with Retake,
	// as the agent does when nothing of the volume is in use, and
	// acquires as usual when Retake leaves the lease alone.
	retakeNext bool
	// rate is the host's clock rate (0 or 1: true time); timing is then
	// its configuration, and its engine and watchdog run on its clock.
	rate float64
	// start, when set, is when the first life begins (else a random
	// time within two renewal intervals); grantKey, when set, is the key
	// a grant of the first life names (else the last holder's).
	start    time.Duration
	grantKey fence.Key
}

// clock is the host's timing measured in true time.
func (h *simHost) clock() Timing {
	if h.rate == 0 || h.rate == 1 {
		return h.timing
	}
	return scaleTiming(h.timing, 1/h.rate)
}

func (s *sim) freshKey(r *rand.Rand) fence.Key {
	s.mu.Lock()
	s.keys++
	s.mu.Unlock()
	for {
		if k := fence.Key(r.Uint64()); k != 0 {
			return k
		}
	}
}

// holder is the key of the most recent open window, for grants (the
// controller names the node the disk was last given to).
func (s *sim) holder() (fence.Key, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.windows) - 1; i >= 0; i-- {
		if w := s.windows[i]; !w.start.IsZero() {
			return w.key, true
		}
	}
	return 0, false
}

func (s *sim) closeWindow(w *window, why string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !w.start.IsZero() && w.end.IsZero() {
		w.end = at
		s.log.Info("window closed", "host", w.host, "life", w.life, "why", why, "at", simTime(at))
	}
}

func (h *simHost) run(ctx context.Context) {
	s := h.s
	if h.first {
		defer s.firstDone()
	} else if s.first != nil {
		select {
		case <-s.first:
		case <-ctx.Done():
			return
		}
	}
	if !h.first && s.firstRead != nil {
		select {
		case <-s.firstRead:
		case <-ctx.Done():
			return
		}
	}
	for life := 0; h.lives == 0 || life < h.lives; life++ {
		wait := time.Duration(h.rng.Int64N(int64(2 * h.timing.Renew)))
		if life == 0 && h.start > 0 {
			wait = h.start
		}
		time.Sleep(wait)
		if time.Now().After(s.end) || ctx.Err() != nil {
			return
		}
		if h.churn || h.key == 0 {
			h.key = s.freshKey(h.rng)
			h.uuid = fmt.Sprintf("%08x-0000-4000-8000-%012x", h.idx, uint64(h.key)&(1<<48-1))
		}
		h.life(ctx, life)
	}
}

func (h *simHost) life(ctx context.Context, life int) {
	s := h.s
	w, dev := h.lifeDevice(life)
	e, err := h.newEngine(life, w, dev)
	if err != nil {
		s.failf("host %d: New: %v", h.idx, err)
		return
	}
	defer func() {
		hl := e.Health()
		dev.mu.Lock()
		dev.done = !hl.Lost || hl.Drained
		dev.mu.Unlock()
	}()
	if h.x != nil && h.x.Float64() < h.releaseFirstP {
		err := e.Release(context.Background())
		s.event(h.idx, "released before acquiring", "life", life, "error", fmt.Sprint(err))
	}
	first := h.first && life == 0
	grant := h.drawGrant(life, w, first)
	if !h.acquire(ctx, e, w, grant, first, life) {
		return
	}
	// Hold, then release, pause, restart the agent or die.
	if h.holdClaim(ctx, &e, dev, w, life) {
		h.retakeNext = true
		return // the host died, its watchdog reset it, or its I/O stopped
	}
	h.endLife(e, w, life)
}

// lifeDevice opens the disk path of one engine life: its window and a
// device drawing its latencies and drains from streams of the seed, the
// host and the life.
func (h *simHost) lifeDevice(life int) (*window, *simDevice) {
	s := h.s
	w := &window{host: h.idx, life: life, key: h.key}
	dev := &simDevice{s: s, disk: s.disk, host: h.idx, w: w, prof: h.prof, d: h.timing.IOTimeout, rate: h.rate,
		rng: rand.New(rand.NewPCG(uint64(s.seed), uint64(h.idx)<<32|uint64(life)))}
	w.dev = dev
	dev.drainRng = rand.New(rand.NewPCG(uint64(s.seed)^0xd1a1, uint64(h.idx)<<32|uint64(life)))
	s.mu.Lock()
	s.devices = append(s.devices, dev)
	s.mu.Unlock()
	return w, dev
}

// newEngine makes the life's engine on dev. Its OnLost checks the loss,
// then closes the window once the last writes have drained.
func (h *simHost) newEngine(life int, w *window, dev *simDevice) (*Engine, error) {
	s := h.s
	d := &Device{name: fmt.Sprintf("sim%d.%d", h.idx, life), f: dev, sem: h.sem, size: 1 << 30, gate: dev.gate}
	var lostOnce sync.Once
	return New(d, Config{Key: h.key, Node: h.uuid, NodeName: fmt.Sprintf("host-%d", h.idx), Timing: h.clock(), Serial: s.serial,
		Logger: s.log.With("host", h.idx, "life", life),
		OnLost: func(l *fence.LostError) bool {
			lostOnce.Do(func() {
				// The agent stops I/O; the last writes drain within d,
				// and only then does OnLost report that they did.
				s.checkLoss(w, l)
				time.Sleep(time.Duration(dev.drainRng.Int64N(int64(h.timing.IOTimeout))))
				s.closeWindow(w, "lost: "+l.Reason, time.Now())
			})
			return true
		}})
}

// drawGrant draws whether the life acquires with a grant, and whom it
// supersedes: the first node for a publish after the first one, else the
// current holder.
func (h *simHost) drawGrant(life int, w *window, first bool) *fence.Grant {
	s := h.s
	if first || h.rng.Float64() >= h.grantP {
		return nil
	}
	if life == 0 && h.grantKey != 0 {
		// A publish after the first one: its grant names the first
		// node, which may not hold the disk yet.
		w.granted = true
		return &fence.Grant{Node: h.uuid, Supersedes: []fence.Key{h.grantKey}}
	}
	if k, ok := s.holder(); ok && k != h.key {
		w.granted = true
		return &fence.Grant{Node: h.uuid, Supersedes: []fence.Key{k}}
	}
	return nil
}

// acquire acquires the disk (AcquireFirst for the first holder) and opens
// the life's window; it reports whether the claim was made.
func (h *simHost) acquire(ctx context.Context, e *Engine, w *window, grant *fence.Grant, first bool, life int) bool {
	s := h.s
	w.acqStart = time.Now()
	s.mu.Lock()
	s.acquiring[w] = true
	lone := s.loneLocked(w)
	othersWrote := s.othersWritesLocked(w)
	s.mu.Unlock()
	s.event(h.idx, "acquire", "life", life, "key", h.key.String(), "grant", grant != nil, "lone", lone, "first", first)
	actx, cancel := context.WithTimeout(ctx, 6*simMaxExpiry())
	var c fence.Acquired
	var err error
	switch {
	case first:
		c, err = e.AcquireFirst(actx)
	case h.retakeNext:
		h.retakeNext = false
		c, err = e.Retake(actx)
		s.event(h.idx, "retake", "life", life, "error", fmt.Sprint(err))
		if errors.Is(err, ErrNotRetakable) {
			c, err = e.Acquire(actx, grant)
		}
	default:
		c, err = e.Acquire(actx, grant)
	}
	cancel()
	took := time.Since(w.acqStart)
	if err != nil {
		h.acquireFailed(ctx, e, w, grant != nil, first, life, took, lone, othersWrote, err)
		return false
	}
	s.mu.Lock()
	delete(s.acquiring, w)
	w.start = time.Now()
	s.windows = append(s.windows, w)
	if first && e.Stats().FastClaims > 0 {
		s.fast++
		if len(s.acquiring) > 0 {
			s.fastRaced++
		}
	}
	s.mu.Unlock()
	s.event(h.idx, "acquired", "life", life, "took", took.String(), "preempted", fmt.Sprint(c.Preempted), "already", c.Already)
	if first {
		s.firstDone()
	}
	if grant != nil {
		s.checkGrantBound(w, took)
	}
	return true
}

// acquireFailed winds down a failed acquisition and checks that it was
// allowed to fail: a lone acquisition on a healthy disk must not, and a
// granted one must have given up within its bound.
func (h *simHost) acquireFailed(ctx context.Context, e *Engine, w *window, granted, first bool, life int, took time.Duration, lone bool, othersWrote int, err error) {
	s := h.s
	_ = e.Release(context.Background())
	s.mu.Lock()
	delete(s.acquiring, w)
	s.mu.Unlock()
	s.event(h.idx, "acquire failed", "life", life, "took", took.String(), "error", err.Error())
	s.mu.Lock()
	lone = lone && s.othersWritesLocked(w) == othersWrote
	s.mu.Unlock()
	if lone && h.prof == calmIO && ctx.Err() == nil {
		s.failf("host %d life %d: a lone acquisition of a disk whose holders are all gone failed on a healthy disk: %v", h.idx, life, err)
	}
	if granted {
		s.checkGrantBound(w, took)
	}
	if first {
		s.firstDone()
	}
}

// holdClaim holds the claim for a drawn time, then returns, unless the host
// dies, pauses or restarts its agent as drawn on the way; it reports
// whether the life is over without a release (the host died, its watchdog
// reset it, or a restarted agent found the claim lost and stopped its
// I/O). A restart leaves in *ep the new agent's engine.
func (h *simHost) holdClaim(ctx context.Context, ep **Engine, dev *simDevice, w *window, life int) bool {
	s, e := h.s, *ep
	holdFor := time.Duration(h.rng.ExpFloat64() * float64(h.hold))
	deadline := time.Now().Add(holdFor)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		step := min(time.Until(deadline), h.timing.Renew*3)
		select {
		case <-ctx.Done():
		case <-time.After(step):
		}
		if e.Lost() != nil {
			break
		}
		r := h.rng.Float64()
		switch {
		case r < h.dieP:
			s.closeWindow(w, "host reset", time.Now())
			dev.kill()
			s.event(h.idx, "host dies", "life", life)
			return true
		case r < h.dieP+h.pauseP:
			if h.pause(ctx, e, dev, w) {
				return true // the watchdog reset the host
			}
		case h.restarts != nil && h.restarts.Float64() < h.restartP:
			ne, over := h.restart(ctx, e, dev, w, life)
			*ep, e = ne, ne
			if over {
				return true
			}
		}
	}
	return false
}

// restart stops the agent and starts it again while the host keeps the
// volume mounted and writing, as an upgrade, or a crash that systemd
// restarts, does: the old engine hands its lease off (a stop) or just
// ends (a crash), and the agent stays down for a drawn time. The host
// watchdog, fed no more, resets the host W after the last feed; until
// then a new engine on the same disk path resumes the claim
// (Engine.Resume). When it finds the claim lost the agent stops the
// host's I/O; when its read fails the agent tries again at its next check,
// the watchdog still unfed (agent/volume: an unresumed lease). It returns
// the engine that holds the claim now and whether the life is over.
func (h *simHost) restart(ctx context.Context, e *Engine, dev *simDevice, w *window, life int) (*Engine, bool) {
	s, t, x := h.s, h.clock(), h.restarts
	stop := time.Now()
	lastFeed := stop
	if hl := e.Health(); hl.Held && !hl.Lost {
		lastFeed = minTime(stop, hl.RenewedAt.Add(hl.Fail))
	}
	resetAt := lastFeed.Add(t.Watchdog)
	if x.IntN(3) > 0 {
		err := e.Handoff(context.Background())
		s.event(h.idx, "agent stops, handing its lease off", "life", life, "error", fmt.Sprint(err))
		if e.Lost() != nil {
			return e, false // OnLost stops the I/O; the life ends as a loss does
		}
	} else {
		e.stopRenewer()
		s.event(h.idx, "agent dies; systemd restarts it", "life", life)
	}
	var down time.Duration
	switch x.IntN(3) {
	case 0:
		down = time.Duration(x.Int64N(int64(t.Renew)))
	case 1:
		down = t.Renew + time.Duration(x.Int64N(int64(t.Fail)))
	default:
		down = t.Fail + time.Duration(x.Int64N(int64(2*t.Watchdog)+1))
	}
	for try := 1; ; try++ {
		if !time.Now().Add(down).Before(resetAt) {
			time.Sleep(time.Until(resetAt))
			s.closeWindow(w, "watchdog reset (the agent down, or its lease not resumed)", time.Now())
			dev.kill()
			s.event(h.idx, "watchdog reset the host")
			return e, true
		}
		time.Sleep(down)
		ne, err := h.newEngine(life, w, dev)
		if err != nil {
			s.failf("host %d: New: %v", h.idx, err)
			return e, true
		}
		err = ne.Resume(ctx)
		s.event(h.idx, "agent back", "life", life, "down", down.String(), "try", try, "error", fmt.Sprint(err))
		var lost *fence.LostError
		switch {
		case err == nil:
			return ne, false
		case errors.As(err, &lost):
			// The agent stops the host's I/O; its last writes drain
			// within d.
			time.Sleep(time.Duration(dev.drainRng.Int64N(int64(h.timing.IOTimeout))))
			s.closeWindow(w, "not resumed after a restart: "+lost.Reason, time.Now())
			return ne, true
		}
		down = 2*t.Renew + time.Duration(x.Int64N(int64(t.Renew)))
	}
}

// endLife ends a life that was not reset. A node handles a lost claim
// before it stages the volume again (the agent's volume lock): the next
// life waits for the drain. A claim still held is released.
func (h *simHost) endLife(e *Engine, w *window, life int) {
	s := h.s
	for e.Lost() != nil && !e.Health().Drained {
		time.Sleep(100 * time.Millisecond)
	}
	if e.Lost() == nil {
		s.closeWindow(w, "released", time.Now())
		if err := e.Release(context.Background()); err != nil {
			s.event(h.idx, "release failed", "life", life, "error", err.Error())
		}
	}
}

// pause freezes the agent for a while. Its host watchdog, fed until the
// pause or until the lease's last renewal is F old, whichever is first,
// resets the host W later. It reports whether the host was reset.
func (h *simHost) pause(ctx context.Context, e *Engine, dev *simDevice, w *window) bool {
	s := h.s
	t := h.clock()
	var dur time.Duration
	switch h.rng.IntN(3) {
	case 0:
		dur = time.Duration(h.rng.Int64N(int64(t.Renew)))
	case 1:
		dur = t.Renew + time.Duration(h.rng.Int64N(int64(t.Fail)))
	default:
		dur = t.Fail + time.Duration(h.rng.Int64N(int64(2*t.Watchdog)))
	}
	p := time.Now()
	lastFeed := p
	if hl := e.Health(); hl.Held && !hl.Lost {
		lastFeed = minTime(p, hl.RenewedAt.Add(hl.Fail))
	}
	resetAt := lastFeed.Add(t.Watchdog)
	s.event(h.idx, "agent paused", "for", dur.String(), "watchdog_reset_at", simTime(resetAt))
	dev.pause()
	if p.Add(dur).Before(resetAt) {
		time.Sleep(dur)
		dev.unpause()
		s.event(h.idx, "agent resumed")
		return false
	}
	time.Sleep(time.Until(resetAt))
	s.closeWindow(w, "watchdog reset", time.Now())
	dev.kill()
	s.event(h.idx, "watchdog reset the host")
	return true
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func simMaxExpiry() time.Duration {
	m := time.Duration(0)
	for _, t := range simAllTiming() {
		m = max(m, t.Expiry()+t.Settle())
	}
	return m
}

// loneLocked reports whether an acquisition starting now is alone on a
// quiet disk: every other engine life has ended (released, or reset) and
// has no request in flight.
func (s *sim) loneLocked(self *window) bool {
	for _, d := range s.devices {
		if d.w == self {
			continue
		}
		d.mu.Lock()
		quiet := (d.done || d.dead) && d.inflight == 0
		d.mu.Unlock()
		if !quiet {
			return false
		}
	}
	return true
}

// othersWritesLocked counts the writes issued by every engine life but
// self's.
func (s *sim) othersWritesLocked(self *window) int {
	n := 0
	for _, d := range s.devices {
		if d.w != self {
			d.mu.Lock()
			n += d.writes
			d.mu.Unlock()
		}
	}
	return n
}

// checkLoss: a loss because our own slot changed needs another writer of
// that slot, or a write of ours that failed and may have torn it (a
// failing disk may cost the claim; a slow one must not).
func (s *sim) checkLoss(w *window, l *fence.LostError) {
	if !strings.Contains(l.Reason, "changed under us") {
		return
	}
	w.dev.mu.Lock()
	failed := w.dev.failed
	w.dev.mu.Unlock()
	if failed > 0 {
		return
	}
	s.disk.mu.Lock()
	defer s.disk.mu.Unlock()
	for i := range Slots {
		if !s.disk.writers[i][w] {
			continue
		}
		foreign := false
		for o := range s.disk.writers[i] {
			if o != w {
				foreign = true
			}
		}
		if foreign {
			return
		}
	}
	s.failf("host %d life %d lost its claim because its slot changed, yet nobody else wrote its slot: %s", w.host, w.life, l.Reason)
}

// checkGrantBound: a granted takeover on a healthy disk path returns
// within the superseded holder's expiry bound plus a settle wait and a
// few I/O timeouts, or twice the bound when another held slot (a host
// superseded earlier, not yet cleared) is waited out first.
func (s *sim) checkGrantBound(w *window, took time.Duration) {
	if w.dev.prof != calmIO {
		return
	}
	var b time.Duration
	for _, t := range simAllTiming() {
		b = max(b, 2*t.Expiry()+t.Settle()+t.Renew+8*t.IOTimeout)
	}
	if took > b {
		s.failf("host %d life %d: a granted acquisition took %s, above its bound %s", w.host, w.life, took, b)
	}
}

// checkWindows: no two keys may write at overlapping times.
func (s *sim) checkWindows() {
	s.mu.Lock()
	ws := slices.Clone(s.windows)
	s.mu.Unlock()
	for i, a := range ws {
		for _, b := range ws[i+1:] {
			if a.key == b.key {
				continue
			}
			if a.start.Before(b.end) && b.start.Before(a.end) {
				s.failf("two keys may write at once: %s and %s", a, b)
			}
		}
	}
}

// newSim draws a schedule of class from its seed.
// simExtras says which extra faults a schedule draws beside its plain
// events: none (-lease.plain), the faults of drawExtras but no agent
// restarts (as schedules were drawn before restarts were simulated; the
// regressions found then replay that way), or all of them.
type simExtras int

const (
	extrasNone simExtras = iota
	extrasNoRestarts
	extrasAll
)

func newSim(t *testing.T, seed int64, class simClass, trace *syncBuffer, extras simExtras) (*sim, []*simHost) {
	r := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
	s := &sim{t: t, seed: seed, class: class, trace: trace, acquiring: map[*window]bool{}}
	s.log = slog.New(slog.NewTextHandler(trace, &slog.HandlerOptions{Level: slog.LevelInfo,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.String("t", simTime(a.Value.Time()))
			}
			return a
		}}))
	sector := 512
	if r.IntN(4) == 0 {
		sector = 4096
	}
	s.disk = &simDisk{sector: sector, data: make([]byte, ReadSize)}
	copy(s.disk.data, EncodeHeader(Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset}))

	hs := &simHosts{s: s}
	span := hs.draw(r, class)
	hosts := hs.hosts
	for _, h := range hosts {
		if h.key != 0 && h.uuid == "" {
			h.uuid = fmt.Sprintf("%08x-0000-4000-8000-%012x", h.idx, uint64(h.key)&(1<<48-1))
		}
	}
	if extras != extrasNone {
		s.drawExtras(hosts, class, extras == extrasAll)
	}
	s.end = simEpoch.Add(span)
	return s, hosts
}

// simHosts are the hosts of a schedule as they are drawn.
type simHosts struct {
	s     *sim
	hosts []*simHost
}

// add numbers h and gives it a stream of its own from the seed.
func (hs *simHosts) add(h *simHost) {
	h.s, h.idx = hs.s, len(hs.hosts)
	h.sem = make(chan struct{}, 1)
	h.rng = rand.New(rand.NewPCG(uint64(hs.s.seed), uint64(len(hs.hosts))+1))
	hs.hosts = append(hs.hosts, h)
}

// draw draws the hosts of class from r and returns the schedule's span.
func (hs *simHosts) draw(r *rand.Rand, class simClass) time.Duration {
	timing := func() Timing { return simTiming[r.IntN(len(simTiming))] }
	switch class {
	case classMixed:
		n := 2 + r.IntN(3)
		profs := []ioProfile{calmIO, roughIO, slowIO, draggyIO}
		for range n {
			tm := timing()
			hs.add(&simHost{timing: tm, prof: profs[r.IntN(len(profs))], grantP: 0.3, pauseP: 0.1, dieP: 0.05, hold: 4 * tm.Renew})
		}
		return 15 * time.Minute
	case classSlow:
		tm := timing()
		hs.add(&simHost{timing: tm, prof: slowIO, lives: 1, hold: 30 * time.Minute})
		return 30 * time.Minute
	case classChurn:
		tm := simTiming[1+r.IntN(2)]
		// One node after another, each new, each dying with the disk.
		hs.add(&simHost{timing: tm, prof: calmIO, churn: true, dieP: 1, hold: 2 * tm.Renew, lives: Slots + 4})
		return 3 * time.Hour
	case classTakeover:
		tm := timing()
		hs.add(&simHost{timing: tm, prof: laggyIO, hold: 20 * tm.Renew})
		for range 1 + r.IntN(2) {
			hs.add(&simHost{timing: tm, prof: calmIO, grantP: 1, hold: 4 * tm.Renew, pauseP: 0.05})
		}
		return 15 * time.Minute
	case classFirst:
		hs.drawFirst(r)
		return 3 * time.Minute
	}
	return 0
}

// drawFirst draws the hosts of classFirst. Host 0 was given the disk
// first (the never-published flag); the others are VMs a faulty platform
// attached it to as well, whose nodes were published it later (some with
// a grant naming host 0) and acquire within a few milliseconds of host
// 0's claim, as the fast path's read and write take that long.
func (hs *simHosts) drawFirst(r *rand.Rand) {
	all := simAllTiming()
	tm := all[r.IntN(len(all))]
	k0 := hs.s.freshKey(r)
	base := time.Second
	// Slow reads and writes of host 0 put racers' claims inside its
	// fast claim's read-to-write window.
	firstIO := []ioProfile{calmIO, calmIO, roughIO, draggyIO, laggyIO}
	hs.add(&simHost{timing: tm, key: k0, prof: firstIO[r.IntN(len(firstIO))], first: true, lives: 1 + r.IntN(3),
		pauseP: 0.1, dieP: 0.05, hold: 4 * tm.Renew, start: base})
	racerTiming := append(all, simMinTiming, simMinTiming, simMinTiming, simMinTiming, simMinTiming, simMinTiming)
	profs := []ioProfile{calmIO, calmIO, roughIO, slowIO}
	for range 1 + r.IntN(2) {
		rt := racerTiming[r.IntN(len(racerTiming))]
		// Each starts within a few ms of host 0's first read of the
		// lease area (AcquireFirst), which it waits for: a claim
		// that landed before that read would make the area look like
		// a clone's, whose copies AcquireFirst clears on the
		// controller's word alone (docs/fencing.md).
		spread := float64(tm.IOTimeout) * []float64{0.002, 0.01, 0.05, 0.5}[r.IntN(4)]
		off := time.Duration(1 + spread*r.Float64())
		hs.add(&simHost{timing: rt, prof: profs[r.IntN(len(profs))], grantP: 0.5, grantKey: k0, lives: 1 + r.IntN(2),
			pauseP: 0.1, dieP: 0.05, hold: 4 * rt.Renew, start: off})
	}
	hs.s.firstRead = make(chan struct{})
}

// drawExtras draws the extra faults onto the hosts: their own timings,
// clock rates, releases before acquiring, and a clone's held slots. They
// are drawn from their own stream, so a seed's schedule without them is
// the one it always was.
func (s *sim) drawExtras(hosts []*simHost, class simClass, restarts bool) {
	x := rand.New(rand.NewPCG(uint64(s.seed), 0xe7a5))
	all := simAllTiming()
	for _, h := range hosts {
		h.x = rand.New(rand.NewPCG(uint64(s.seed)^0xe7a5, uint64(h.idx)+1))
		h.releaseFirstP = 0.15
		if restarts {
			h.restarts = rand.New(rand.NewPCG(uint64(s.seed)^0x5e57a7, uint64(h.idx)+1))
			h.restartP = 0.1
		}
		if x.Float64() < 0.4 {
			h.timing = all[x.IntN(len(all))]
		}
		if h.x.IntN(2) == 0 {
			// Clocks that run at rates up to 1% apart (the package
			// doc assumes "about the same rate").
			h.rate = clockRate(h.x, h.timing, 0.01)
		}
	}
	if (class == classMixed || class == classTakeover || class == classFirst) && x.IntN(4) == 0 {
		// A clone of a disk in use: it starts with the source's held
		// slots, whose writers never write here, and the first node
		// given it acquires with AcquireFirst before any other node
		// is given it (in classFirst too: clearing copies rests on
		// the controller's word that no other VM has the disk).
		s.serial, s.first, hosts[0].first = "sim-disk", make(chan struct{}), true
		for range 1 + x.IntN(3) {
			sl := Slot{Key: s.freshKey(x), Epoch: 1 + x.Uint64N(5), Counter: 1 + x.Uint64N(100), State: StateHeld,
				Timing: all[x.IntN(len(all))], Node: "source-host"}
			if x.IntN(2) == 0 {
				sl.Serial = "source-disk"
			}
			copy(s.disk.data[BlockSize*(1+x.IntN(Slots)):], EncodeSlot(sl))
		}
	}
}

// syncBuffer is a trace buffer written from many goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// runSchedule runs one seed of class and returns the broken invariants
// and the trace.
func runSchedule(t *testing.T, seed int64, class simClass, extras simExtras) (failures []string, trace string, s *sim) {
	buf := &syncBuffer{}
	synctest.Test(t, func(t *testing.T) {
		var hosts []*simHost
		s, hosts = newSim(t, seed, class, buf, extras)
		s.event(-1, "schedule", "seed", seed, "class", s.class.String(), "hosts", len(hosts), "sector", s.disk.sector, "extras", int(extras), "clone", s.first != nil)
		for _, h := range hosts {
			s.event(h.idx, "host", "timing", h.timing.String(), "clock_rate", h.rate)
		}
		ctx, cancel := context.WithDeadline(context.Background(), s.end.Add(time.Hour))
		var wg sync.WaitGroup
		for _, h := range hosts {
			wg.Go(func() { h.run(ctx) })
		}
		wg.Wait()
		cancel()
		// Dead hosts' engines wind down on their own (their renewals
		// fail until the fail bound, then they stop), and late writes
		// land; the fake clock runs only while this goroutine lives.
		time.Sleep(simMaxExpiry())
	})
	s.checkWindows()
	return s.failures, buf.String(), s
}

func TestLeaseSchedules(t *testing.T) {
	if *simSeed >= 0 {
		failures, trace, s := runSchedule(t, *simSeed, classOf(*simSeed), flagExtras())
		t.Logf("seed %d (%s):\n%s", *simSeed, s.class, trace)
		for _, f := range failures {
			t.Error(f)
		}
		return
	}
	n := *simSeeds
	if testing.Short() {
		n = 200
	}
	// The schedules are independent: two shards run side by side.
	var mu sync.Mutex
	broken, firsts, fast, fastRaced := 0, 0, 0, 0
	for shard := range int64(2) {
		t.Run(fmt.Sprintf("shard%d", shard), func(t *testing.T) {
			t.Parallel()
			for seed := *simFrom + shard; seed < *simFrom+int64(n); seed += 2 {
				class := classOf(seed)
				if *simOnly >= 0 && class != simClass(*simOnly) {
					continue
				}
				failures, trace, s := runSchedule(t, seed, class, flagExtras())
				mu.Lock()
				if class == classFirst {
					firsts++
				}
				fast += s.fast
				fastRaced += s.fastRaced
				mu.Unlock()
				if len(failures) == 0 {
					continue
				}
				mu.Lock()
				broken++
				first := broken <= 3
				mu.Unlock()
				if first {
					t.Errorf("seed %d (%s) broke the lease's invariants:\n  %s\ntrace (last 150 lines):\n%s\nreplay: go test ./fence/lease -run 'TestLeaseSchedules$' -lease.seed=%d -v",
						seed, class, strings.Join(failures, "\n  "), lastLines(trace, 150), seed)
				} else {
					t.Errorf("seed %d (%s): %s", seed, class, failures[0])
				}
			}
		})
	}
	t.Cleanup(func() {
		t.Logf("%d schedules from seed %d, %d broken; %d fast first claims, %d of them while another host acquired",
			n, *simFrom, broken, fast, fastRaced)
		// The first class must exercise what it is for: fast claims, and
		// some raced by another host's acquisition.
		if firsts >= 100 && (fast < firsts/8 || fastRaced == 0) {
			t.Errorf("%d schedules of class first made only %d fast first claims, %d of them raced: the class no longer tests the fast path",
				firsts, fast, fastRaced)
		}
	})
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Seeds that broke the engine as it was before the fixes they name, kept
// as regression cases: each broke an invariant then, and must hold now.
var simRegressions = []struct {
	seed   int64
	class  simClass // as drawn when the seed broke (seed % 4, before classFirst)
	what   string
	extras simExtras
}{
	{1, classSlow, "slow: a renewal write that timed out landed later, and the next renewal took the holder's own slot as changed by another host (its claim lost for good)", extrasNone},
	{1051, classTakeover, "takeover: a torn read of the superseded holder's slot, in the middle of its renewal, was taken as its acknowledgement; both then wrote", extrasNone},
	{519, classTakeover, "takeover: the same, on another schedule", extrasNone},
	{66, classChurn, "churn: sixteen dead holders' slots were never reused, so the disk could not be acquired again", extrasNone},
	{308, classMixed, "mixed: a new engine resumed its own record while the previous engine of the same node, which had lost the lease, marked the slot fenced; another node took the free disk and both wrote", extrasNone},
	{288, classMixed, "mixed, extras: a racer's renewal was read torn in the last read of a taker's expiry wait, so its claim was neither owner nor waited for and its epoch unseen; the taker claimed the same epoch, won the tie on its lower key, and both wrote", extrasNoRestarts},
	{2392, classMixed, "mixed, extras: the same kind of schedule, another seed", extrasNoRestarts},
	{1560, classMixed, "mixed, agent restarts: a restarted agent's resume met a granted taker's claim after its settle wait and withdrew its record (marked it released) while the host still wrote; the taker took that as the holder's acknowledgement and both wrote", extrasAll},
	{1530, classMixed, "mixed, agent restarts: a granted takeover began while the agent was down; its resume, then built on Acquire, withdrew its record as the claim appeared and both wrote", extrasAll},
}

// flagExtras is the extras -lease.plain asks for.
func flagExtras() simExtras {
	if *simPlain {
		return extrasNone
	}
	return extrasAll
}

func TestLeaseScheduleRegressions(t *testing.T) {
	for _, r := range simRegressions {
		failures, trace, _ := runSchedule(t, r.seed, r.class, r.extras)
		if len(failures) > 0 {
			t.Errorf("seed %d (%s), once %s:\n  %s\ntrace (last 150 lines):\n%s", r.seed, r.class, r.what,
				strings.Join(failures, "\n  "), lastLines(trace, 150))
		}
	}
}

// A holder with a long expiry bound (the default timing) froze with a
// renewal half written: its slot does not decode. A taker configured with
// a shorter bound must still wait for the holder's, which the torn slot's
// first sector carries, not its own: the holder's watchdog resets it only
// F+W after its last renewal.
func TestTornSlotWaitsForItsWritersBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		holder := DefaultTiming()
		last := EncodeSlot(Slot{Key: 0x1111, Epoch: 3, Counter: 7, State: StateHeld, Timing: holder})
		torn := EncodeSlot(Slot{Key: 0x1111, Epoch: 3, Counter: 8, State: StateHeld, Timing: holder})
		copy(torn[512:], last[512:]) // only the renewal's first sector landed
		copy(disk.data[BlockSize*(1+5):], torn)
		taker := simTiming[1]
		dev := &simDevice{disk: disk, rng: rand.New(rand.NewPCG(1, 2)), prof: calmIO, d: taker.IOTimeout}
		e, err := New(&Device{name: "torn", f: dev, sem: make(chan struct{}, 1), size: 1 << 30},
			Config{Key: 0x2222, Node: "taker", Timing: taker})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if _, err := e.Acquire(context.Background(), nil); err != nil {
			t.Fatalf("acquiring past a torn slot left unchanged: %v", err)
		}
		if took := time.Since(start); took < holder.Expiry() {
			t.Errorf("took the disk %s after finding a torn slot of a holder whose expiry bound is %s (the taker's own is %s)",
				took, holder.Expiry(), taker.Expiry())
		}
		if err := e.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// Two hosts race for a free disk, and their agents are configured with
// different timings. A (I/O timeout 1s, renewal every 15s) settles for
// 2s and checks its claim before B's lands: B (the default timing, I/O
// timeout 5s) read the disk before A's claim landed and took 4.5s to
// write its own. B's key is lower, so B's claim wins the tie at the same
// epoch and B's own check passes; but A already holds and writes until
// its next renewal, 15s after its claim. B must not return before A has
// let go.
func TestRacerWithShorterSettleLetsGoFirst(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(4096)
		node := func(key fence.Key, tm Timing, script func(bool) time.Duration, onLost func(*fence.LostError) bool) *Engine {
			dev := &simDevice{disk: disk, script: script}
			e, err := New(&Device{name: fmt.Sprintf("race-%s", key), f: dev, sem: make(chan struct{}, 1), size: 1 << 30},
				Config{Key: key, Node: key.String(), Timing: tm, OnLost: onLost})
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		var aLost sync.Mutex
		aLostAt := time.Time{}
		a := node(0x2000, Timing{IOTimeout: time.Second, Renew: 15 * time.Second, Fail: 30 * time.Second, Watchdog: 30 * time.Second},
			func(bool) time.Duration { return 10 * time.Millisecond },
			func(*fence.LostError) bool {
				aLost.Lock()
				aLostAt = time.Now()
				aLost.Unlock()
				return true
			})
		bWrites := 0
		// B's d (5 s) covers its 4.5 s claim write.
		long := Timing{IOTimeout: 5 * time.Second, Renew: 10 * time.Second, Fail: 40 * time.Second, Watchdog: time.Minute}
		b := node(0x1000, long, func(write bool) time.Duration {
			if write {
				bWrites++
				if bWrites == 1 {
					return 4500 * time.Millisecond // the claim
				}
			}
			return 100 * time.Millisecond
		}, nil)
		var wg sync.WaitGroup
		var bAt time.Time
		var bErr error
		wg.Go(func() {
			_, bErr = b.Acquire(context.Background(), nil)
			bAt = time.Now()
		})
		time.Sleep(50 * time.Millisecond) // B's read has seen the free disk
		if _, err := a.Acquire(context.Background(), nil); err != nil {
			t.Fatalf("A: %v", err)
		}
		wg.Wait()
		if bErr != nil {
			t.Fatalf("B: %v", bErr)
		}
		aLost.Lock()
		lostAt := aLostAt
		aLost.Unlock()
		if lostAt.IsZero() || bAt.Before(lostAt) {
			t.Errorf("B returned holding the lease at %s while A, which holds it since its own check, had not let go (lost at %s)",
				simTime(bAt), simTime(lostAt))
		}
		_ = a.Release(context.Background())
		_ = b.Release(context.Background())
	})
}

// X released the disk earlier; its slot says released. X claims the disk
// again (its claim goes to the slot carrying its key) while Y, finding
// the disk free, claims it too. X's claim write is slow: it times out and
// lands after Y's race check has passed. Had Y written its claim into X's
// released slot, X's late claim would erase it: X then withdraws the late
// claim, finds the disk free and takes it while Y still holds it until
// its next renewal. Y's claim goes to an empty slot instead.
func TestClaimAvoidsAnotherKeysReleasedSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(4096)
		short := Timing{IOTimeout: time.Second, Renew: 5 * time.Second, Fail: 10 * time.Second, Watchdog: 15 * time.Second}
		const xKey, xSlot = fence.Key(0x1000), 3
		copy(disk.data[BlockSize*(1+xSlot):], EncodeSlot(Slot{Key: xKey, Epoch: 5, Counter: 9, State: StateReleased, Timing: short}))
		node := func(key fence.Key, script func(bool) time.Duration, onLost func(*fence.LostError) bool) *Engine {
			e, err := New(&Device{name: fmt.Sprintf("slot-%s", key), f: &simDevice{disk: disk, script: script}, sem: make(chan struct{}, 1), size: 1 << 30},
				Config{Key: key, Node: key.String(), Timing: short, OnLost: onLost})
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		fast := func(bool) time.Duration { return 10 * time.Millisecond }
		// Y's key starts its slot order at X's slot.
		yKey := fence.Key(0x2000)
		for ; node(yKey, fast, nil).slotOrder() != xSlot; yKey++ {
		}
		lateClaimMustNotTakeYsDisk(t, node, xKey, yKey)
	})
}

// While a taker waits out a dead holder's slot, another host claims the
// disk in a slot the taker was not waiting for, and its next renewal tears
// (the write fails after its first sector landed) before the taker reads
// the disk again. The torn slot owns nothing in that read and its epoch
// is not seen, yet its writer holds the disk until its own bound passes:
// the taker must start over and wait for it, not claim the disk when its
// wait for the dead holder ends.
func TestSlotTornDuringExpiryWaitIsWaitedFor(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		start := time.Now()
		copy(disk.data[BlockSize*(1+2):], EncodeSlot(Slot{Key: 0x3000, Epoch: 4, Counter: 3, State: StateHeld, Timing: tm}))
		const hSlot = 7
		hHeld := Slot{Key: 0x1000, Epoch: 5, Counter: 1, State: StateHeld, Timing: tm}
		torn := make(chan time.Time, 1)
		go func() {
			time.Sleep(10500 * time.Millisecond)
			disk.landSector(BlockSize*(1+hSlot), EncodeSlot(hHeld)) // H's claim
			time.Sleep(time.Second)
			hHeld.Counter++
			disk.landSector(BlockSize*(1+hSlot), EncodeSlot(hHeld)[:512]) // H's renewal, torn
			torn <- time.Now()
		}()
		e, err := New(&Device{name: "taker", f: &simDevice{disk: disk, script: func(bool) time.Duration { return 10 * time.Millisecond }},
			sem: make(chan struct{}, 1), size: 1 << 30}, Config{Key: 0x2000, Node: "taker", Timing: tm})
		if err != nil {
			t.Fatal(err)
		}
		_, err = e.Acquire(context.Background(), nil)
		tornAt := <-torn
		if err == nil && time.Since(tornAt) < tm.Expiry() {
			t.Errorf("took the disk %s after starting, %s after another host's slot tore while it waited; that host's bound is %s",
				time.Since(start), time.Since(tornAt), tm.Expiry())
		}
		_ = e.Release(context.Background())
	})
}

// A granted takeover while another held slot (a host gone without
// releasing) is waited out: the victim the grant names renews all the
// while, which is no reason to start over.
func TestGrantedTakeoverPastAGoneHostsSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(512)
		tm := simTiming[1]
		fast := func(bool) time.Duration { return 10 * time.Millisecond }
		node := func(key fence.Key, onLost func(*fence.LostError) bool) *Engine {
			e, err := New(&Device{name: key.String(), f: &simDevice{disk: disk, script: fast}, sem: make(chan struct{}, 1), size: 1 << 30},
				Config{Key: key, Node: fmt.Sprintf("00000000-0000-4000-8000-%012x", uint64(key)), Timing: tm, OnLost: onLost})
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		v := node(0x1000, func(*fence.LostError) bool { return true })
		if _, err := v.Acquire(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		// A host that held the disk before v, superseded and gone, whose
		// slot was never cleared.
		copy(disk.data[BlockSize*(1+9):], EncodeSlot(Slot{Key: 0x3000, Epoch: 1, Counter: 5, State: StateHeld, Timing: tm}))
		taker := node(0x2000, nil)
		grant := &fence.Grant{Node: taker.cfg.Node, Supersedes: []fence.Key{v.cfg.Key}}
		if _, err := taker.Acquire(context.Background(), grant); err != nil {
			t.Errorf("granted takeover from a live holder, past a gone host's slot: %v", err)
		} else if v.Lost() == nil {
			t.Error("the taker holds the disk and the granted victim has not lost it")
		}
		_ = taker.Release(context.Background())
		_ = v.Release(context.Background())
	})
}

// X and Y, new to a free disk, pick the same empty slot (their keys start
// their slot orders at the same one). X's claim write is slow: it times
// out and lands after Y's race check has passed, erasing Y's claim. X
// withdraws its late claim; the disk then looks free, but Y holds it until
// its next renewal. X must wait that slot out before it takes the disk.
func TestLateClaimOverASharedEmptySlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := formattedSimDisk(4096)
		short := Timing{IOTimeout: time.Second, Renew: 5 * time.Second, Fail: 10 * time.Second, Watchdog: 15 * time.Second}
		node := func(key fence.Key, script func(bool) time.Duration, onLost func(*fence.LostError) bool) *Engine {
			e, err := New(&Device{name: fmt.Sprintf("slot-%s", key), f: &simDevice{disk: disk, script: script}, sem: make(chan struct{}, 1), size: 1 << 30},
				Config{Key: key, Node: key.String(), Timing: short, OnLost: onLost})
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		fast := func(bool) time.Duration { return 10 * time.Millisecond }
		const xKey = fence.Key(0x1000)
		yKey := fence.Key(0x2000)
		for ; node(yKey, fast, nil).slotOrder() != node(xKey, fast, nil).slotOrder(); yKey++ {
		}
		lateClaimMustNotTakeYsDisk(t, node, xKey, yKey)
	})
}

// formattedSimDisk is a simulated disk with sectors of sector bytes and a
// lease header, for the scripted tests.
func formattedSimDisk(sector int) *simDisk {
	d := &simDisk{sector: sector, data: make([]byte, ReadSize)}
	copy(d.data, EncodeHeader(Header{Version: version, BlockSize: BlockSize, Slots: Slots, SlotOffset: BlockSize, DataOffset: DataOffset}))
	return d
}

// lateClaimMustNotTakeYsDisk: X's first write (its claim) takes past d and
// lands after Y, starting 50 ms later on a fast path, has acquired. X must
// not hold the disk while Y does: either it fails, or it acquires only
// after Y lost its claim.
func lateClaimMustNotTakeYsDisk(t *testing.T, node func(fence.Key, func(bool) time.Duration, func(*fence.LostError) bool) *Engine, xKey, yKey fence.Key) {
	t.Helper()
	fast := func(bool) time.Duration { return 10 * time.Millisecond }
	var mu sync.Mutex
	var yLostAt time.Time
	y := node(yKey, fast, func(*fence.LostError) bool {
		mu.Lock()
		yLostAt = time.Now()
		mu.Unlock()
		return true
	})
	xWrites := 0
	x := node(xKey, func(write bool) time.Duration {
		if write {
			if xWrites++; xWrites == 1 {
				return 2500 * time.Millisecond // the claim, past d
			}
		}
		return 10 * time.Millisecond
	}, nil)
	var wg sync.WaitGroup
	var xAt time.Time
	var xErr error
	wg.Go(func() {
		_, xErr = x.Acquire(context.Background(), nil)
		xAt = time.Now()
	})
	time.Sleep(50 * time.Millisecond) // X's claim is on its way
	if _, err := y.Acquire(context.Background(), nil); err != nil {
		t.Fatalf("Y: %v", err)
	}
	wg.Wait()
	mu.Lock()
	lostAt := yLostAt
	mu.Unlock()
	if xErr == nil && (lostAt.IsZero() || xAt.Before(lostAt)) {
		t.Errorf("X acquired the disk at %s while Y held it (Y lost it at %s)", simTime(xAt), simTime(lostAt))
	}
	_ = x.Release(context.Background())
	_ = y.Release(context.Background())
}
