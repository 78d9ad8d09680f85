// Package agentnodetest holds what the node plugin's tests need to run
// vco-agent's volume manager on this host: LoopLUKS, the agent's real
// LUKS2 support with a FAKE dm-crypt mapping (crypt/dmcrypt/dmcrypttest),
// because the host kernel has no device-mapper; ServeAgent, the agent's
// API over a unix socket with the plugin's client dialled to it; and
// Transit, a FAKE transit engine, because no Vault or OpenBao runs here.
// It is imported by tests only and never linked into a binary; real
// dm-crypt runs in the lab's guests.
package agentnodetest

import (
	"context"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt/dmcrypttest"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// LoopLUKS formats, inspects and checks passphrases with the agent's real
// LUKS2 code; its mapping is dmcrypttest's FAKE (unencrypted) loop mapping
// at the header's data offset, so mkfs and mount run for real on it.
type LoopLUKS struct {
	volume.LUKS
	*dmcrypttest.LoopMapping
}

// NewLoopLUKS returns a LoopLUKS with a cheap KDF (the cost is not what
// the tests check) whose loop devices go when t ends.
func NewLoopLUKS(t testing.TB) *LoopLUKS {
	return &LoopLUKS{
		LUKS:        volume.LUKS{KDF: luks2.KDFParams{Time: 1, MemoryKiB: 32, Threads: 1}},
		LoopMapping: dmcrypttest.NewLoopMapping(t),
	}
}

// Open checks the passphrase against the header and maps the data segment.
func (l *LoopLUKS) Open(ctx context.Context, device, name string, pass []byte, ro bool) (volume.Mapped, error) {
	p, err := l.LoopMapping.Open(ctx, device, name, pass, ro)
	return volume.Mapped{Path: p, Reader: dmcrypttest.Reader}, err
}

// Close removes the mapping's loop device.
func (l *LoopLUKS) Close(ctx context.Context, name string) error {
	return l.LoopMapping.Close(ctx, name)
}

// Resize makes the mapping's loop device pick up its backing device's size.
func (l *LoopLUKS) Resize(ctx context.Context, name string) error {
	return l.LoopMapping.Resize(ctx, name)
}
