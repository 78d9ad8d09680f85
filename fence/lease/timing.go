package lease

import (
	"fmt"
	"time"
)

// Timing is every time parameter of the lease. A holder writes its own
// Timing into its slot, and a node that waits for that holder's lease to
// expire uses the holder's figures, not its own.
type Timing struct {
	// IOTimeout (d) bounds one lease read or write. An I/O that takes
	// longer counts as failed. Every wait in the algorithm is a multiple
	// of it.
	IOTimeout time.Duration `json:"io_timeout"`
	// Renew (R) is the renewal interval: the holder rewrites its slot
	// this often.
	Renew time.Duration `json:"renew"`
	// Fail (F) is how long after its last successful renewal the holder
	// declares its claim lost and stops I/O (self-fencing).
	Fail time.Duration `json:"fail"`
	// Watchdog (W) is the time the holder's host watchdog needs to reset
	// a host whose agent stopped renewing without fencing itself (hung or
	// killed). The agent arms that watchdog (agent/watchdog); zero only
	// where none is armed, which the agent allows only when told so
	// (volumes.lease.watchdog_device: none-unsafe) and tests.
	Watchdog time.Duration `json:"watchdog"`
}

// DefaultTiming: d = 2s, R = 2d, F = 5R, W = 30s. d is far above what a
// lease read and write take on a loaded disk (BenchmarkLeaseIOBusyLoop,
// docs/fencing.md), so a slow disk costs a missed renewal, not the claim;
// F lets a holder miss four renewals in a row (a stall of up to F - R)
// before it fences itself; W gives the host watchdog's feeder room on a
// busy host. A dead holder is taken over after Expiry + Settle = F + W + 3d
// = 56s, a live one with a grant lets go at its next renewal (R).
func DefaultTiming() Timing {
	return Timing{IOTimeout: 2 * time.Second, Renew: 4 * time.Second, Fail: 20 * time.Second, Watchdog: 30 * time.Second}
}

// Expiry is how long a taker observes a holder's slot unchanged before it
// treats the lease as expired: max(F + W + d, R + 6d). By then the holder
// has either fenced itself (F after its last renewal; d of slack for
// stopping I/O) or its watchdog has reset the host (W), and no renewal
// still in flight can land (R + 6d, the delta lease's own delay).
func (t Timing) Expiry() time.Duration {
	return max(t.Fail+t.Watchdog+t.IOTimeout, t.Renew+6*t.IOTimeout)
}

// Settle is how long an acquirer waits after writing its slot before it
// re-reads to detect a racing acquirer: 2d, so that every write issued by
// a node that read before ours landed has landed too.
func (t Timing) Settle() time.Duration { return 2 * t.IOTimeout }

// MinIOTimeout is the shortest d an engine is configured with. The fast
// first claim relies on it: it lands within FastClaimWithin of its read,
// and a host racing it checks its own claim no sooner than 2d after
// writing it, at least 2 x MinIOTimeout, less 1% for clock rates.
const MinIOTimeout = 100 * time.Millisecond

// FastClaimWithin bounds the time from the read of a blank lease area to
// the completion of the fast first claim written after it (AcquireFirst);
// a slower claim settles and is checked as any other.
const FastClaimWithin = 150 * time.Millisecond

// FastSlot is the slot a fast first claim writes. While it is empty no
// other claim writes it.
const FastSlot = 0

func (t Timing) validate() error {
	switch {
	case t.IOTimeout <= 0 || t.Renew <= 0 || t.Fail <= 0 || t.Watchdog < 0:
		return fmt.Errorf("lease timing %s: every value must be positive (watchdog may be 0)", t)
	case t.Renew < t.IOTimeout:
		return fmt.Errorf("lease timing %s: renewal interval is shorter than the I/O timeout", t)
	case t.Fail < 2*t.Renew:
		return fmt.Errorf("lease timing %s: the fail bound must allow at least two renewals", t)
	case t.Fail > time.Duration(maxMS)*time.Millisecond || t.Watchdog > time.Duration(maxMS)*time.Millisecond:
		return fmt.Errorf("lease timing %s: values must be below %d ms", t, maxMS)
	}
	return nil
}

// Bounds are the lease's waits for a holder with this timing, each a
// formula of its settings (docs/fencing.md gives the reasoning).
type Bounds struct {
	// Refusal: a stage finds a live holder and is refused within about
	// R + d (the holder renews within R; one read).
	Refusal time.Duration `json:"refusal"`
	// DeadTakeover: a holder that died, froze or hung, with its host
	// watchdog armed, is taken over after Expiry + Settle =
	// max(F + W + d, R + 6d) + 2d, with or without a grant.
	DeadTakeover time.Duration `json:"dead_takeover"`
	// GrantLive: a live holder superseded by a grant, with lease I/O at
	// its usual milliseconds, has let go (stopped and drained its I/O,
	// marked its slot fenced) and the taker has seen it within
	// max(Settle, R) + GrantPoll, plus the holder's drain.
	GrantLive time.Duration `json:"grant_live"`
	// GrantLiveSlowIO is the same when every lease I/O of both takes
	// the full d: R + 5d + GrantPoll, plus the drain.
	GrantLiveSlowIO time.Duration `json:"grant_live_slow_io"`
}

// Bounds returns the waits for a holder with timing t, acquired by a
// host with the same timing.
func (t Timing) Bounds() Bounds {
	return Bounds{
		Refusal:         t.Renew + t.IOTimeout,
		DeadTakeover:    t.Expiry() + t.Settle(),
		GrantLive:       max(t.Settle(), t.Renew) + t.GrantPoll(),
		GrantLiveSlowIO: t.Renew + 5*t.IOTimeout + t.GrantPoll(),
	}
}

// GrantPoll is how often a taker reads the lease while it waits for a
// superseded holder to let go: d/2, at most R.
func (t Timing) GrantPoll() time.Duration { return min(t.IOTimeout/2, t.Renew) }

func (t Timing) String() string {
	return fmt.Sprintf("{io %s, renew %s, fail %s, watchdog %s}", t.IOTimeout, t.Renew, t.Fail, t.Watchdog)
}

const maxMS = 1<<32 - 1

func ms(d time.Duration) uint32 {
	v := d.Milliseconds()
	if v < 0 {
		return 0
	}
	if v > maxMS {
		return maxMS
	}
	return uint32(v)
}

func fromMS(v uint32) time.Duration { return time.Duration(v) * time.Millisecond }
