package volume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/internal/blank"
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
	Format(ctx context.Context, p blank.Proof, passphrase []byte, tok TransitToken) error
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
	o       Options
	log     *slog.Logger
	finder  discovery.Finder
	store   *Store
	locks   locks
	mounter mount.Interface // mounts only: every format takes a blank proof (format.go)
	exec    utilexec.Interface

	// watchMu is held by the uevent watcher around a classification and
	// its refusal (WatchLock), and by a stage while it records the disk it
	// claims: a refusal decided before the record never lands after it.
	watchMu sync.Mutex

	mu   sync.Mutex
	live map[string]*live
	// reclaims holds when a stage of each volume began waiting for a
	// holder to re-establish (acquire), for its retries.
	reclaims map[string]time.Time
}

// live is what the agent holds open for a claimed volume.
type live struct {
	dev    *Device
	fencer fence.Fencer
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
	ex := utilexec.New()
	return &Manager{
		o: o, log: o.Log, store: st, exec: ex,
		finder:  discovery.Finder{SysfsRoot: o.SysfsRoot, DevRoot: o.Config.DevRoot},
		mounter: beneathMounter{Interface: mount.NewWithoutSystemd(""), root: o.Config.KubeletRoot},
		live:    map[string]*live{}, reclaims: map[string]time.Time{},
	}, nil
}

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
	if old := m.live[volume]; old != nil && old != l {
		old.close()
	}
	if l == nil {
		delete(m.live, volume)
		return
	}
	m.live[volume] = l
}

func (m *Manager) getLive(volume string) *live {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.live[volume]
}

// Close closes every device the manager holds open. Claims stay recorded
// and fences stay held: a restarted agent picks them up.
func (m *Manager) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for v, l := range m.live {
		l.close()
		delete(m.live, v)
	}
}

// StageRequest is StageVolume's input.
type StageRequest struct {
	Volume      string
	Locator     Locator
	StagingPath string
	FsType      string
	Block       bool
	MountFlags  []string
	ReadOnly    bool
	Grant       *fence.Grant
	// Encrypted volumes carry the passphrase (never stored or logged).
	Encrypted  bool
	Passphrase []byte
	// FormatLUKS gives a blank device a LUKS2 header holding Token, the
	// passphrase wrapped by the transit engine.
	FormatLUKS    bool
	Token         *TransitToken
	AllowUnfenced bool
	// NeverPublished is the controller's word that no node was given the
	// disk before this stage's: the reclaim wait is skipped (acquire).
	NeverPublished bool
}

// StageResult says what Stage did.
type StageResult struct {
	Device    string
	Method    fence.Method
	Formatted bool
}

// maxVolumeID is CSI's limit on a volume id; it also keeps the claim
// record's file name (the id in base64) under the kernel's 255 bytes.
const maxVolumeID = 128

// checkVolumeID refuses an id a claim could not be recorded under, or
// that would put control characters into log lines and journal fields.
func checkVolumeID(v string) error {
	if v == "" {
		return agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	if len(v) > maxVolumeID {
		return agenterr.New(agenterr.InvalidArgument, "the volume id is %d bytes long; at most %d are accepted", len(v), maxVolumeID)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return agenterr.New(agenterr.InvalidArgument, "volume id %q holds a control character", v)
		}
	}
	return nil
}

func fsTypeOf(r StageRequest) (string, error) {
	if r.Block {
		if r.FsType != "" {
			return "", agenterr.New(agenterr.InvalidArgument, "volume %s: a raw block volume has no filesystem, but fs_type %q was given", r.Volume, r.FsType)
		}
		if len(r.MountFlags) > 0 {
			return "", agenterr.New(agenterr.InvalidArgument, "volume %s: a raw block volume takes no mount flags", r.Volume)
		}
		return "", nil
	}
	switch r.FsType {
	case "":
		return "ext4", nil
	case "ext4", "xfs":
		return r.FsType, nil
	}
	return "", agenterr.New(agenterr.InvalidArgument, "volume %s: filesystem type %q is not supported; use ext4 or xfs", r.Volume, r.FsType)
}

func checkFlags(volume string, flags []string) error {
	for _, f := range flags {
		if f == "" || strings.ContainsAny(f, ",\n") {
			return agenterr.New(agenterr.InvalidArgument, "volume %s: mount flag %q is empty or holds a comma or newline; give one option per flag", volume, f)
		}
	}
	return nil
}

// compatible reports how a retried stage differs from the recorded one.
func compatible(c *Claim, r StageRequest, staging, fsType string) error {
	var diff []string
	if c.StagingPath != staging {
		diff = append(diff, fmt.Sprintf("staging path %s, not %s", c.StagingPath, staging))
	}
	if c.Block != r.Block {
		diff = append(diff, fmt.Sprintf("block=%v, not %v", c.Block, r.Block))
	}
	if c.FsType != fsType {
		diff = append(diff, fmt.Sprintf("filesystem %q, not %q", c.FsType, fsType))
	}
	if c.ReadOnly != r.ReadOnly {
		diff = append(diff, fmt.Sprintf("read_only=%v, not %v", c.ReadOnly, r.ReadOnly))
	}
	if c.Encrypted != r.Encrypted {
		diff = append(diff, fmt.Sprintf("encrypted=%v, not %v", c.Encrypted, r.Encrypted))
	}
	if c.Locator != r.Locator {
		diff = append(diff, fmt.Sprintf("device %s, not %s", c.Locator, r.Locator))
	}
	if !slices.Equal(c.MountFlags, r.MountFlags) {
		diff = append(diff, fmt.Sprintf("mount flags %v, not %v", c.MountFlags, r.MountFlags))
	}
	if len(diff) == 0 {
		return nil
	}
	return agenterr.New(agenterr.AlreadyExists, "volume %s is already staged on this node with %s; unstage it first to stage it differently",
		c.Volume, strings.Join(diff, ", "))
}

// Stage implements StageVolume.
func (m *Manager) Stage(ctx context.Context, r StageRequest) (res StageResult, err error) {
	defer m.count("stage", &err)
	if err := checkVolumeID(r.Volume); err != nil {
		return res, err
	}
	if r.Locator == (Locator{}) {
		return res, agenterr.New(agenterr.InvalidArgument, "volume %s: the device locator names nothing (pci address, serial or wwn)", r.Volume)
	}
	staging, err := confine(m.o.Config.KubeletRoot, "staging path", r.StagingPath)
	if err != nil {
		return res, err
	}
	fsType, err := fsTypeOf(r)
	if err != nil {
		return res, err
	}
	if err := checkFlags(r.Volume, r.MountFlags); err != nil {
		return res, err
	}
	if r.Encrypted && len(r.Passphrase) == 0 {
		return res, agenterr.New(agenterr.InvalidArgument, "volume %s is encrypted but the request carries no passphrase", r.Volume)
	}
	release, err := m.locks.try(r.Volume, "stage")
	if err != nil {
		return res, err
	}
	defer release()

	c, err := m.store.Get(r.Volume)
	if err != nil {
		return res, err
	}
	if c != nil {
		if err := compatible(c, r, staging, fsType); err != nil {
			return res, err
		}
		if c.State == StateLost {
			if r.Grant == nil {
				return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s; staging it again needs a takeover grant from the controller", r.Volume, c.Detail)
			}
			if len(c.Publications) > 0 {
				return res, agenterr.New(agenterr.FailedPrecondition, "volume %s lost its fence and is still published at %v; unpublish it before staging it again", r.Volume, c.Publications)
			}
			if err := m.dropLost(c); err != nil {
				return res, err
			}
		} else if c.Phase == PhaseStaged {
			if ok, err := m.stillStaged(ctx, c); err != nil {
				return res, err
			} else if ok {
				m.log.Info("volume already staged", "volume", c.Volume, "device", c.MountDevice(), "staging", staging)
				return StageResult{Device: c.MountDevice(), Method: c.Method}, nil
			}
		}
	} else {
		c = &Claim{Volume: r.Volume, Locator: r.Locator, StagingPath: staging, FsType: fsType, Block: r.Block,
			MountFlags: r.MountFlags, ReadOnly: r.ReadOnly, Encrypted: r.Encrypted}
	}
	return m.stage(ctx, c, r)
}

// stillStaged reports whether a recorded stage is intact: device open and
// verified, fence intact, filesystem mounted.
func (m *Manager) stillStaged(ctx context.Context, c *Claim) (bool, error) {
	l := m.getLive(c.Volume)
	if l == nil {
		return false, nil
	}
	if err := l.dev.Verify(ctx); err != nil {
		return false, nil
	}
	if c.State == StateHeld && l.fencer == nil {
		// Opened at start without its fencer (the check failed then): the
		// stage runs again and claims it afresh.
		return false, nil
	}
	if l.fencer != nil {
		if err := l.fencer.Check(ctx); err != nil {
			var lost *fence.LostError
			if errors.As(err, &lost) {
				m.lose(c, l.dev, lost)
				return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, lost)
			}
			return false, agenterr.New(agenterr.Unavailable, "volume %s: checking the fence of %s: %v", c.Volume, l.dev.Path, err)
		}
	}
	if c.Block {
		return true, nil
	}
	mp, err := m.mounter.IsMountPoint(c.StagingPath)
	return err == nil && mp, nil
}

// dropLost undoes what is left of a lost claim so that a granted stage can
// start over: the read-only staging mount and the mapping go; the record
// keeps Formatted.
func (m *Manager) dropLost(c *Claim) error {
	if err := m.unmountIfMounted(c.StagingPath); err != nil {
		return err
	}
	if c.Mapper != "" && m.o.Crypt != nil {
		if err := m.o.Crypt.Close(context.Background(), mapperName(c.Volume)); err != nil {
			return fmt.Errorf("volume %s: closing the dm-crypt mapping of the lost claim: %w", c.Volume, err)
		}
		c.Mapper = ""
	}
	m.setLive(c.Volume, nil)
	c.Phase, c.State, c.Detail, c.HolderKey, c.HolderNode = PhaseInterrupted, "", "", 0, ""
	return m.store.Put(c)
}

// claimedBy names another volume whose staged claim is on the disk devnum.
func (m *Manager) claimedBy(devnum, volume string) string {
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume != volume && o.DevNum == devnum && o.Phase == PhaseStaged && !o.Missing {
			return o.Volume
		}
	}
	return ""
}

func mapperName(volume string) string {
	var b strings.Builder
	b.WriteString("vco-")
	for _, r := range volume {
		if r < 128 && (r == '-' || r == '_' || r == '.' || (r >= '0' && r <= '9') || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z')) {
			b.WriteRune(r)
		} else {
			fmt.Fprintf(&b, "_%02x", r)
		}
	}
	s := b.String()
	if len(s) > 120 {
		s = s[:120]
	}
	return s
}

func (m *Manager) stage(ctx context.Context, c *Claim, r StageRequest) (res StageResult, err error) {
	isNew := c.Phase == ""
	dev, err := locate(ctx, m.finder, r.Locator, m.o.Config.AllowLoopDevices)
	if err != nil {
		return res, fmt.Errorf("volume %s: %w", r.Volume, err)
	}
	// Whatever fails from here leaves no device open, no fence held and,
	// for a first attempt, no record.
	var fencer fence.Fencer
	acquired, mapped, mounted, roCleared := false, false, false, false
	defer func() {
		if err == nil {
			return
		}
		if roCleared && !acquired {
			if rerr := setReadOnly(dev.File, true); rerr != nil {
				m.log.Error("could not set a disk read-only again after a failed claim", "volume", c.Volume, "device", dev.Path, "err", rerr)
			}
		}
		// Undo in reverse: nothing stays mounted or mapped on a disk whose
		// fence this node gives back.
		if mounted {
			if uerr := m.unmountIfMounted(c.StagingPath); uerr != nil {
				m.log.Error("could not unmount after a failed stage", "volume", c.Volume, "err", uerr)
			}
		}
		if mapped {
			if cerr := m.o.Crypt.Close(context.WithoutCancel(ctx), mapperName(c.Volume)); cerr != nil {
				m.log.Error("could not close the dm-crypt mapping after a failed stage", "volume", c.Volume, "err", cerr)
			}
			c.Mapper = ""
		}
		if acquired && fencer != nil {
			if rerr := fencer.Release(context.WithoutCancel(ctx)); rerr != nil {
				m.log.Error("could not release the fence after a failed stage", "volume", c.Volume, "device", dev.Path, "err", rerr)
			}
		}
		m.setLive(c.Volume, nil)
		dev.Close()
		if isNew && !c.Formatted && !c.LUKSFormatted && !c.LUKSFormatting && !c.FenceFormatted {
			if err := dropDataMapping(c.DataDevice); err != nil {
				m.log.Error("could not detach the data mapping of a failed stage", "volume", c.Volume, "err", err)
			}
			if derr := m.store.Delete(c.Volume); derr != nil {
				m.log.Error("could not remove the claim record of a failed stage", "volume", c.Volume, "err", derr)
			}
		} else if c.Phase != "" {
			c.Phase = PhaseInterrupted
			if perr := m.store.Put(c); perr != nil {
				m.log.Error("could not record the interrupted stage", "volume", c.Volume, "err", perr)
			}
		}
	}()
	// One disk, one volume: a second volume staged from the same disk
	// would mount it twice, and its unstage would release the fence the
	// first one still relies on.
	if other := m.claimedBy(dev.DevNum(), c.Volume); other != "" {
		return res, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: disk %s is already staged on this node as volume %s; unstage that volume first", c.Volume, dev.Path, other)
	}
	m.setLive(c.Volume, nil)
	c.Device, c.DevNum, c.Serial, c.Missing = dev.Path, dev.DevNum(), dev.Serial, false
	if c.Phase == "" {
		c.Phase = PhaseClaiming
	}
	// From this record on the watcher leaves the disk alone (Classify).
	m.watchMu.Lock()
	err = m.store.Put(c)
	m.watchMu.Unlock()
	if err != nil {
		return res, err
	}

	choice, err := m.o.Fencers.Choose(ctx, dev, c.Volume, m.onLost(c.Volume))
	if err != nil {
		return res, agenterr.New(agenterr.Unavailable, "volume %s: choosing how to fence %s: %v", c.Volume, dev.Path, err)
	}
	if err := m.leaseDataRule(ctx, dev, c.Volume, &choice); err != nil {
		closeChoice(choice)
		return res, err
	}
	fencer = choice.Fencer
	if fencer == nil {
		if !r.AllowUnfenced || !m.o.Config.AllowUnfenced {
			return res, agenterr.New(agenterr.FailedPrecondition,
				"volume %s: disk %s offers no fencing: %s; such a disk is staged only with an explicit opt-in (the request's allow_unfenced and the agent's volumes.allow_unfenced)",
				c.Volume, dev.Path, choice.Reason)
		}
		m.log.Warn("staging a volume WITHOUT fencing by explicit opt-in: nothing stops another node from writing this disk",
			"volume", c.Volume, "device", dev.Path, "reason", choice.Reason)
		c.Method, c.State, c.Key = fence.MethodNone, StateUnfenced, 0
	} else {
		if choice.Method == MethodLease {
			// The lease is taken by writing this node's slot on the disk:
			// a disk refused earlier (read-only) must take that write. A
			// refusal now sets it read-only again.
			if ro, rerr := readOnly(dev.File); rerr == nil && ro {
				if err := setReadOnly(dev.File, false); err != nil {
					return res, fmt.Errorf("volume %s: %w", c.Volume, err)
				}
				roCleared = true
			}
		}
		if choice.Prepare != nil {
			wrote, err := choice.Prepare(ctx)
			if err != nil {
				return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: preparing %s for %s fencing: %v", c.Volume, dev.Path, choice.Method, err)
			}
			if wrote {
				c.FenceFormatted = true
				m.log.Info("wrote the fencing metadata on a blank disk", "volume", c.Volume, "device", dev.Path, "fence", choice.Method)
				if err := m.store.Put(c); err != nil {
					return res, err
				}
			}
		}
		claim, err := m.acquire(ctx, fencer, c.Volume, dev, r.Grant, r.NeverPublished)
		var held *fence.HeldError
		switch {
		case errors.As(err, &held):
			m.refuse(c, dev, held)
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, held)
		case err != nil:
			var lost *fence.LostError
			if errors.As(err, &lost) {
				return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: %v", c.Volume, err)
			}
			if ctx.Err() != nil {
				// The caller gave up (the reclaim wait outlasted its
				// deadline): its code says so, and its retry waits again.
				return res, fmt.Errorf("volume %s: %w", c.Volume, err)
			}
			return res, agenterr.New(agenterr.Unavailable, "volume %s: fencing %s: %v", c.Volume, dev.Path, err)
		}
		acquired = true
		c.Method, c.State, c.Key = choice.Method, StateHeld, claim.Key
		if len(claim.Preempted) > 0 {
			keys := make([]string, len(claim.Preempted))
			for i, k := range claim.Preempted {
				keys[i] = k.String()
			}
			m.publish(events.Event{Type: events.TakeoverGranted, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
				HolderKey: uint64(claim.Preempted[0]), Reason: "takeover-granted",
				Message: fmt.Sprintf("volume %s: took disk %s over from key(s) %s with the controller's grant", c.Volume, dev.Path, strings.Join(keys, ", "))})
		}
	}
	// A refusal earlier may have left the device read-only; it is ours now.
	if ro, rerr := readOnly(dev.File); rerr == nil && ro && !r.ReadOnly {
		if err := setReadOnly(dev.File, false); err != nil {
			return res, fmt.Errorf("volume %s: %w", c.Volume, err)
		}
		m.log.Info("cleared the read-only flag of a disk now claimed by this node", "volume", c.Volume, "device", dev.Path)
	}
	m.setLive(c.Volume, &live{dev: dev, fencer: fencer})
	c.DataOffset, c.DataDevice = choice.DataOffset, ""
	if choice.DataOffset > 0 {
		if c.DataDevice, err = m.dataMapping(dev.Path, choice.DataOffset, r.ReadOnly); err != nil {
			return res, fmt.Errorf("volume %s: %w", c.Volume, err)
		}
	}
	if err := m.store.Put(c); err != nil {
		return res, err
	}

	target := c.BaseDevice()
	var unlock Mapped
	var headerNote string
	if r.Encrypted {
		if m.o.Crypt == nil {
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s is encrypted, but this agent has no LUKS2 support; install an agent built with it", c.Volume)
		}
		formatted, err := m.prepareLUKS(ctx, c, target, r)
		if err != nil {
			return res, err
		}
		res.Formatted = formatted
		mp, err := m.o.Crypt.Open(ctx, target, mapperName(c.Volume), r.Passphrase, r.ReadOnly)
		if err != nil {
			hint := ""
			if errors.Is(err, luks2.ErrWrongPassphrase) {
				hint = "; the node plugin must unwrap the passphrase kept in the header's transit token (GetVolumeToken)"
			}
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: opening LUKS2 on %s: %w%s", c.Volume, target, err, hint)
		}
		mapped = true
		unlock = mp
		if len(mp.HeaderDamage) > 0 {
			headerNote = fmt.Sprintf("; its LUKS2 header is damaged (%s), opened from the %s copy by %s; 'vco-agent luks repair' rewrites both copies",
				strings.Join(mp.HeaderDamage, "; "), mp.Source, mp.Reader)
			m.log.Warn("opened an encrypted volume whose LUKS2 header is damaged", "volume", c.Volume, "device", target,
				"source", mp.Source, "reader", mp.Reader, "damage", strings.Join(mp.HeaderDamage, "; "))
		}
		c.Mapper, target = mp.Path, mp.Path
		if err := m.store.Put(c); err != nil {
			return res, err
		}
	}

	if !r.Block {
		made, err := m.mountFS(ctx, c, target)
		if err != nil {
			return res, err
		}
		mounted = true
		res.Formatted = res.Formatted || made
	}
	c.Phase, c.Detail = PhaseStaged, ""
	if err := m.store.Put(c); err != nil {
		return res, err
	}
	msg := fmt.Sprintf("volume %s staged on %s", c.Volume, target)
	if c.State == StateUnfenced {
		msg += " without fencing (explicit opt-in)"
	} else {
		msg += fmt.Sprintf(", fenced with %s key %s", c.Method, c.Key)
	}
	msg += headerNote
	m.markClaimed(dev.Name)
	m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(c.Key), Reason: "staged", Message: msg})
	m.log.Info("volume staged", "volume", c.Volume, "device", dev.Path, "mapped", c.Mapper, "unlocked_by", unlock.Reader, "staging", c.StagingPath,
		"fs", c.FsType, "fence", c.Method, "formatted", res.Formatted)
	return StageResult{Device: target, Method: c.Method, Formatted: res.Formatted}, nil
}

// mountFS mounts the filesystem device carries, or makes one on a device
// proven blank and mounts that; a device with anything else on it is
// refused, never formatted.
func (m *Manager) mountFS(ctx context.Context, c *Claim, device string) (bool, error) {
	if mp, err := m.mounter.IsMountPoint(c.StagingPath); err == nil && mp {
		src, err := m.mountSource(c.StagingPath)
		if err != nil {
			return false, err
		}
		if !sameDevice(src, device) {
			return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: the staging path %s already has %s mounted on it, not %s; unmount it first",
				c.Volume, c.StagingPath, src, device)
		}
		return false, nil
	}
	existing, err := filesystemOn(ctx, device)
	if err != nil {
		return false, fmt.Errorf("volume %s: reading the signatures on %s (blkid): %w", c.Volume, device, err)
	}
	var proof blank.Proof
	switch {
	case existing == "" && c.Formatted:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: this agent made a %s filesystem on the volume earlier, but %s now shows no signature; it will not format it again: check that the right disk is attached",
			c.Volume, c.FsType, device)
	case existing == "" && c.ReadOnly:
		return false, agenterr.New(agenterr.FailedPrecondition, "volume %s: %s is blank and the volume is read-only; there is nothing to mount", c.Volume, device)
	case existing == "" && c.Encrypted && c.LUKSFormatted:
		// The plaintext of a LUKS2 volume this agent formatted over a
		// device it proved blank reads as noise, not zeros.
		if proof, err = proveEncrypted(ctx, c.Volume, device); err != nil {
			return false, err
		}
	case existing == "":
		if proof, err = proveBlank(ctx, c.Volume, device, "filesystem"); err != nil {
			return false, err
		}
	case existing != c.FsType:
		return false, agenterr.New(agenterr.FailedPrecondition,
			"volume %s: %s carries %q, not the requested %s filesystem; the agent neither formats over existing data nor mounts it as another type",
			c.Volume, device, existing, c.FsType)
	}
	d, err := mkdirBeneath(m.o.Config.KubeletRoot, c.StagingPath, 0o750)
	if err != nil {
		return false, fmt.Errorf("volume %s: creating the staging path: %w", c.Volume, err)
	}
	d.Close()
	opts := slices.Clone(c.MountFlags)
	if c.ReadOnly {
		opts = append(opts, "ro")
	}
	if c.FsType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A volume cloned from a snapshot carries its source's xfs UUID;
		// without nouuid the second of the two would not mount here.
		opts = append(opts, "nouuid")
	}
	opts = append(opts, "defaults")
	formatted := proof.Valid()
	if formatted {
		if err := makeFS(ctx, proof, c.FsType); err != nil {
			return false, agenterr.New(agenterr.Internal, "volume %s: %v", c.Volume, err)
		}
		c.Formatted = true
		m.log.Info("made a filesystem on a device proven blank", "volume", c.Volume, "device", device, "fs", c.FsType)
	} else if !c.ReadOnly {
		if err := m.fsck(ctx, c.Volume, device); err != nil {
			return false, err
		}
	}
	if err := m.mounter.Mount(device, c.StagingPath, c.FsType, opts); err != nil {
		return formatted, agenterr.New(agenterr.Internal, "volume %s: mounting %s at %s: %v", c.Volume, device, c.StagingPath, err)
	}
	return formatted, nil
}

func (m *Manager) mountSource(p string) (string, error) {
	mps, err := m.mounter.List()
	if err != nil {
		return "", fmt.Errorf("reading the mount table: %w", err)
	}
	src := ""
	for _, mp := range mps {
		if mp.Path == p {
			src = mp.Device // the last one is on top
		}
	}
	return src, nil
}

func sameDevice(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return a == b
	}
	return sa.Rdev == sb.Rdev
}

// refuse is P2: the disk is held elsewhere; set it read-only, mount
// nothing, say who holds it.
func (m *Manager) refuse(c *Claim, dev *Device, held *fence.HeldError) {
	if err := setReadOnly(dev.File, true); err != nil {
		m.log.Error("could not set a refused disk read-only", "volume", c.Volume, "device", dev.Path, "err", err)
	}
	m.o.Metrics.refusals.Inc()
	m.publish(events.Event{Type: events.DiskRefused, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(held.Holder), HolderNode: held.HolderNode, Reason: "held-by-another-node",
		Message: fmt.Sprintf("volume %s: %v", c.Volume, held)})
	m.log.Warn("disk refused", "volume", c.Volume, "device", dev.Path, "holder", held.Holder.String(), "holder_node", held.HolderNode)
}

// onLost is given to fencers that notice a loss by themselves. I/O stops
// at once, without waiting for the volume's lock (an API call may hold
// it); the loss is then recorded and announced under the lock. It
// reports stopped (the fencer may then tell the taker so) only when the
// disk was set read-only, the filesystem stopped and every layer below
// it drained.
func (m *Manager) onLost(volume string) func(*fence.LostError) bool {
	return func(lost *fence.LostError) bool {
		l := m.getLive(volume)
		stopped := true
		if l != nil {
			if err := setReadOnly(l.dev.File, true); err != nil {
				m.log.Error("could not set a fenced disk read-only", "volume", volume, "err", err)
				stopped = false
			}
		}
		c, err := m.store.Get(volume)
		if err == nil && c != nil && !c.Block && c.Phase == PhaseStaged {
			if err := m.stopFilesystem(c.StagingPath, c.MountDevice()); err != nil {
				m.log.Error("could not stop writes to the filesystem of a fenced volume", "volume", volume, "err", err)
				stopped = false
			}
		}
		go m.recordLoss(volume, lost)
		if l == nil || err != nil || c == nil {
			m.log.Warn("the stop of a lost claim's I/O cannot be confirmed here", "volume", volume)
			return false
		}
		if err := m.drainData(c, l.dev.File); err != nil {
			m.log.Error("could not show the fenced volume's devices quiet", "volume", volume, "err", err)
			stopped = false
		}
		return stopped
	}
}

func (m *Manager) recordLoss(volume string, lost *fence.LostError) {
	var release func()
	for i := 0; ; i++ {
		var err error
		if release, err = m.locks.try(volume, "recording a lost claim"); err == nil {
			break
		}
		if i > 600 {
			m.log.Error("the volume stayed busy; its loss is recorded by the next claim check", "volume", volume)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer release()
	c, err := m.store.Get(volume)
	if err != nil || c == nil || c.State == StateLost {
		return
	}
	var dev *Device
	if l := m.getLive(volume); l != nil {
		dev = l.dev
	}
	m.lose(c, dev, lost)
	m.updateGauge()
}

// lose is P4: stop I/O at once, say so, and remember it.
func (m *Manager) lose(c *Claim, dev *Device, lost *fence.LostError) {
	if dev != nil {
		if err := setReadOnly(dev.File, true); err != nil {
			m.log.Error("could not set a fenced disk read-only", "volume", c.Volume, "device", dev.Path, "err", err)
		}
	}
	if !c.Block && c.Phase == PhaseStaged {
		if err := m.stopFilesystem(c.StagingPath, c.MountDevice()); err != nil {
			m.log.Error("could not stop writes to the filesystem of a fenced volume", "volume", c.Volume, "staging", c.StagingPath, "err", err)
		}
	}
	m.clearClaimed(filepath.Base(c.Device))
	c.State, c.Detail, c.HolderKey, c.HolderNode = StateLost, lost.Error(), lost.Holder, lost.HolderNode
	if err := m.store.Put(c); err != nil {
		m.log.Error("could not record a lost claim", "volume", c.Volume, "err", err)
	}
	m.o.Metrics.fences.Inc()
	m.publish(events.Event{Type: events.DiskFenced, Volume: c.Volume, Device: c.Device, Serial: c.Serial,
		HolderKey: uint64(lost.Holder), HolderNode: lost.HolderNode, Reason: "claim-lost",
		Message: fmt.Sprintf("volume %s: %v", c.Volume, lost)})
	m.log.Error("claim lost; I/O to the disk stopped", "volume", c.Volume, "device", c.Device, "reason", lost.Reason)
}

// fsIocShutdown is FS_IOC_SHUTDOWN (_IOR('X', 125, __u32)), which ext4 and
// xfs implement; with NOLOGFLUSH the filesystem stops without writing.
const (
	fsIocShutdown        = 0x8004587d
	fsShutdownNoLogFlush = 2
)

// stopFilesystem remounts the filesystem mounted at p (the staging path
// of a claim whose device is device) read-only (the superblock, so every
// bind mount of it too); when files are open for writing and the remount
// is refused, it shuts the filesystem down instead. The block layer's
// read-only flag alone does not stop a mounted filesystem from writing.
//
// p is opened once, beneath the kubelet root and through no symlink, and
// both the remount and the shutdown act on that descriptor. Only a mount
// root is touched, and only one whose filesystem is on device (when the
// device node is there to compare): a claim recorded as staged whose
// staging path is no longer mounted (an unstage killed after its
// unmount), or a path swapped since it was checked, would otherwise have
// the remount and the shutdown land on another filesystem -- the node's
// root.
func (m *Manager) stopFilesystem(p, device string) error {
	f, err := openBeneath(m.o.Config.KubeletRoot, p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w; left alone", p, err)
	}
	defer f.Close()
	if mp, err := isMountRoot(f); err != nil || !mp {
		if err != nil {
			return fmt.Errorf("%s: is it a mount point? %w; left alone", p, err)
		}
		return nil
	}
	var mst, dst unix.Stat_t
	if device != "" && unix.Fstat(int(f.Fd()), &mst) == nil && unix.Stat(device, &dst) == nil && mst.Dev != dst.Rdev {
		return fmt.Errorf("%s holds the filesystem of device %d:%d, not %s's; left alone", p, unix.Major(mst.Dev), unix.Minor(mst.Dev), device)
	}
	err = unix.Mount("", fdPath(f), "", unix.MS_REMOUNT|unix.MS_RDONLY, "")
	if err == nil {
		return nil
	}
	if serr := unix.IoctlSetPointerInt(int(f.Fd()), fsIocShutdown, fsShutdownNoLogFlush); serr != nil {
		return fmt.Errorf("remount read-only: %v; shutdown: %v", err, serr)
	}
	return nil
}

// unmountIfMounted unmounts the mount at p, reached beneath the kubelet
// root without following a symlink (unmountBeneath).
func (m *Manager) unmountIfMounted(p string) error {
	if _, err := unmountBeneath(m.o.Config.KubeletRoot, p, 0); err != nil {
		if agenterr.KindOf(err) != agenterr.Internal {
			return err
		}
		return agenterr.New(agenterr.FailedPrecondition, "%v; is something still using it?", err)
	}
	return nil
}
