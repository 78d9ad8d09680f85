package volume

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"time"

	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/internal/loopdev"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// Encryption formats, opens and closes LUKS2 volumes (LUKS, built on
// package crypt). The passphrase is used for the call only;
// implementations never keep or log it.
type Encryption interface {
	// Inspect reads what device holds where the LUKS2 header goes: nothing,
	// a LUKS2 header (with its transit token), or other data. It changes
	// nothing.
	Inspect(ctx context.Context, device string) (Content, error)
	// Format writes a new LUKS2 header with one keyslot for passphrase and
	// tok as its vco-transit token on the device p proved blank. A proof
	// of the device past the LUKS2 header area only (blank.ProvePast, for
	// the agent's own format a crash cut short) lets it write over that
	// area; nothing else is ever formatted.
	Format(ctx context.Context, p blank.Proof, passphrase []byte, tok luks2.TransitToken) error
	// Open unlocks the LUKS2 volume on device and maps it as name.
	Open(ctx context.Context, device, name string, passphrase []byte, readOnly bool) (Mapped, error)
	// Close removes the mapping; a missing mapping is not an error.
	Close(ctx context.Context, name string) error
	// Resize grows the mapping to its backing device, online.
	Resize(ctx context.Context, name string) error
}

// Options configure a Manager.
type Options struct {
	Config    config.Volumes
	StateDir  string
	SysfsRoot string
	// Fencers chooses each disk's fencing; required.
	Fencers FencerFactory
	// Crypt is nil when the agent has no LUKS2 support: encrypted volumes
	// are then refused.
	Crypt   Encryption
	Bus     *events.Bus
	Log     *slog.Logger
	Metrics *Metrics
}

// Manager stages, publishes and watches volumes.
type Manager struct {
	o      Options
	log    *slog.Logger
	finder discovery.Finder
	store  *Store
	locks  locks
	// host is every effect on the node besides the claim records (host.go);
	// its mounter mounts only: every format takes a blank proof (format.go).
	host host
	exec utilexec.Interface

	// How the manager opens a volume's disk (locate) and maps and unmaps
	// its data region (dataMapping, dropDataMapping). The stage's rollback
	// tests, which run without root, replace them (stage_test.go).
	locate func(ctx context.Context, loc Locator) (*Device, error)
	// scanOpen, when set, stands for the claim checks' disk lookups
	// (diskScan.open); only the manager simulation sets it.
	scanOpen  func(ctx context.Context, loc Locator) (*Device, error)
	mapData   func(disk string, offset int64, readOnly bool) (string, error)
	unmapData func(p string) error
	// mapPod, unmapPod and resizeLoop attach, detach and grow a raw block
	// volume's pod device (podDevice, dropPodDevice, loopdev.Resize).
	mapPod     func(mapping string, readOnly bool, name func(p string) error) (string, error)
	unmapPod   func(p string) error
	resizeLoop func(p string) error
	growData   func(p string) error

	// watchMu is held by the uevent watcher around a classification and
	// its refusal (WatchLock), and by a stage while it records the disk it
	// claims: a refusal decided before the record never lands after it.
	watchMu sync.Mutex

	mu   sync.Mutex
	live map[string]*live
	// unchecked are the staged lease claims recorded by an earlier agent
	// process that the start-up check has not looked at yet
	// (ExpectRecordedLeases); the host watchdog is not fed while any is.
	unchecked map[string]bool
	// removed are the device numbers of claimed disks removed while
	// their volume was busy with a call, until a disk at that number is
	// taken (back) by a claim: the watcher does not take the next disk
	// there for the claim's.
	removed map[string]bool
	// retakes are the claims of stages cut short, of any fencing, whose
	// take-back the start-up check could not finish; the claim check
	// tries again.
	retakes map[string]bool
	// bootID reads the kernel's boot id (tests give their own).
	bootID func() (string, error)
	// workers is how many claims the start-up check takes back side by
	// side (reconcileWorkers; the simulation takes them one at a time,
	// so that a seed replays the same schedule).
	workers int
	// afterBoot: this is the agent's first start since the host booted
	// (ExpectRecordedLeases), so no mount of an earlier process is left.
	afterBoot bool
	// reclaims holds when a stage of each volume began waiting for a
	// holder to re-establish (acquire), for its retries.
	reclaims map[string]time.Time
	// attachPoll is how often a stage waiting for its disk looks again
	// when no uevent wakes it (attachPoll; tests set their own).
	attachPoll time.Duration
	// seen is closed, and replaced, each time the uevent watcher has
	// decided about a disk (Refused): it wakes the stages waiting for a
	// hot-plugged disk (locateAttaching). Under seenMu, not mu, which is
	// held while fencers close (disk I/O) and must not slow the watcher.
	seenMu sync.Mutex
	seen   chan struct{}
}

// live is what the agent holds open for a claimed volume.
type live struct {
	dev    *Device
	fencer fence.Fencer
	// unresumed: a lease-fenced volume still mounted whose lease, held
	// before the agent restarted, could not be resumed yet (the read
	// failed); the periodic check retries, and the host watchdog is not
	// fed meanwhile (Leases).
	unresumed bool
	// ioRunning: the claim was lost before the agent restarted and its
	// I/O is not shown stopped (Claim.IONotStopped); listed for the host
	// watchdog like a lost lease whose stop failed.
	ioRunning bool
}

// New opens the claim store. Call Reconcile before serving.
func New(o Options) (*Manager, error) {
	if o.Fencers == nil {
		return nil, errors.New("volume manager needs a fencer factory")
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Metrics == nil {
		o.Metrics = NewMetrics()
	}
	st, err := OpenStore(o.StateDir)
	if err != nil {
		return nil, err
	}
	m := &Manager{
		o: o, log: o.Log, store: st, exec: utilexec.New(),
		finder: discovery.Finder{SysfsRoot: o.SysfsRoot, DevRoot: o.Config.DevRoot},
		live:   map[string]*live{}, unchecked: map[string]bool{}, retakes: map[string]bool{}, removed: map[string]bool{}, reclaims: map[string]time.Time{}, bootID: kernelBootID,
		workers: reconcileWorkers, attachPoll: attachPoll,
		unmapData: dropDataMapping, growData: growDataMapping, mapPod: podDevice, unmapPod: dropPodDevice, resizeLoop: loopdev.Resize,
	}
	m.locate = func(ctx context.Context, loc Locator) (*Device, error) {
		return locate(ctx, m.finder, loc, m.o.Config.AllowLoopDevices)
	}
	m.mapData = m.dataMapping
	m.host = osHost{mounter: beneathMounter{table: mount.NewWithoutSystemd(""), root: o.Config.KubeletRoot},
		root: o.Config.KubeletRoot, sysfs: sysfsRoot(m.finder), dev: devRoot(m.finder), exec: m.exec}
	return m, nil
}

// newScan starts a pass's shared view of the attached disks (diskScan).
func (m *Manager) newScan() *diskScan { return &diskScan{f: m.finder, open: m.scanOpen} }

// Metrics returns the manager's metrics.
func (m *Manager) Metrics() *Metrics { return m.o.Metrics }

// Store returns the claim store.
func (m *Manager) Store() *Store { return m.store }

func (m *Manager) publish(e events.Event) {
	if m.o.Bus != nil {
		m.o.Bus.Publish(e)
	}
}

func (m *Manager) count(op string, err *error) {
	res := "ok"
	if *err != nil {
		res = agenterr.Code(*err).String()
	}
	m.o.Metrics.stages.WithLabelValues(op, res).Inc()
	m.updateGauge()
}

func (m *Manager) updateGauge() {
	cs, _ := m.store.List()
	n := map[string]float64{"held": 0, "unfenced": 0, "lost": 0, "missing": 0}
	for _, c := range cs {
		switch {
		case c.Phase != PhaseStaged:
		case c.Missing && c.State != StateLost:
			n["missing"]++
		default:
			n[string(c.State)]++
		}
	}
	for s, v := range n {
		m.o.Metrics.claims.WithLabelValues(s).Set(v)
	}
}

func (l *live) close() {
	// A fencer that holds resources of its own (the lease's O_DIRECT
	// descriptor and renewal timer) lets them go.
	if c, ok := l.fencer.(io.Closer); ok {
		c.Close()
	}
	l.dev.Close()
}

func (m *Manager) setLive(volume string, l *live) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.unchecked, volume)
	delete(m.retakes, volume)
	if old := m.live[volume]; old != nil && old != l {
		old.close()
	}
	if l == nil {
		delete(m.live, volume)
		return
	}
	if l.dev != nil {
		delete(m.removed, l.dev.DevNum())
	}
	m.live[volume] = l
}

// setRunning marks, in place, whether the live entry of a lost claim has
// I/O not shown stopped (live.ioRunning).
func (m *Manager) setRunning(volume string, running bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if l := m.live[volume]; l != nil {
		l.ioRunning = running
	}
}

// notTakenBack reports whether the lease-fenced volume's claim, recorded
// by an earlier agent process, is still to be taken back by a check: not
// looked at yet, not resumed, or lost with its I/O not shown stopped.
func (m *Manager) notTakenBack(volume string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	l := m.live[volume]
	return m.unchecked[volume] || (l != nil && (l.unresumed || l.ioRunning))
}

func (m *Manager) getLive(volume string) *live {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.live[volume]
}

// Close closes every device the manager holds open. Claims stay recorded
// and fences stay held: a restarted agent picks them up. The volumes are
// closed side by side, since each lease's hand-off (its last renewal) is a
// read and a write that a slow disk may stretch to its I/O timeout.
func (m *Manager) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	var wg sync.WaitGroup
	for v, l := range m.live {
		wg.Go(l.close)
		delete(m.live, v)
	}
	wg.Wait()
}
