package luks2

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"strings"

	"golang.org/x/sync/semaphore"
)

// The validator bounds what one key derivation may cost (MaxArgonWorkKiB
// and the others), but a bounded derivation can still take minutes on a
// slow node and cannot be interrupted: x/crypto's argon2 and pbkdf2 take no
// context. A process that unlocks volumes on others' behalf (the agent)
// therefore bounds unlocks from the outside: UnlockContext stops trying
// keyslots when its context ends and abandons a derivation in flight, a
// KDFBudget caps the derivations running at once (abandoned ones included)
// and the memory they declare, and keyslots that declare more memory than
// the caller allows are not tried at all.

// ErrKDFLimit is returned when the only keyslots that might accept the
// passphrase were not tried because their key derivation needs more memory
// than the caller allows.
var ErrKDFLimit = errors.New("key derivation needs more memory than allowed")

// KDFBudget bounds the key derivations that run at once: how many, and the
// memory they declare together. It is shared by every unlock of a process.
type KDFBudget struct {
	memoryKiB int64
	memory    *semaphore.Weighted
	running   *semaphore.Weighted
}

// NewKDFBudget allows at most concurrent derivations at once, declaring
// at most memoryKiB together.
func NewKDFBudget(memoryKiB, concurrent int) *KDFBudget {
	return &KDFBudget{
		memoryKiB: int64(memoryKiB),
		memory:    semaphore.NewWeighted(int64(memoryKiB)),
		running:   semaphore.NewWeighted(int64(max(concurrent, 1))),
	}
}

// acquire waits, until ctx ends, for room to run a derivation declaring
// memKiB. A nil budget admits everything.
func (b *KDFBudget) acquire(ctx context.Context, memKiB int) (release func(), err error) {
	if b == nil {
		return func() {}, nil
	}
	if int64(memKiB) > b.memoryKiB {
		return nil, fmt.Errorf("%w: it declares %d KiB, the budget of all derivations at once is %d KiB", ErrKDFLimit, memKiB, b.memoryKiB)
	}
	if err := b.running.Acquire(ctx, 1); err != nil {
		return nil, fmt.Errorf("waiting for other key derivations to finish: %w", context.Cause(ctx))
	}
	if err := b.memory.Acquire(ctx, int64(memKiB)); err != nil {
		b.running.Release(1)
		return nil, fmt.Errorf("waiting for the memory of other key derivations: %w", context.Cause(ctx))
	}
	return func() {
		if memKiB > 0 {
			// Hand the derivation's memory back before the next one
			// counted against the budget allocates its own.
			debug.FreeOSMemory()
		}
		b.memory.Release(int64(memKiB))
		b.running.Release(1)
	}, nil
}

// UnlockLimits bound what UnlockContext spends on key derivation.
type UnlockLimits struct {
	// MaxMemoryKiB: keyslots whose derivation declares more memory are
	// not tried. 0 leaves only the header bound (MaxArgonMemoryKiB).
	MaxMemoryKiB int
	// Budget is shared by the unlocks of a process; nil imposes none.
	Budget *KDFBudget
}

// UnlockContext is Unlock within limits: keyslots whose derivation needs
// more memory than lim allows are passed over, no further keyslot is tried
// once ctx ends, and a derivation still running then is abandoned (it
// finishes in the background, its key is discarded, and it keeps its share
// of the budget until it does).
func (v *Volume) UnlockContext(ctx context.Context, passphrase []byte, lim UnlockLimits) ([]byte, int, error) {
	var key []byte
	slot, err := v.trySlots(ctx, lim, func(id string) error {
		k, err := v.openSlotContext(ctx, id, passphrase, lim.Budget)
		key = k
		return err
	})
	if err != nil {
		return nil, -1, err
	}
	return key, slot, nil
}

// Unseal opens the volume with another implementation's keyslot code
// (luks.go's, in package crypt) under the rules of UnlockContext: this
// validated header decides which keyslots are tried and in which order,
// keyslots above lim.MaxMemoryKiB are passed over, each call of unseal
// runs within lim.Budget declaring its keyslot's memory, and once ctx ends
// no further keyslot is tried and a call in flight is abandoned: it runs
// to its end in the background on its own copy of the passphrase, keeps
// its share of the budget until then, and what it returns goes to discard.
// unseal reports a passphrase its keyslot refuses with ErrWrongPassphrase.
func Unseal[T any](ctx context.Context, v *Volume, passphrase []byte, lim UnlockLimits, unseal func(slot int, passphrase []byte) (T, error), discard func(T)) (T, int, error) {
	var out T
	slot, err := v.trySlots(ctx, lim, func(id string) error {
		n, _ := strconv.Atoi(id)
		mem := v.Header.Meta.Keyslots[id].KDF.memoryKiB()
		r, err := runBounded(ctx, "unseal", mem, lim.Budget, passphrase, func(pass []byte) (T, error) { return unseal(n, pass) }, discard)
		if err != nil {
			return fmt.Errorf("%s: keyslot %s: %w", v.path, id, err)
		}
		out = r
		return nil
	})
	if err != nil {
		var zero T
		return zero, -1, err
	}
	return out, slot, nil
}

// trySlots calls open for each keyslot in priority order within lim until
// one succeeds, and returns that keyslot's number. open reports a
// passphrase its keyslot refuses with ErrWrongPassphrase.
func (v *Volume) trySlots(ctx context.Context, lim UnlockLimits, open func(id string) error) (int, error) {
	var tried, skipped []string
	for _, n := range v.Slots() {
		id := strconv.Itoa(n)
		if mem := v.Header.Meta.Keyslots[id].KDF.memoryKiB(); lim.MaxMemoryKiB > 0 && mem > lim.MaxMemoryKiB {
			skipped = append(skipped, fmt.Sprintf("%s (%d KiB)", id, mem))
			continue
		}
		if ctx.Err() != nil {
			return -1, fmt.Errorf("%s: stopped unlocking before keyslot %s, having tried [%s]: %w", v.path, id, strings.Join(tried, " "), context.Cause(ctx))
		}
		err := open(id)
		if errors.Is(err, ErrWrongPassphrase) {
			tried = append(tried, id)
			continue
		}
		if err != nil {
			return -1, err
		}
		return n, nil
	}
	if len(skipped) > 0 {
		return -1, fmt.Errorf("%s: no keyslot tried ([%s]) accepts the passphrase, and keyslots %s were not tried: %w (%d KiB per derivation here)",
			v.path, strings.Join(tried, " "), strings.Join(skipped, ", "), ErrKDFLimit, lim.MaxMemoryKiB)
	}
	return -1, fmt.Errorf("%s: %w", v.path, ErrWrongPassphrase)
}

// deriveContext runs k within budget b and returns when it is done or ctx
// ends, whichever comes first. It works on its own copy of the passphrase,
// which the caller may clear as soon as this returns.
func deriveContext(ctx context.Context, k KDF, passphrase []byte, keyLen int, b *KDFBudget) ([]byte, error) {
	return runBounded(ctx, "key derivation ("+k.Type+")", k.memoryKiB(), b, passphrase,
		func(pass []byte) ([]byte, error) { return k.derive(pass, keyLen) }, func(key []byte) { clear(key) })
}

// runBounded runs f (named what in errors), which declares memKiB of
// memory, within budget b and returns when it is done or ctx ends,
// whichever comes first. f works on
// its own copy of the passphrase, which the caller may clear as soon as
// this returns; a result that arrives after ctx ended goes to discard.
func runBounded[T any](ctx context.Context, what string, memKiB int, b *KDFBudget, passphrase []byte, f func(pass []byte) (T, error), discard func(T)) (T, error) {
	var zero T
	release, err := b.acquire(ctx, memKiB)
	if err != nil {
		return zero, err
	}
	if ctx.Done() == nil {
		defer release()
		return f(passphrase)
	}
	type result struct {
		v   T
		err error
	}
	pass := bytes.Clone(passphrase)
	out := make(chan result)
	go func() {
		defer release()
		r, err := f(pass)
		clear(pass)
		select {
		case out <- result{r, err}:
		case <-ctx.Done():
			if err == nil && discard != nil {
				discard(r)
			}
		}
	}()
	select {
	case r := <-out:
		return r.v, r.err
	case <-ctx.Done():
		return zero, fmt.Errorf("%s abandoned: %w", what, context.Cause(ctx))
	}
}
