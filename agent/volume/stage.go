package volume

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/fence"
)

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
	if r.Encrypted {
		if m.o.Crypt == nil {
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s is encrypted, but this agent has no LUKS2 support; install an agent built with it", c.Volume)
		}
		formatted, err := m.prepareLUKS(ctx, c, target, r)
		if err != nil {
			return res, err
		}
		res.Formatted = formatted
		dmPath, err := m.o.Crypt.Open(ctx, target, mapperName(c.Volume), r.Passphrase, r.ReadOnly)
		if err != nil {
			hint := ""
			if errors.Is(err, luks2.ErrWrongPassphrase) {
				hint = "; the node plugin must unwrap the passphrase kept in the header's transit token (GetVolumeToken)"
			}
			return res, agenterr.New(agenterr.FailedPrecondition, "volume %s: opening LUKS2 on %s: %w%s", c.Volume, target, err, hint)
		}
		mapped = true
		c.Mapper, target = dmPath, dmPath
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
	m.markClaimed(dev.Name)
	m.publish(events.Event{Type: events.DiskClaimed, Volume: c.Volume, Device: dev.Path, Serial: dev.Serial,
		HolderKey: uint64(c.Key), Reason: "staged", Message: msg})
	m.log.Info("volume staged", "volume", c.Volume, "device", dev.Path, "mapped", c.Mapper, "staging", c.StagingPath,
		"fs", c.FsType, "fence", c.Method, "formatted", res.Formatted)
	return StageResult{Device: target, Method: c.Method, Formatted: res.Formatted}, nil
}
