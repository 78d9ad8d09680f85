package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// ContentKind is what a volume's device holds where LUKS2 goes.
type ContentKind string

const (
	ContentBlank ContentKind = "blank"
	ContentLUKS2 ContentKind = "luks2"
	ContentOther ContentKind = "other"
)

// Content is what Encryption.Inspect found.
type Content struct {
	Kind ContentKind
	// UUID and Token are those of a LUKS2 header; Token is nil when the
	// header has no vco-transit token.
	UUID  string
	Token *luks2.TransitToken
	// Detail names the data of ContentOther, or why a header was refused.
	Detail string
}

// LUKS is the agent's Encryption, built on package crypt: LUKS2 headers
// written and read in Go, mapped with dm-crypt. Format, Inspect and the
// passphrase check need no device-mapper; Open, Close and Resize do.
type LUKS struct {
	// KDF is the cost of the keyslot Format makes; zero fields take
	// luks2.DefaultKDF's (argon2id, 4 passes, 64 MiB, 2 threads).
	KDF luks2.KDFParams
	// CloseTimeout is how long Close waits for a busy mapping
	// (crypt.CloseTimeout when 0).
	CloseTimeout time.Duration

	// Open's key derivations are bounded (docs/encryption.md): a header
	// is not secret, so its cost is whatever its writer chose, and the
	// agent unlocks under the volume's lock. KDFMaxMemoryKiB: keyslots
	// declaring more memory are not tried (DefaultKDFMaxMemoryKiB when 0).
	// KDFBudgetKiB and KDFConcurrent: the memory and number of derivations
	// running at once, abandoned ones included (DefaultKDFBudgetKiB and
	// DefaultKDFConcurrent when 0). UnlockTimeout: no keyslot is tried, and
	// a derivation in flight is abandoned, after this long
	// (DefaultUnlockTimeout when 0).
	KDFMaxMemoryKiB int
	KDFBudgetKiB    int
	KDFConcurrent   int
	UnlockTimeout   time.Duration

	budgetOnce sync.Once
	budget     *luks2.KDFBudget
}

// The defaults of the bounds on Open's key derivations. The agent's own
// keyslots declare 64 MiB (luks2.DefaultKDF); a keyslot declaring more than
// four times that was not made by the agent, and the agent, which only
// holds the passphrase of the keyslot its token opens, has no use for it.
const (
	DefaultKDFMaxMemoryKiB = 256 << 10
	DefaultKDFBudgetKiB    = 512 << 10
	DefaultKDFConcurrent   = 2
	DefaultUnlockTimeout   = time.Minute
)

func orDefault[T int | time.Duration](v, d T) T {
	if v == 0 {
		return d
	}
	return v
}

func (l *LUKS) unlockLimits() luks2.UnlockLimits {
	l.budgetOnce.Do(func() {
		l.budget = luks2.NewKDFBudget(orDefault(l.KDFBudgetKiB, DefaultKDFBudgetKiB), orDefault(l.KDFConcurrent, DefaultKDFConcurrent))
	})
	return luks2.UnlockLimits{MaxMemoryKiB: orDefault(l.KDFMaxMemoryKiB, DefaultKDFMaxMemoryKiB), Budget: l.budget}
}

var _ Encryption = (*LUKS)(nil)

// Inspect implements Encryption. A device is blank only when both the
// LUKS2 package's probe and blkid's low-level probe find nothing.
func (l *LUKS) Inspect(_ context.Context, device string) (Content, error) {
	v, err := luks2.Open(device, false)
	if err == nil {
		defer v.Close()
		ct := Content{Kind: ContentLUKS2, UUID: v.Header.UUID}
		_, tok, err := v.TransitToken()
		if err != nil {
			return Content{Kind: ContentOther, Detail: fmt.Sprintf("a LUKS2 header whose %s token is damaged: %v", luks2.TransitTokenType, err)}, nil
		}
		ct.Token = tok
		return ct, nil
	}
	if !errors.Is(err, luks2.ErrNotLUKS2) {
		var perr *os.PathError
		if errors.As(err, &perr) {
			return Content{}, fmt.Errorf("reading %s: %w", device, err)
		}
		// A header that does not pass validation is data we must not
		// touch (docs/encryption.md: refuse, never guess).
		return Content{Kind: ContentOther, Detail: fmt.Sprintf("a LUKS2 header this agent refuses: %v", err)}, nil
	}
	sig, err := probeSignature(device)
	if err != nil {
		return Content{}, err
	}
	if sig != "" {
		return Content{Kind: ContentOther, Detail: sig}, nil
	}
	return Content{Kind: ContentBlank}, nil
}

// probeSignature runs luks2's probe and then `blkid -p`, which knows more
// formats (some at the end of the device), and returns what either found.
func probeSignature(device string) (string, error) {
	f, err := os.Open(device)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", device, err)
	}
	defer f.Close()
	size, err := f.Seek(0, 2)
	if err != nil {
		return "", fmt.Errorf("size of %s: %w", device, err)
	}
	sig, err := luks2.DetectSignature(f, uint64(size))
	if err != nil || sig != "" {
		return sig, err
	}
	out, err := exec.Command("blkid", "-p", "-o", "export", device).Output()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee) && ee.ExitCode() == 2:
		return "", nil // blkid: nothing found
	case err != nil:
		return "", fmt.Errorf("probing %s with blkid: %v", device, err)
	}
	var found []string
	for _, line := range strings.Split(string(out), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && (k == "TYPE" || k == "PTTYPE") {
			found = append(found, v)
		}
	}
	if len(found) == 0 {
		found = []string{"a signature blkid recognises"}
	}
	return "blkid finds " + strings.Join(found, ", "), nil
}

// luksHeaderArea is what luks2.Format writes: the two headers and the
// keyslot area before the data, 16 MiB.
const luksHeaderArea = 16 << 20

// Format implements Encryption: aes-xts-plain64 with a 512-bit key, one
// argon2id keyslot, 4096-byte sectors where the data area allows (else
// 512), the token in the very first header. The device is the one p
// proved blank; luks2's own signature check is set aside (Force) only for
// a proof of everything past the header area, which is the agent's own
// format a crash cut short.
func (l *LUKS) Format(_ context.Context, p blank.Proof, passphrase []byte, tok luks2.TransitToken) error {
	if !p.Valid() || p.Simulated() || p.From() > luksHeaderArea {
		return errors.New("no proof that the device is blank; no LUKS2 header is written")
	}
	if err := tok.Check(); err != nil {
		return err
	}
	if mem, limit := l.formatMemoryKiB(), orDefault(l.KDFMaxMemoryKiB, DefaultKDFMaxMemoryKiB); mem > limit {
		return fmt.Errorf("the agent's keyslot cost (%d KiB of argon2 memory) is above what its own unlock allows (%d KiB); it would format %s into a volume it cannot open", mem, limit, p.Device())
	}
	o := luks2.FormatOptions{
		Passphrase: passphrase, KDF: l.KDF, Force: p.From() > 0,
		TransitToken: &tok,
	}
	if n, err := deviceSize(p.Device()); err == nil && (n-16<<20)%4096 != 0 {
		o.SectorSize = 512
	}
	if err := p.StillNames(); err != nil {
		return err
	}
	v, err := luks2.Format(p.Device(), o)
	if err != nil {
		return err
	}
	return v.Close()
}

// formatMemoryKiB is the argon2 memory of the keyslot Format makes.
func (l *LUKS) formatMemoryKiB() int {
	switch l.KDF.Type {
	case "", "argon2id", "argon2i":
		return orDefault(l.KDF.MemoryKiB, luks2.DefaultKDF.MemoryKiB)
	}
	return 0
}

// Mapped is what Encryption.Open mapped, and how.
type Mapped struct {
	// Path is the mapping's device node.
	Path string
	// Reader names the code that unsealed the keyslot and set the
	// mapping up (crypt.ReaderLuksGo or crypt.ReaderOwn).
	Reader string
	// Source is the LUKS2 header copy read; HeaderDamage, when not
	// empty, what is wrong with the other copy. The stage's event says
	// so; nothing is repaired.
	Source       string
	HeaderDamage []string
}

// Open implements Encryption through crypt.Unlock: the header validated by
// crypt/luks2, the keyslot unsealed and the mapping set up by luks.go, or
// by crypt/luks2 when the primary header is damaged or the mapping is
// read-only. The unlock gives up when ctx ends or UnlockTimeout passes,
// whichever is first, so the volume's lock is never held across an
// unbounded run of key derivations.
func (l *LUKS) Open(ctx context.Context, device, name string, passphrase []byte, readOnly bool) (Mapped, error) {
	timeout := orDefault(l.UnlockTimeout, DefaultUnlockTimeout)
	ctx, cancel := context.WithTimeoutCause(ctx, timeout,
		fmt.Errorf("unlocking took longer than the agent allows (%v): %w", timeout, context.DeadlineExceeded))
	defer cancel()
	op, err := crypt.Unlock(ctx, device, name, passphrase, crypt.OpenOptions{ReadOnly: readOnly, KDF: l.unlockLimits()})
	return Mapped{Path: op.Path, Reader: op.Reader, Source: op.Source, HeaderDamage: op.HeaderDamage}, err
}

// Close implements Encryption.
func (l *LUKS) Close(_ context.Context, name string) error {
	t := l.CloseTimeout
	if t == 0 {
		t = crypt.CloseTimeout
	}
	return crypt.Close(name, t)
}

// Resize implements Encryption.
func (l *LUKS) Resize(_ context.Context, name string) error {
	_, err := crypt.Resize(name)
	return err
}
