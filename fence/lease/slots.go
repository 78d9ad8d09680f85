package lease

// Which slot a claim is written to, and the slots an acquisition clears:
// a slot is reused only once its owner is shown gone.

import (
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// pickSlot chooses our slot: the one already carrying our key, else the
// first empty one in an order derived from the key, so that hosts tend
// not to compete for the same slot, else the first released or fenced one
// of another key. A slot of another key is the last choice: its host may
// be claiming it again right now (its new claim goes to the slot that
// carries its key), and of two claims written to one slot the later
// erases the earlier, which its writer may already hold. Held slots of
// other hosts are reused only through reclaimSlot, after their expiry
// bound.
//
// An empty FastSlot is written only by a fast first claim (fast): a host
// that did not see that claim in its read, and so may race it, never
// picks the same slot, where the later of two claims would erase the
// fast one unseen.
func (e *Engine) pickSlot(a *Area, victim int, fast bool) int {
	if i := a.Find(e.cfg.Key); i >= 0 {
		return i
	}
	if fast {
		return FastSlot
	}
	start := e.slotOrder()
	for _, empty := range []bool{true, false} {
		for j := range Slots {
			i := (start + j) % Slots
			if i == victim || a.Corrupt[i] || a.Slots[i].Live() || (empty && a.Slots[i].State != StateEmpty) ||
				(i == FastSlot && a.Slots[i].State == StateEmpty) {
				continue
			}
			return i
		}
	}
	return -1
}

// clearGone clears the slots of other hosts that the acquisition just
// waited out for their expiry bound (and that a is the last read of), if
// they still hold what was waited on: held slots, and slots that do not
// decode (a write torn by its host's reset). Those hosts have stopped
// their I/O or been reset; a write of theirs landing later makes the slot
// held (or torn) again, and the next acquirer waits for it as before.
// Called with the lease held; a failure only costs the next acquirer a
// wait.
//
// A slot that does not decode in a is one the race check found unchanged
// since the read the wait ended on (tornSince), and the wait found it
// unchanged since its first read: it stayed as it is for its expiry
// bound, which a live writer's next write cannot outlast.
func (e *Engine) clearGone(ctx context.Context, a *Area, gone []int, ours int) {
	zero := make([]byte, BlockSize)
	for _, i := range gone {
		if i == ours || (!a.Corrupt[i] && !a.Slots[i].Live()) {
			continue
		}
		b, err := e.dev.ReadArea(ctx, e.cfg.Timing.IOTimeout)
		if err != nil || !bytes.Equal(b[BlockSize*(1+i):BlockSize*(2+i)], a.Raw[i]) {
			continue
		}
		if err := e.dev.writeSlot(ctx, i, zero, e.cfg.Timing.IOTimeout); err != nil {
			e.log.Warn("could not clear the lease slot of a holder that is gone", "slot", i, "error", err)
			continue
		}
		if a.Corrupt[i] {
			e.log.Info("cleared a lease slot that did not decode and stayed unchanged for its expiry bound (a write torn by its host's reset)", "slot", i)
			continue
		}
		e.log.Info("cleared the lease slot of a holder gone for its expiry bound", "slot", i, "key", a.Slots[i].Key.String(), "node", a.Slots[i].Node)
	}
}

// slotOrder is where this key starts looking for a slot.
func (e *Engine) slotOrder() int {
	h := fnv.New32a()
	fmt.Fprint(h, uint64(e.cfg.Key))
	return int(h.Sum32() % Slots)
}

// reclaimSlot picks a held slot of another host, other than the victim's,
// or a slot that does not decode (a write torn by its host's reset), that
// awaitExpiry has just seen unchanged for its writer's expiry bound (a
// holder that died, on a disk whose every slot is used). A write that
// the gone holder had in flight and that lands later can only overwrite
// our claim, which we then lose: safe, if slower. Hosts racing for the
// same slot see each other's claim in the settle check.
func (e *Engine) reclaimSlot(a *Area, victim int) int {
	start := e.slotOrder()
	for j := range Slots {
		i := (start + j) % Slots
		if i == victim || (!a.Corrupt[i] && (a.Slots[i].Key == e.cfg.Key || (i == FastSlot && a.Slots[i].State == StateEmpty))) {
			continue
		}
		e.log.Warn("every lease slot is used; reclaiming the slot of a holder gone for its expiry bound", "slot", i,
			"key", a.Slots[i].Key.String(), "node", a.Slots[i].Node, "torn", a.Corrupt[i])
		return i
	}
	return -1
}

// withdraw marks a slot we wrote during a failed acquisition released, if
// it still holds what we wrote. When it cannot tell or cannot write, the
// claim is kept as unconfirmed: the next acquisition's read withdraws it
// then, and it is never resumed as ours.
func (e *Engine) withdraw(ctx context.Context, idx int, s Slot, blk []byte) bool {
	keep := &claimWrite{idx: idx, slot: s, blk: blk}
	b, err := e.dev.ReadArea(context.WithoutCancel(ctx), e.cfg.Timing.IOTimeout)
	if err != nil {
		e.unconfirmed = keep
		return false
	}
	if !bytes.Equal(b[BlockSize*(1+idx):BlockSize*(2+idx)], blk) {
		return true
	}
	s.State = StateReleased
	s.Counter++
	s.Written = time.Now().UnixNano()
	if err := e.dev.writeSlot(context.WithoutCancel(ctx), idx, EncodeSlot(s), e.cfg.Timing.IOTimeout); err != nil {
		e.log.Warn("could not withdraw our lease record after a failed acquisition", "slot", idx, "error", err)
		e.unconfirmed = keep
		return false
	}
	return true
}

// testHookClaimWrite, when set by a test, runs just before a claim is
// written to slot idx.
var testHookClaimWrite func(e *Engine, idx int, blk []byte)

// testHookFirstRead, when set by a test, runs when AcquireFirst has read
// the lease area (and cleared any copies), before it claims.
var testHookFirstRead func(e *Engine)

func (e *Engine) refusal(a *Area, holder fence.Key, s *Slot, grant *fence.Grant) *fence.HeldError {
	he := &fence.HeldError{Device: e.dev.name, Holder: holder, HolderNode: e.resolve(holder, s), Granted: grant != nil}
	for i, sl := range a.Slots {
		if sl.Live() && !a.Corrupt[i] && sl.Key != e.cfg.Key {
			he.Registered = append(he.Registered, sl.Key)
		}
	}
	e.log.Warn("disk refused", "holder", holder.String(), "holder_node", he.HolderNode)
	return he
}
